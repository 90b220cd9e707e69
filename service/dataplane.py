"""The one facade every protocol calls: health, metadata, model config, inference and the model repository.

REST (``api``) and gRPC are thin codecs around it: they decode a request against the model's ``Signature``
(``model_for_infer`` gives the version to decode against), call ``infer``, and encode what comes back. Every
name and version a client sends is checked here (``check_name``, ``parse_version``: one rule for every route
and protocol), so odd names never reach the store, logs or metric labels. Errors are ``service.errors``
classes; each protocol renders them its own way.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from service.errors import BadRequestError
from service.model_config import ModelConfig
from service.registry.acceptance import validate_model_name
from service.registry.manager import ModelManager
from service.registry.version import InferenceResult, ModelState, ModelVersion
from service.runtime.contract import InferenceRequest, TensorSpec

SERVER_NAME = "onnx-cnn-serve"
PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ["binary_tensor_data", "model_configuration"]
_VERSION_RE = re.compile(r"[1-9][0-9]{0,17}")
MAX_VERSION = 10**18 - 1
"""The largest version a client may name: 18 digits, so every accepted version fits an int64."""


@functools.cache
def server_version() -> str:
    try:
        return importlib.metadata.version("onnx-cnn-serve")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout without installing
        return "0.0.0+local"


def check_name(name: str) -> str:
    """The store's name rule, applied before any lookup."""
    return validate_model_name(name)


def parse_version(text: str | None) -> int | None:
    """A model version as a client wrote it in text (a path or query parameter; None: the latest): digits
    without sign, space or leading zero, from 1 to ``MAX_VERSION``. Anything else is the 400 of
    ``version_number``, the same on every route and in every protocol."""
    if text is None:
        return None
    if isinstance(text, str) and _VERSION_RE.fullmatch(text):
        return int(text)
    return version_number(text)


def version_number(value: object) -> int:
    """A model version a client sent as a number (a JSON body, a protobuf integer): an integer (not a bool,
    not a float, not text) from 1 to ``MAX_VERSION``, else the one 400 for a bad version."""
    if type(value) is int and 1 <= value <= MAX_VERSION:
        return value
    raise BadRequestError("model version must be a positive integer")


class DataPlane:
    """Health, metadata and inference over one process's ``ModelManager``."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager
        self.shutting_down = False
        self.start_failed: str | None = None

    # ------------------------------------------------------------------ health
    @property
    def ready(self) -> bool:
        """Every stored model loaded and warmed, and no shutdown begun."""
        return not self.shutting_down and self.start_failed is None and self.manager.ready

    def not_ready_reason(self) -> str:
        if self.shutting_down:
            return "shutting down"
        if self.start_failed is not None:
            return f"startup failed: {self.start_failed}"
        return "loading models"

    def begin_shutdown(self) -> None:
        """Readiness turns false at once (the server calls this from its SIGTERM handler)."""
        self.shutting_down = True

    # ------------------------------------------------------------------ metadata
    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": server_version(), "extensions": list(EXTENSIONS)}

    def find(self, name: str, version: str | None = None) -> ModelVersion:
        """The addressed version in any state (metadata is useful while loading); the newest ready by default."""
        return self.manager.table.find(check_name(name), parse_version(version))

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        mv = self.find(name, version)
        ready = [str(v.version) for v in self.manager.table.versions(mv.name) if v.state is ModelState.READY]
        return {"name": mv.name, "versions": ready, "platform": PLATFORM, **mv.signature.to_dict()}

    def model_ready(self, name: str, version: str | None = None) -> ModelVersion:
        """The version when it is ready to serve; NotFoundError / ModelNotReadyError otherwise."""
        return self.manager.table.get(check_name(name), parse_version(version))

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """The version's configuration in Triton's model-config shape (what tritonclient reads)."""
        mv = self.find(name, version)
        batched = mv.max_batch_size > 0
        return {
            "name": mv.name,
            "platform": PLATFORM,
            "backend": "onnxruntime",
            "max_batch_size": mv.max_batch_size,
            "input": [_tensor_config(s, batched) for s in mv.signature.inputs],
            "output": [_tensor_config(s, batched) for s in mv.signature.outputs],
            "dynamic_batching": {"max_queue_delay_microseconds": round(mv.config.max_delay_s * 1e6)},
            "version_policy": {"latest": {"num_versions": 1}},
        }

    # ------------------------------------------------------------------ inference
    def model_for_infer(self, name: str | None, version: str | int | None = None) -> ModelVersion:
        """The READY version a request addresses (the only model when no name is given): ``version`` as text
        (``parse_version``) or as a number (``version_number``)."""
        number = parse_version(version) if version is None or isinstance(version, str) else version_number(version)
        table = self.manager.table
        if name is None:
            only = table.only_model()
            return only if number is None or number == only.version else table.get(only.name, number)
        return table.get(check_name(name), number)

    async def infer(self, mv: ModelVersion, request: InferenceRequest, *, alone: bool = False) -> InferenceResult:
        """Run a request that passed ``mv.signature``; ``alone``: the caller knows of no other in progress."""
        return await mv.infer(request, alone=alone)

    # ------------------------------------------------------------------ repository
    def new_staging_file(self) -> Path:
        return self.manager.new_staging_file()

    async def upload(self, name: str, staged: Path, config: ModelConfig) -> ModelVersion:
        return await self.manager.upload(check_name(name), staged, config)

    async def delete(self, name: str, version: str) -> int:
        number = parse_version(version)
        assert number is not None
        await self.manager.delete(check_name(name), number)
        return number

    def versions(self, name: str) -> list[ModelVersion]:
        return self.manager.table.versions(check_name(name))

    def models(self) -> list[tuple[str, list[ModelVersion]]]:
        table = self.manager.table
        return [(name, table.versions(name)) for name in table.names()]


def describe_version(mv: ModelVersion) -> dict[str, Any]:
    """Signature, state, config, sha256, time, engine choice and optimization report of a version, without
    anything that looks like a server path (defence in depth: none should be there)."""
    return _public(mv.describe())


def _tensor_config(spec: TensorSpec, batched: bool) -> dict[str, Any]:
    dims = spec.kserve_shape()[1:] if batched else spec.kserve_shape()
    return {"name": spec.name, "data_type": f"TYPE_{spec.datatype}", "format": "FORMAT_NONE", "dims": dims}


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "~", "\\")) or ":\\" in value[:4]


def _public(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items() if not (isinstance(v, str) and _looks_like_path(v))}
    if isinstance(value, list | tuple):
        return [_public(v) for v in value if not (isinstance(v, str) and _looks_like_path(v))]
    return value


def version_summaries(versions: Iterable[ModelVersion]) -> list[dict[str, Any]]:
    return [{"version": mv.version, "state": mv.state.value, "error": mv.error} for mv in versions]
