"""Models handed in as files: the import folder (``model_import_dir``).

Every ``*.onnx`` file directly in the folder (read-only; KServe's storage initializer downloads a
``storageUri`` into ``/mnt/models``) is imported at startup as the model named after the file's stem, unless a
version of that name already holds the same original (same sha256): a restart, or a second replica on the same
store, imports nothing again. ``<stem>.json`` beside the file, if there, is the model's config
(``ModelConfig``). An import is an upload (validated, optimized, verified, stored, loaded); a file that cannot be
imported is logged with the reason and skipped, and the others are served. The manager runs this in the
process that prepares the store, under the store's prepare lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

from pydantic import ValidationError

from service.errors import ServiceError, ShuttingDownError
from service.model_config import ModelConfig
from service.registry.acceptance import validate_new_model_name
from service.registry.control import Uploads
from service.registry.store import ModelStore, sha256_file

log = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 64 * 1024


class ImportRefused(ValueError):
    """A file of the import folder that is not imported; the message says why."""


async def import_models(manager: Uploads, folder: Path) -> list[str]:
    """Import every new ``*.onnx`` of ``folder``; returns the names imported."""
    imported = []
    for path in await asyncio.to_thread(model_files, folder):
        manager.check_accepting()
        try:
            if await import_one(manager, path):
                imported.append(path.stem)
        except ShuttingDownError:
            raise
        except (ImportRefused, ServiceError) as exc:
            log.error("model import: %s not imported: %s", path.name, getattr(exc, "message", None) or exc)
        except Exception:
            log.exception("model import: %s not imported", path.name)
    return imported


def model_files(folder: Path) -> list[Path]:
    """The ``*.onnx`` files directly in ``folder``, by name (none, logged, when it is not a readable folder)."""
    try:
        return sorted(p for p in folder.iterdir() if p.suffix == ".onnx" and p.is_file())
    except OSError as exc:
        log.error("model import: cannot read the folder %s: %s", folder, exc.strerror or exc)
        return []


async def import_one(manager: Uploads, path: Path) -> bool:
    """Import one file as the model named after it; False when that original is stored under that name."""
    try:
        name = validate_new_model_name(path.stem)
    except ServiceError as exc:
        raise ImportRefused(f"the file name does not make a model name ({exc.message})") from None
    config = await asyncio.to_thread(read_config, path.with_suffix(".json"))
    digest = await asyncio.to_thread(sha256_file, path)
    stored = await asyncio.to_thread(stored_version_of, manager.store, name, digest)
    if stored is not None:
        log.info("model import: %s is stored already as %s v%d", path.name, name, stored)
        return False
    staged = manager.new_staging_file()
    try:
        await asyncio.to_thread(shutil.copyfile, path, staged)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    mv = await manager.upload(name, staged, config)
    log.info("model import: %s imported as %s v%d", path.name, name, mv.version)
    return True


def read_config(path: Path) -> ModelConfig:
    """``<stem>.json`` as a ModelConfig; the service defaults when there is none."""
    if not path.is_file():
        return ModelConfig()
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ImportRefused(f"{path.name} is larger than {MAX_CONFIG_BYTES} bytes")
        data = json.loads(path.read_bytes())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ImportRefused(f"{path.name} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise ImportRefused(f"{path.name} is not a JSON object")
    try:
        config = ModelConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "config"
        raise ImportRefused(f"{path.name}: {where}: {first.get('msg', 'invalid')}") from None
    except ValueError as exc:
        raise ImportRefused(f"{path.name}: {exc}") from None
    return config


def stored_version_of(store: ModelStore, name: str, digest: str) -> int | None:
    """A complete version of ``name`` whose original has this sha256, if any."""
    for version in store.list_models().get(name, []):
        try:
            original = store.read_metadata(name, version).get("original")
        except (OSError, ValueError, ServiceError):
            continue
        if isinstance(original, dict) and original.get("sha256") == digest:
            return version
    return None
