"""The one facade every protocol calls: health, metadata, model config, inference and the model repository.

REST (``api``) and gRPC (``grpc``) are thin codecs around it: they decode a request against the model's
``Signature`` (``model_for_infer`` gives the version to decode against), call ``infer`` inside a
``RequestTrace`` (in flight, metrics, statistics), and encode what comes back. Every name and version a client
sends is checked here (``check_name``, ``parse_version``: one rule for every route and protocol), so odd names
never reach the store, logs or metric labels; so are the KServe V2 tensor rules both protocols share
(``v2_dtype``, ``requested_outputs``) and the admin token (``check_bearer``), so that
a request gets the same answer, word for word, on either protocol. Errors are ``service.errors`` classes; each
protocol renders them its own way.
"""

from __future__ import annotations

import functools
import hmac
import importlib.metadata
import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import SecretStr

from service import image_requests
from service.errors import (
    BadRequestError,
    ForbiddenError,
    InvalidInputError,
    NotSupportedError,
    UnauthorizedError,
    printable,
)
from service.image_requests import ImageDecoder
from service.imaging.config import MAX_TOP_K
from service.model_config import BACKEND, PLATFORM, ModelConfig, triton_parameters
from service.registry.acceptance import validate_model_name
from service.registry.manager import ModelManager
from service.registry.repository import Repository
from service.registry.statistics import RequestTimes
from service.registry.version import InferenceResult, ModelState, ModelVersion
from service.runtime.contract import KSERVE_TO_NUMPY, InferenceRequest, TensorSpec
from service.runtime.device import cuda_runtime
from service.shared_memory.table import SharedMemory
from service.shared_memory.tensors import RegionUse

if TYPE_CHECKING:
    from service.metrics import Metrics

SERVER_NAME = "onnx-cnn-serve"
EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration", "statistics", "model_repository"]
SHARED_MEMORY_EXTENSIONS = ["system_shared_memory", "cuda_shared_memory"]
UNSUPPORTED = {
    "trace": "the trace extension",
    "logging": "the logging extension",
}
"""Triton extensions clients call that this server does not implement (``not_supported``)."""
_VERSION_RE = re.compile(r"[1-9][0-9]{0,17}")
MAX_VERSION = 10**18 - 1
"""The largest version a client may name: 18 digits, so every accepted version fits an int64."""
DISABLED_MESSAGE = (
    "management endpoints are disabled: set SERVICE_ADMIN_TOKEN (at least 16 characters) on the server "
    "and send it as 'Authorization: Bearer <token>'"
)


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


def not_supported(extension: str) -> NotSupportedError:
    """The answer to a call of a Triton extension this server does not implement (``UNSUPPORTED`` keys)."""
    return NotSupportedError(f"{UNSUPPORTED[extension]} is not supported by this server")


def check_bearer(configured: SecretStr | None, authorization: str | None) -> None:
    """Raise 403 when no token is configured, 401 when the header is missing, malformed or wrong.

    Model servers have been taken over through management APIs left open (TorchServe "ShellTorch", Ray
    "ShadowRay"), so ours are closed by default. The token is compared in constant time on bytes
    (``hmac.compare_digest`` refuses non-ASCII ``str``), so neither timing nor an odd header can tell an
    attacker how much of it matched. REST passes the ``Authorization`` header, gRPC the ``authorization``
    metadata: one rule, one set of messages.
    """
    if configured is None:
        raise ForbiddenError(DISABLED_MESSAGE)
    if not authorization:
        raise UnauthorizedError("missing bearer token: send 'Authorization: Bearer <admin token>'")
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise UnauthorizedError("the Authorization header must be 'Bearer <admin token>'")
    # Header values arrive latin-1 decoded: encoding back gives the exact bytes the client sent.
    given = presented.strip().encode("latin-1", errors="replace")
    expected = configured.get_secret_value().encode("utf-8")
    if not hmac.compare_digest(given, expected):
        raise UnauthorizedError("wrong bearer token")


class InFlight:
    """How many inference requests this server process is handling, on every protocol: from the start of
    the handler (REST: while the body is still arriving) to the end of the answer."""

    QUIET_S = 0.5
    """How long the server must have served one request at a time before a request counts as alone."""

    def __init__(self) -> None:
        self.count = 0
        self.crowded_at = -math.inf  # when two or more were last in flight together

    def enter(self) -> None:
        self.count += 1
        if self.count > 1:
            self.crowded_at = time.monotonic()

    def leave(self) -> None:
        self.count -= 1

    def alone(self) -> bool:
        """Only this request is in flight, and none overlapped for QUIET_S. Under concurrent load a lone
        moment is common, but running a request inline then would stall the loop that is reading the
        others' bodies: measured on the CPU machine with 8 clients, throughput fell 18 % (ad hoc)."""
        return self.count <= 1 and time.monotonic() - self.crowded_at >= self.QUIET_S


class RequestTrace:
    """One inference request on either protocol, from its start to its answer: counted in ``InFlight`` while
    it lasts; ``finish`` records it in the metrics (with its protocol) and in the addressed version's
    statistics (``registry.statistics`` says what each time covers)."""

    __slots__ = ("answered", "dataplane", "endpoint", "model", "mv", "protocol", "result", "samples", "start",
                 "submitted")

    def __init__(self, dataplane: DataPlane, protocol: str, endpoint: str) -> None:
        self.dataplane, self.protocol, self.endpoint = dataplane, protocol, endpoint
        self.model = ""  # set once the request is resolved to a real model (bounded label values)
        self.mv: ModelVersion | None = None
        self.result: InferenceResult | None = None
        self.samples = 0
        self.submitted = self.answered = 0.0
        self.start = time.perf_counter()
        dataplane.inflight.enter()

    def resolved(self, mv: ModelVersion) -> None:
        self.mv, self.model = mv, mv.name

    def submitting(self, request: InferenceRequest) -> None:
        self.samples, self.submitted = request.batch, time.perf_counter()

    def done(self, result: InferenceResult) -> None:
        self.result, self.answered = result, time.perf_counter()

    def finish(self, outcome: str) -> None:
        """``outcome``: "success" or the error's code (``disconnected``, ``internal_error``, ...)."""
        self.dataplane.inflight.leave()
        total = time.perf_counter() - self.start
        result = self.result
        metrics = self.dataplane.metrics
        if metrics is not None:
            metrics.observe_request(self.model, self.endpoint, outcome, total, None if result is None else
                                    result.queue_s, None if result is None else result.compute_s, self.protocol)
        if self.mv is None:
            return
        ok = outcome == "success" and result is not None
        times = RequestTimes(total)
        if ok:
            assert result is not None
            times = RequestTimes(total, self.submitted - self.start, result.queue_s, result.compute_s,
                                 self.start + total - self.answered)
        self.mv.statistics.record_request(self.samples, ok, times)


class DataPlane:
    """Health, metadata, inference, statistics and the model repository over one process's ``ModelManager``."""

    def __init__(self, manager: ModelManager, metrics: Metrics | None = None, *,
                 shared_memory: SharedMemory | None = None) -> None:
        self.manager = manager
        settings = manager.settings
        self.shared_memory = shared_memory or SharedMemory(settings.shared_memory_mb, cuda=cuda_runtime,
                                                           remote=settings.shared_memory_remote)
        """The shared-memory regions this process serves from (``service.shared_memory``)."""
        self.metrics = metrics
        self.repository = Repository(manager)
        self.inflight = InFlight()
        self.shutting_down = False
        self.start_failed: str | None = None
        self.images = ImageDecoder()
        """This process's image decoding pool (``image_request``)."""

    # ------------------------------------------------------------------ health
    @property
    def ready(self) -> bool:
        """Every stored model loaded and warmed, no shutdown begun, every version with an engine that works
        (``registry.recovery``: false while one is being replaced after a GPU fault, and once one could not be),
        and (several devices) one device serving."""
        return self._not_ready() is None

    def not_ready_reason(self) -> str:
        return self._not_ready() or "loading models"

    def _not_ready(self) -> str | None:
        """Why the server is not ready, the first reason that holds; None when it is."""
        if self.shutting_down:
            return "shutting down"
        recovery = self.manager.recovery
        if recovery.lost is not None:
            return recovery.lost
        if recovery.recovering:
            replacing = "; ".join(f"{label} ({why})" for label, why in recovery.recovering.items())
            return f"replacing the engine of {replacing}"
        if self.start_failed is not None:
            return f"startup failed: {self.start_failed}"
        devices = self.manager.devices
        if devices is not None and not devices.serving():
            return f"no device serves (lost: {', '.join(devices.lost())})"
        return None if self.manager.ready else "loading models"

    def device_report(self) -> dict[str, list[str]] | None:
        """With several devices, which serve and which are lost (readiness shows it); None with one."""
        devices = self.manager.devices
        return None if devices is None else devices.report()

    def begin_shutdown(self) -> None:
        """Readiness turns false at once (the server calls this from its SIGTERM handler)."""
        self.shutting_down = True

    # ------------------------------------------------------------------ metadata
    def server_metadata(self) -> dict[str, Any]:
        shared = SHARED_MEMORY_EXTENSIONS if self.shared_memory.enabled else []
        return {"name": SERVER_NAME, "version": server_version(), "extensions": [*EXTENSIONS, *shared]}

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
        """The version's configuration in Triton's model-config shape (what tritonclient reads), the keys that
        Triton has no field for as its ``parameters``: an upload takes it unchanged as a config
        (``model_config.from_triton``)."""
        mv = self.find(name, version)
        batched = mv.signature.batchable  # Triton: max_batch_size 0 means the dims are the whole tensors
        return {
            "name": mv.name,
            "platform": PLATFORM,
            "backend": BACKEND,
            "max_batch_size": mv.max_batch_size if batched else 0,
            "input": [{**_tensor_config(s, batched), "format": "FORMAT_NONE"} for s in mv.signature.inputs],
            "output": [_tensor_config(s, batched) for s in mv.signature.outputs],
            "dynamic_batching": {"max_queue_delay_microseconds": round(mv.config.max_delay_ms * 1000)},
            "version_policy": {"latest": {"num_versions": 1}},
            "parameters": triton_parameters(mv.config.to_dict()),
        }

    # ------------------------------------------------------------------ inference
    def model_for_infer(self, name: str | None, version: str | int | None = None) -> ModelVersion:
        """The READY version a request addresses (``unnamed_model`` when no name is given): ``version`` as
        text (``parse_version``) or as a number (``version_number``)."""
        number = parse_version(version) if version is None or isinstance(version, str) else version_number(version)
        if name is None:
            return self.unnamed_model(number)
        return self.manager.table.get(check_name(name), number)

    def unnamed_model(self, number: int | None = None) -> ModelVersion:
        """The version a request that names no model gets (REST ``/predict``): ``SERVICE_DEFAULT_MODEL``'s while
        this server holds that model (a second upload does not change where such requests go), else the only
        model ready; with several and none of them the default, a 400 that names the models and the setting."""
        table = self.manager.table
        preferred = self.manager.settings.default_model
        if preferred is not None and preferred in table.names():
            return table.get(preferred, number)
        ready = table.ready_names()
        if len(ready) == 1:
            return table.get(ready[0], number)
        if not ready:
            raise BadRequestError("no model is loaded: upload one first")
        default = "is not set" if preferred is None else f"({preferred}) is not one of them"
        raise BadRequestError(f"several models are loaded and SERVICE_DEFAULT_MODEL {default}: name one of "
                              f"{', '.join(ready)} ('model' in the body, or ?model=)")

    async def infer(self, mv: ModelVersion, request: InferenceRequest, *, alone: bool = False) -> InferenceResult:
        """Run a request that passed ``mv.signature``; ``alone``: the caller knows of no other in progress."""
        return await mv.infer(request, alone=alone)

    async def image_request(
        self, mv: ModelVersion, images: Sequence[bytes], outputs: Sequence[str] | None = None
    ) -> InferenceRequest:
        """Encoded images (JPEG/PNG) -> ``mv``'s checked request, decoded off the event loop against its
        preprocessing (``image_requests``); 415 for a model without one, 413 for too many images."""
        return await image_requests.image_request(self.images, mv, images, outputs)

    def trace(self, protocol: str, endpoint: str) -> RequestTrace:
        return RequestTrace(self, protocol, endpoint)

    def regions(self) -> RegionUse:
        """The shared-memory regions of one request (``with``: released when it is answered)."""
        return RegionUse(self.shared_memory)

    # ------------------------------------------------------------------ statistics
    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics, of the versions that serve: every ready version, one model's, or one version. As in
        Triton, a model or version that does not serve (unloaded, loading, failed) has none (its counts went with
        its engine): asked for by name, it is refused as not ready (ModelNotReadyError), an unknown one not found."""
        table = self.manager.table
        if not name:
            if version:
                raise BadRequestError("give a model name with a version")
            versions = [mv for model in table.names() for mv in table.versions(model) if mv.state is ModelState.READY]
        elif version:
            versions = [self.model_ready(name, version)]
        else:
            versions = [mv for mv in self.versions(name) if mv.state is ModelState.READY] or [self.model_ready(name)]
        return {"model_stats": [mv.statistics.snapshot(mv.name, mv.version) for mv in versions]}

    # ------------------------------------------------------------------ repository extension
    def check_admin(self, authorization: str | None) -> None:
        """Management calls (upload, delete, load, unload) need the admin token, on every protocol."""
        check_bearer(self.manager.settings.admin_token, authorization)

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        return await self.repository.index(ready_only)

    async def load_model(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        _refuse_load_parameters(parameters or {})
        await self.repository.load(check_name(name))

    async def unload_model(self, name: str) -> None:
        await self.repository.unload(check_name(name))

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


def _refuse_load_parameters(parameters: Mapping[str, Any]) -> None:
    """Triton's load may carry a config or files to load instead of the repository's: not here."""
    if "config" in parameters or any(str(key).startswith("file:") for key in parameters):
        raise NotSupportedError("loading with a config or files is not supported by this server: upload a new "
                                "version instead")


# ------------------------------------------------------------------ KServe V2 tensor rules (REST and gRPC)
def v2_dtype(name: str, datatype: str) -> np.dtype:
    """The numpy dtype of a KServe datatype name, or a 400 naming the input."""
    dtype = KSERVE_TO_NUMPY.get(datatype)
    if dtype is not None:
        return dtype
    if datatype == "BYTES":
        raise InvalidInputError(f"input {name!r}: datatype BYTES is not supported (numeric tensors only)")
    raise InvalidInputError(
        f"input {name!r}: unknown datatype {datatype[:16]!r}; supported: {', '.join(KSERVE_TO_NUMPY)}"
    )


def class_count(value: Any, where: str) -> int:
    """The k of the classification extension (``parameters: {"classification": k}`` on a requested output,
    tritonclient's ``class_count``): an integer from 1 to ``MAX_TOP_K``, or a 400 naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOP_K:
        raise BadRequestError(f"{where} must be an integer from 1 to {MAX_TOP_K}")
    return value


def classified(mv: ModelVersion, outputs: Mapping[str, np.ndarray], classes: Mapping[str, int]
               ) -> dict[str, np.ndarray]:
    """``outputs`` with each one named in ``classes`` replaced by its top-k ``"score:index[:label]"`` strings
    (``image_requests.classification``: a BYTES tensor, an object array of bytes); the others as they are."""
    return {name: image_requests.classification(mv, name, scores, classes[name]) if name in classes else scores
            for name, scores in outputs.items()}


def requested_output(name: str, known: Iterable[str], seen: Iterable[str]) -> None:
    """Check one requested output: a model output, asked for once."""
    known = list(known)
    if name not in known:
        raise BadRequestError(f"unknown output {printable(name)!r}; the model has: {', '.join(known)}")
    if name in seen:
        raise BadRequestError(f"output {printable(name)!r} requested twice")


def describe_version(mv: ModelVersion) -> dict[str, Any]:
    """Signature, state, config, sha256, time, engine choice and optimization report of a version, without
    anything that looks like a server path (defence in depth: none should be there)."""
    return _public(mv.describe())


def _tensor_config(spec: TensorSpec, batched: bool) -> dict[str, Any]:
    """Triton's ``ModelInput`` / ``ModelOutput`` fields (inputs add ``format``; outputs have none)."""
    dims = spec.kserve_shape()[1:] if batched else spec.kserve_shape()
    return {"name": spec.name, "data_type": f"TYPE_{spec.datatype}", "dims": dims}


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
