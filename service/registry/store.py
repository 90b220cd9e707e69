"""Durable on-disk model repository.

Layout::

    root/.staging/<owner>-<uuid>...   uploads and optimizer outputs in progress
    root/.owners/<owner>.lock         held (flock) by the live process that owns the entries tagged <owner>
    root/.lock, root/.prepare.lock    version numbers; preparing a fresh store (demo model, imports)
    root/.tuner-faults.json           configurations refused on a GPU: faulted or computed differently
                                      (``runtime.tuner_faults``)
    root/<name>/<version>/            one complete version: original.onnx, optimized.onnx (+ variants such
                                      as optimized-plain.onnx), metadata.json (.optimize.lock: optimizing
                                      it again)
    root/<name>/.tmp-<owner>-<uuid>/  a version being built, or being deleted
    root/<name>/.last-version         highest version ever allocated (numbers are never reused)

Why it is built this way: a crash (kill -9, power loss) at any moment must never leave a half-visible
version. A version is assembled in a hidden temp folder on the same filesystem, every file fsynced, and
then appears in one ``rename``; single files are replaced the same way (temp file in the same folder,
fsync, rename, fsync the folder). Version numbers are allocated under a lock (a thread lock plus an
``flock`` for other processes sharing the folder, on this host or another), so concurrent uploads to one name
get distinct versions; metadata is changed under the same lock by read-modify-write (``update_metadata``), so
two processes never lose each other's changes. Every in-progress entry names its owner, and a cleanup removes
it only once that owner is gone (``locks``): a replica that starts never removes another one's work.
Names are validated and every path is resolved and checked to stay directly under the root.
A full disk gives ``InsufficientStorageError`` (507) with nothing half-written.

A write the filesystem refuses (full disk, quota, read-only mount, permissions) raises the 507 error that
``service.errors.storage_error`` names, with nothing half-written; a store that cannot be written is
still read (listing, loading), and startup's cleanup only logs what it could not remove.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from service.errors import BadRequestError, NotFoundError, storage_error
from service.registry.acceptance import validate_model_name
from service.registry.locks import Claim, OwnerCheck

log = logging.getLogger(__name__)

ORIGINAL = "original.onnx"
METADATA = "metadata.json"
STAGING = ".staging"
OWNERS = ".owners"
_LAST_VERSION = ".last-version"
_LOCK = ".lock"
_PREPARE_LOCK = ".prepare.lock"
_OPTIMIZE_LOCK = ".optimize.lock"
_TUNER_FAULTS = ".tuner-faults.json"
MAX_TUNER_FAULTS = 500
"""Fault entries kept (the newest): a bound on the file, far above what a store meets (a few per GPU model)."""
_TMP_PREFIX = ".tmp-"
_TAG_RE = re.compile(r"([0-9a-f]{16})-[0-9a-f]{32}", re.ASCII)
"""``<owner>-<uuid>``: the tag of every in-progress entry (staging entries, temp folders, temp files)."""
_ARTIFACT_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}\.(onnx|json)", re.ASCII)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cache_key(original_sha256: str, optimizer_version: str, fields: dict[str, Any]) -> str:
    """Identifies an optimized artifact: same original, optimizer version and graph settings -> reuse."""
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{original_sha256}\n{optimizer_version}\n{payload}".encode()).hexdigest()


@contextlib.contextmanager
def _disk_errors() -> Iterator[None]:
    """A refused write (no space, quota, read-only, permissions) -> its 507 error; other OSErrors propagate."""
    try:
        yield
    except OSError as exc:
        error = storage_error(exc)
        if error is None:
            raise
        raise error from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    """Create ``path`` exclusively, write, fsync (no rename: for files inside an invisible folder)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, owner: str = "") -> None:
    """Replace ``path`` atomically: temp file in the same folder (tagged with ``owner``), fsync, rename, fsync
    the folder."""
    tag = f"{owner}-{uuid.uuid4().hex}" if owner else uuid.uuid4().hex
    tmp = path.parent / f".{path.name}.{tag}.tmp"
    try:
        _write_file(tmp, data)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove(path: Path) -> None:
    """Remove a file, link or folder without ever following a symlink (OSError: what refused it)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path)


class ModelStore:
    """One process' handle on the store: it owns (``owner``) the in-progress entries it creates until ``close``."""

    def __init__(self, root: Path) -> None:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve()
        self.staging_dir = self.root / STAGING
        self._lock = threading.Lock()
        try:
            self._ensure_staging()
        except OSError as exc:  # a read-only store still serves what it holds; uploads will say why they fail
            log.warning("store: cannot create the staging folder (%s)", exc.strerror or exc)
        self._claim: Claim | None = None
        try:
            self._claim = Claim(self.root / OWNERS)
        except OSError as exc:  # a read-only store: nothing this process could leave in progress anyway
            log.warning("store: cannot claim an owner lock (%s)", exc.strerror or exc)
        self.owner = self._claim.owner if self._claim is not None else uuid.uuid4().hex[:16]

    def close(self) -> None:
        """Give up the claim: whatever this store left in progress becomes a leftover for a cleanup."""
        if self._claim is not None:
            self._claim.close()

    def _tag(self) -> str:
        return f"{self.owner}-{uuid.uuid4().hex}"

    # ------------------------------------------------------------------ paths

    def model_dir(self, name: str) -> Path:
        """``root/<name>`` for a validated name, refusing anything that would resolve elsewhere."""
        validate_model_name(name)
        path = self.root / name
        if path.is_symlink() or path.resolve().parent != self.root:
            raise BadRequestError("invalid model name")
        return path

    def version_dir(self, name: str, version: int) -> Path:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise NotFoundError("model versions are positive integers")
        path = self.model_dir(name) / str(version)
        if path.is_symlink() or not (path / METADATA).is_file():
            raise NotFoundError(f"model {name!r} has no version {version}")
        return path

    def file_path(self, name: str, version: int, filename: str) -> Path:
        """Path of a stored file of a complete version (for reading)."""
        if filename not in (ORIGINAL, METADATA) and not _ARTIFACT_RE.fullmatch(filename):
            raise BadRequestError("invalid artifact name")
        return self.version_dir(name, version) / filename

    # ------------------------------------------------------------------ staging

    def _ensure_staging(self) -> None:
        self.staging_dir.mkdir(exist_ok=True)

    def new_staging_file(self, suffix: str = ".part") -> Path:
        """A fresh empty file under ``.staging`` (same filesystem as the store, so it can be renamed in: an
        upload becomes the version's ``original.onnx``, mode 0644 less the umask like the store's other files)."""
        path = self.staging_dir / f"{self._tag()}{suffix}"
        with _disk_errors():
            self._ensure_staging()
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return path

    def new_staging_dir(self) -> Path:
        path = self.staging_dir / f"{self._tag()}.d"
        with _disk_errors():
            self._ensure_staging()
            path.mkdir(mode=0o700)
        return path

    # ------------------------------------------------------------------ writing

    def add_version(
        self,
        name: str,
        staged_original: Path,
        *,
        files: dict[str, Path] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> int:
        """Store a new complete version and return its number.

        ``staged_original`` and ``files`` (artifact name -> staged path, e.g. ``optimized.onnx``) are
        moved in. ``metadata`` is written last, with ``name`` and ``version`` filled in.
        """
        files = dict(files or {})
        for filename in files:
            if filename in (ORIGINAL, METADATA) or not _ARTIFACT_RE.fullmatch(filename):
                raise BadRequestError("invalid artifact name")
        model_dir = self.model_dir(name)
        with _disk_errors():
            if not model_dir.is_dir():
                model_dir.mkdir(exist_ok=True)
                _fsync_dir(self.root)
            building = model_dir / f"{_TMP_PREFIX}{self._tag()}"
            building.mkdir()
            try:
                self._move_in(staged_original, building / ORIGINAL)
                for filename, source in files.items():
                    self._move_in(source, building / filename)
                return self._publish(name, model_dir, building, dict(metadata or {}))
            except BaseException:
                shutil.rmtree(building, ignore_errors=True)
                raise

    def _move_in(self, source: Path, target: Path) -> None:
        _fsync_file(source)
        try:
            os.rename(source, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            shutil.copyfile(source, target)
            _fsync_file(target)
            source.unlink(missing_ok=True)

    def _publish(self, name: str, model_dir: Path, building: Path, metadata: dict[str, Any]) -> int:
        with self._locked():
            version = self._next_version(model_dir)
            metadata.update(name=name, version=version)
            _write_file(building / METADATA, _dump(metadata))
            _fsync_dir(building)
            os.rename(building, model_dir / str(version))  # the version appears complete, at once
            atomic_write(model_dir / _LAST_VERSION, str(version).encode(), owner=self.owner)
        return version

    def _next_version(self, model_dir: Path) -> int:
        highest = max(self._version_numbers(model_dir, complete_only=False), default=0)
        with contextlib.suppress(OSError, ValueError):
            highest = max(highest, int((model_dir / _LAST_VERSION).read_text().strip()))
        return highest + 1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            fd = os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def write_artifact(self, name: str, version: int, filename: str, data: bytes) -> None:
        """Atomically create or replace an optimized artifact of an existing version (cache refresh)."""
        if filename in (ORIGINAL, METADATA) or not _ARTIFACT_RE.fullmatch(filename):
            raise BadRequestError("invalid artifact name")
        with _disk_errors():
            atomic_write(self.version_dir(name, version) / filename, data, owner=self.owner)

    def write_metadata(self, name: str, version: int, metadata: dict[str, Any]) -> None:
        data = dict(metadata, name=name, version=version)
        with _disk_errors():
            atomic_write(self.version_dir(name, version) / METADATA, _dump(data), owner=self.owner)

    def update_metadata(
        self, name: str, version: int, change: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> bool:
        """Read-modify-write under the store lock: ``change`` gets the metadata as stored now and returns the
        new one, or None to leave it as it is. True when it was written."""
        with self._locked():
            updated = change(self.read_metadata(name, version))
            if updated is not None:
                self.write_metadata(name, version, updated)
        return updated is not None

    def add_tuner_faults(self, entries: list[dict[str, Any]]) -> None:
        """Keep these faults beside the ones stored (read-modify-write under the store lock); an entry equal
        to a stored one but for ``seen`` replaces it."""
        with _disk_errors(), self._locked():
            fresh = {_fault_key(entry) for entry in entries}
            kept = [entry for entry in self.tuner_faults() if _fault_key(entry) not in fresh] + list(entries)
            atomic_write(self.root / _TUNER_FAULTS, _dump({"faults": kept[-MAX_TUNER_FAULTS:]}), owner=self.owner)

    def delete_version(self, name: str, version: int) -> None:
        """Remove a version: it disappears in one rename, then its files are deleted. When the rename is
        refused (read-only store, permissions) the version is still complete and the error says why."""
        path = self.version_dir(name, version)
        model_dir = path.parent
        trash = model_dir / f"{_TMP_PREFIX}{self._tag()}"
        with _disk_errors(), self._locked():
            os.rename(path, trash)
            _fsync_dir(model_dir)
        shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ locks held for longer
    @property
    def prepare_lock_path(self) -> Path:
        """Held by the one process that prepares the store (demo model, imports) at a time."""
        return self.root / _PREPARE_LOCK

    def optimize_lock_path(self, name: str, version: int) -> Path:
        """Held while a stale version is optimized again, so replicas starting together optimize it once."""
        return self.version_dir(name, version) / _OPTIMIZE_LOCK

    # ------------------------------------------------------------------ reading

    def read_metadata(self, name: str, version: int) -> dict[str, Any]:
        path = self.version_dir(name, version) / METADATA
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"metadata of {name} v{version} is unreadable: {type(exc).__name__}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"metadata of {name} v{version} is not an object")
        return data

    def tuner_faults(self) -> list[dict[str, Any]]:
        """The tuner faults kept in this store (none when the file is missing or unreadable)."""
        try:
            data = json.loads((self.root / _TUNER_FAULTS).read_bytes())
        except (OSError, ValueError):
            return []
        faults = data.get("faults") if isinstance(data, dict) else None
        return [entry for entry in faults if isinstance(entry, dict)] if isinstance(faults, list) else []

    def list_models(self) -> dict[str, list[int]]:
        """Every model name with its complete versions, ascending."""
        models: dict[str, list[int]] = {}
        for entry in sorted(self.root.iterdir()):
            if not self._is_model_dir(entry):
                continue
            versions = sorted(self._version_numbers(entry, complete_only=True))
            if versions:
                models[entry.name] = versions
        return models

    def is_fresh(self) -> bool:
        """No model was ever stored here (a store whose models were all deleted is not fresh)."""
        for entry in self.root.iterdir():
            if self._is_model_dir(entry) and (
                (entry / _LAST_VERSION).exists() or self._version_numbers(entry, complete_only=False)
            ):
                return False
        return True

    def _is_model_dir(self, entry: Path) -> bool:
        if entry.is_symlink() or not entry.is_dir():
            return False
        try:
            validate_model_name(entry.name)
        except BadRequestError:
            return False
        return True

    @staticmethod
    def _version_numbers(model_dir: Path, *, complete_only: bool) -> list[int]:
        numbers = []
        for entry in model_dir.iterdir():
            if not entry.name.isdigit() or str(int(entry.name)) != entry.name or int(entry.name) < 1:
                continue
            if entry.is_symlink() or not entry.is_dir():
                continue
            if complete_only and not (entry / METADATA).is_file():
                continue
            numbers.append(int(entry.name))
        return numbers

    # ------------------------------------------------------------------ startup

    def cleanup_leftovers(self) -> int:
        """Remove what processes that are gone left behind: their staging entries, temp folders and files,
        and versions without metadata. Entries of live owners (this one included) stay; entries without an
        owner tag (a release before tags) go. Safe to run while other processes work. Entries that cannot be
        removed (a read-only store) stay, invisible as before, and one log line says how many and why.
        Returns how many entries were removed."""
        if self._claim is None:  # a store this process could not claim in: it cannot remove anything either
            log.warning("store: leftovers not cleaned up (the store refused this process's owner lock)")
            return 0
        check = OwnerCheck(self.root / OWNERS, self.owner)
        try:
            leftovers = [e for e in (self.staging_dir.iterdir() if self.staging_dir.is_dir() else ())
                         if _leftover(check, e.name)]
            for model_dir in self.root.iterdir():
                if not self._is_model_dir(model_dir):
                    continue
                versions = {str(v) for v in self._version_numbers(model_dir, complete_only=False)}
                for entry in model_dir.iterdir():
                    if entry.name.startswith(_TMP_PREFIX) or entry.name.endswith(".tmp"):
                        leftovers += [entry] if _leftover(check, entry.name) else []
                    elif entry.name in versions:
                        leftovers += self._version_leftovers(entry, check)
            removed, failure = 0, None
            for entry in leftovers:
                try:
                    _remove(entry)
                    removed += 1
                except OSError as exc:
                    failure = exc
            reaped = check.reap_lock_files()
        finally:
            check.close()
        if removed or reaped:
            log.info("store: removed %d leftover entries of %d process(es) that are gone", removed, reaped)
        if failure is not None:
            error = storage_error(failure)
            why = error.message if error is not None else (failure.strerror or type(failure).__name__)
            log.warning("store: could not remove %d leftover entries (%s)", len(leftovers) - removed, why)
        return removed

    @staticmethod
    def _version_leftovers(version_dir: Path, check: OwnerCheck) -> list[Path]:
        if not (version_dir / METADATA).is_file():
            return [version_dir]
        return [e for e in version_dir.iterdir() if e.name.endswith(".tmp") and _leftover(check, e.name)]


def _leftover(check: OwnerCheck, name: str) -> bool:
    """An in-progress entry whose owner is gone, or one without an owner tag (a release before tags)."""
    tag = _TAG_RE.search(name)
    return tag is None or check.gone(tag.group(1))


def _fault_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a refused configuration the same one: the GPU model, ORT version, graph, configuration and
    fused-op library build (``runtime.tuner_faults``)."""
    return tuple(entry.get(k) for k in ("device", "ort_version", "graph_sha256", "config", "library"))


def _dump(data: dict[str, Any]) -> bytes:
    return json.dumps(data, indent=2, sort_keys=True, default=_json_default).encode()


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return value.name
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"not JSON-serializable: {type(value).__name__}")
