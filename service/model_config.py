"""Per-model configuration, stored with every model version.

``ModelConfig`` is what a client may send with an upload: every field is optional and ``None`` means "the
service default", so a stored model follows later changes of the defaults. Each field's bounds are the very
types of ``service.settings``, so no per-model value can exceed what an operator could configure globally.
``ModelConfig.effective(settings)`` resolves it into the ``EffectiveConfig`` the registry uses.

``preprocess`` and ``postprocess`` (``service.imaging.config``) make the model an image model: what the
server does with images a client sends (decode, resize, crop, normalise) and with the scores it returns
(softmax, top-k, labels). They are checked against the model when it is uploaded (the registry's
``image_config``). With ``preprocess.wire_dtype`` uint8 (the default) the normalisation is folded into the
served graph, so it is part of the optimizer's cache key (``EffectiveConfig.graph_fields``).

One vocabulary: what a server shows of a version's config can be uploaded unchanged as the config of a new
one. ``GET /v1/models/{name}`` shows ``EffectiveConfig.to_dict()``, a ``ModelConfig`` with every key set
(the labels counted, ``postprocess.label_count``); ``GET /v2/models/{name}/config`` shows Triton's model
config, with the other keys as Triton ``parameters``, which ``ModelConfig`` reads back (``from_triton``), also
inside the ``{"config": ...}`` that ``tritonclient.grpc`` returns; a label count without labels is dropped
(``settled``), so what GET shows of a classifier uploads without its labels too.
Names of earlier releases (``DEPRECATED``) are still read, with one warning per config that uses them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.imaging.config import Postprocess, Preprocess
from service.optimizer.tolerance import DEFAULT_ATOL, DEFAULT_RTOL, FP16_ATOL, FP16_RTOL
from service.settings import Buckets, MaxBatchSize, MaxDelayMs, Precision, QueueSize, ServiceSettings, TimeoutS

log = logging.getLogger(__name__)

MAX_DESCRIPTION = 1000
"""Longest model description, in characters."""
PLATFORM, BACKEND = "onnxruntime_onnx", "onnxruntime"
"""What Triton's model config calls this server's models."""
DEPRECATED: dict[str, str | None] = {"max_delay_s": "max_delay_ms", "tolerance": "verify_tolerance", "verify": None}
"""Keys that earlier releases showed in a version's config, still read from an upload's: the key that replaced
each (``max_delay_s`` in seconds becomes ``max_delay_ms``), or None: ignored, as verification is the server's
``SERVICE_VERIFY``, never a model's."""
TRITON_KEYS = frozenset({"name", "platform", "backend", "input", "output", "dynamic_batching", "version_policy",
                         "parameters"})
"""Keys of Triton's model config (``GET /v2/models/{name}/config``) that mark a config written in its shape."""


class VerifyTolerance(BaseModel):
    """A model's own verification tolerance (``service.optimizer.verify``: an element matches when
    ``|optimized - original| <= atol + rtol * scale``). A field left out takes the default of the precision
    the model computes in (``service.optimizer.tolerance``). The report records the tolerance every
    verification used and where it came from, and one looser than the default is logged; verification
    itself cannot be switched off per model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rtol: float | None = Field(
        None, ge=0.0, le=0.1,
        description=f"Relative tolerance (default: {DEFAULT_RTOL:g} for fp32 graphs, {FP16_RTOL:g} for fp16).",
    )  # fmt: skip
    atol: float | None = Field(
        None, ge=0.0, le=1.0,
        description=f"Absolute tolerance (default: {DEFAULT_ATOL:g} for fp32 graphs, {FP16_ATOL:g} for fp16).",
    )  # fmt: skip

    @property
    def is_set(self) -> bool:
        """Some field was given (an empty one leaves both to the precision's default)."""
        return self.rtol is not None or self.atol is not None


class ModelConfig(BaseModel):
    """Optional per-model overrides; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: MaxBatchSize | None = Field(None, description="Most samples in one engine call.")
    max_delay_ms: MaxDelayMs | None = Field(None, description="Longest wait for more requests.")
    queue_size: QueueSize | None = Field(None, description="Most samples waiting (503 beyond).")
    timeout_s: TimeoutS | None = Field(None, description="Per-request deadline (504).")
    precision: Precision | None = Field(
        None, description="fp32, fp16 (CUDA; fp32 inputs/outputs kept), bf16 (CPU with the OpenVINO EP), or auto: "
        "the engine measures full and reduced precision."
    )
    buckets: Buckets | None = Field(None, description="Batch-size buckets of the engine.")
    fused_conv: bool | None = Field(None, description="Allow the com.microsoft.FusedConv variant.")
    preprocess: Preprocess | None = Field(
        None, description="The model takes images: how to decode, resize, crop and normalise them."
    )
    postprocess: Postprocess | None = Field(
        None, description="The model is a classifier: softmax, top-k and labels of its first output."
    )
    verify_tolerance: VerifyTolerance | None = Field(
        None, description="The model's own verification tolerance, {\"rtol\", \"atol\"}; what it leaves out "
        "follows the precision the graph computes in (fp32: rtol 1e-4, atol 1e-5; fp16: 5e-3, 5e-4). Recorded in the "
        "report with that precision."
    )
    description: str | None = Field(
        None, max_length=MAX_DESCRIPTION, description="What the model is, for people (shown with the model)."
    )

    @model_validator(mode="before")
    @classmethod
    def _one_vocabulary(cls, data: Any) -> Any:
        """Triton's shape and the deprecated keys, read as the keys above (see the module's docstring)."""
        if not isinstance(data, dict):
            return data
        data = _unwrapped(data)
        if TRITON_KEYS & data.keys():
            data = from_triton(data)
        return _renamed(data)

    def shown(self) -> dict[str, Any]:
        """Every key, JSON-able, with the labels counted (``postprocess.label_count``), not listed: what
        ``GET /v1/models/{name}`` shows, and a config an upload takes unchanged."""
        data = self.model_dump(mode="json")
        if self.postprocess is not None:
            data["postprocess"] = self.postprocess.model_dump(mode="json", exclude={"labels"})
        return data

    def settled(self) -> ModelConfig:
        """The config an upload keeps once every field of it was read: a ``postprocess.label_count`` that no
        labels came with (what GET shows of a classifier, uploaded back without its labels file) counts
        nothing, so it goes, and the version reports class indices. Labels travel only as labels."""
        post = self.postprocess
        if post is None or not post.awaiting_labels:
            return self
        return self.model_copy(update={"postprocess": post.model_copy(update={"label_count": None})})

    def to_dict(self) -> dict[str, Any]:
        """The fields that were set (JSON-able), as stored in the metadata. ``preprocess`` and
        ``postprocess`` keep their null fields (a null ``resize`` means "no resize", not the default); the
        labels are stored, their count is not (it follows from them)."""
        data = self.model_dump(mode="json", exclude_none=True, exclude={"preprocess", "postprocess"})
        if self.preprocess is not None:
            data["preprocess"] = self.preprocess.model_dump(mode="json")
        if self.postprocess is not None:
            data["postprocess"] = self.postprocess.model_dump(mode="json", exclude={"label_count"})
        return data

    def with_labels(self, labels: tuple[str, ...]) -> ModelConfig:
        """The same config with ``labels`` as the classifier's labels (a ``postprocess`` with the defaults
        when there is none); ValueError when the config lists labels already."""
        postprocess = self.postprocess or Postprocess()
        if postprocess.labels is not None:
            raise ValueError("labels are given twice (in the config's postprocess and as a labels file)")
        merged = Postprocess.model_validate({**postprocess.model_dump(), "labels": labels})
        return self.model_copy(update={"postprocess": merged})

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ModelConfig:
        return cls.model_validate(data or {})

    def effective(self, settings: ServiceSettings) -> EffectiveConfig:
        """Merge with the service defaults; a model may lower the service's batch size, never raise it (so
        SERVICE_MAX_BATCH_SIZE=1 turns batching off for every model)."""
        return EffectiveConfig(
            max_batch_size=min(_pick(self.max_batch_size, settings.max_batch_size), settings.max_batch_size),
            max_delay_ms=_pick(self.max_delay_ms, settings.max_delay_ms),
            queue_size=_pick(self.queue_size, settings.queue_size),
            timeout_s=_pick(self.timeout_s, settings.request_timeout_s),
            precision=_pick(self.precision, settings.precision),
            buckets=_pick(self.buckets, settings.buckets),
            fused_conv=_pick(self.fused_conv, settings.fused_conv),
            verify=settings.verify,
            preprocess=self.preprocess,
            postprocess=self.postprocess,
            verify_tolerance=self.verify_tolerance if self.verify_tolerance and self.verify_tolerance.is_set else None,
            description=self.description,
        )


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _unwrapped(data: dict[str, Any]) -> dict[str, Any]:
    """Triton's model config inside the ``{"config": {...}}`` of a ``ModelConfigResponse`` (what
    ``tritonclient.grpc``'s ``get_model_config(as_json=True)`` returns) as the config itself."""
    inner = data.get("config")
    return inner if data.keys() == {"config"} and isinstance(inner, dict) else data


def _renamed(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the ``DEPRECATED`` keys replaced, and one warning naming them."""
    old = [key for key in DEPRECATED if key in data]
    if not old:
        return data
    data = dict(data)
    advice = []
    for key in old:
        value, new = data.pop(key), DEPRECATED[key]
        if new is None:
            advice.append(f"{key} is ignored (verification is the server's SERVICE_VERIFY)")
            continue
        if new in data:
            raise ValueError(f"{key} and {new} are one setting: give {new} only")
        if key == "max_delay_s" and isinstance(value, int | float) and not isinstance(value, bool):
            value = value * 1000.0
        data[new] = value
        advice.append(f"{key} is now {new}")
    log.warning("model config: deprecated keys: %s", "; ".join(advice))
    return data


def from_triton(doc: dict[str, Any]) -> dict[str, Any]:
    """Triton's model config as ``GET /v2/models/{name}/config`` shows it (REST or gRPC JSON), as our keys:
    ``max_batch_size`` (0: the model has no batch dimension, so the default), ``dynamic_batching``'s queue
    delay as ``max_delay_ms``, and every other key from ``parameters`` (``{"string_value": JSON}``). The
    fields that describe the model file (``name``, ``input``, ``output``, ``version_policy``) are read from
    the uploaded file itself, so they are not settings; a platform other than ONNX Runtime's is refused."""
    unknown = sorted(doc.keys() - TRITON_KEYS - {"max_batch_size"})
    if unknown:
        raise ValueError(f"a config in Triton's shape has no field {', '.join(unknown)}")
    for key, ours in (("platform", PLATFORM), ("backend", BACKEND)):
        if doc.get(key) not in (None, "", ours):
            raise ValueError(f"{key} must be {ours!r}: this server serves ONNX models with ONNX Runtime")
    data = _parameters(doc.get("parameters") or {})
    if "max_batch_size" in doc:
        batch = doc["max_batch_size"]
        data["max_batch_size"] = None if batch == 0 else batch
    delay = (doc.get("dynamic_batching") or {}).get("max_queue_delay_microseconds")
    if delay is not None:
        try:
            data["max_delay_ms"] = int(delay) / 1000.0  # gRPC's JSON writes a uint64 as a string
        except (TypeError, ValueError):
            raise ValueError("dynamic_batching.max_queue_delay_microseconds must be an integer") from None
    return data


def _parameters(parameters: Any) -> dict[str, Any]:
    """Triton ``parameters`` (``{key: {"string_value": JSON text}}``) -> {key: value}."""
    if not isinstance(parameters, dict):
        raise ValueError("parameters must be an object of {\"string_value\": ...}")
    data = {}
    for key, parameter in parameters.items():
        if key in ("max_batch_size", "max_delay_ms"):
            raise ValueError(f"{key} is Triton's own field, not a parameter")
        text = parameter.get("string_value") if isinstance(parameter, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"parameters.{key} must be {{\"string_value\": ...}}")
        try:
            data[key] = json.loads(text)
        except ValueError:
            data[key] = text  # a plain string (e.g. a description) may be written without quotes
    return data


def triton_parameters(shown: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The keys of a shown config that Triton's model config has no field for, as its ``parameters``."""
    return {key: {"string_value": json.dumps(value)} for key, value in shown.items()
            if key not in ("max_batch_size", "max_delay_ms")}


@dataclasses.dataclass(frozen=True)
class EffectiveConfig:
    """A model's resolved configuration."""

    max_batch_size: int
    max_delay_ms: float
    queue_size: int
    timeout_s: float
    precision: str
    buckets: tuple[int, ...]
    fused_conv: bool
    verify: bool
    """The server's SERVICE_VERIFY (part of the cache key; not a model's setting, so not shown with it)."""
    preprocess: Preprocess | None = None
    postprocess: Postprocess | None = None
    verify_tolerance: VerifyTolerance | None = None
    """The model's own verification tolerance; None: the default of the graph's precision."""
    description: str | None = None

    @property
    def max_delay_s(self) -> float:
        return self.max_delay_ms / 1000.0

    @property
    def folds_normalization(self) -> bool:
        """The served graph takes raw pixels and normalises them itself (``preprocess.wire_dtype`` uint8)."""
        return self.preprocess is not None and self.preprocess.wire_dtype == "uint8"

    def graph_fields(self) -> dict[str, Any]:
        """The settings that change the optimized graph(s), or whether they were verified: part of the
        store's cache key (a model optimized without verification is redone once verification is on).
        The folded normalisation is listed only when there is one, so a model without it keeps the key
        it had before image models existed."""
        fields: dict[str, Any] = {"fused_conv": self.fused_conv, "verify": self.verify}
        if self.verify_tolerance is not None:  # listed only when set, so other models keep their keys
            fields["verify_tolerance"] = self.verify_tolerance.model_dump(exclude_none=True)
        if self.folds_normalization:
            assert self.preprocess is not None
            p = self.preprocess
            fields["input_normalization"] = {"layout": p.layout, "scale": p.scale, "mean": list(p.mean3),
                                             "std": list(p.std3), "wire_dtype": p.wire_dtype}
        return fields

    def to_dict(self) -> dict[str, Any]:
        """What the management API shows: ``ModelConfig.shown()`` of the resolved values, every key set, so
        that it can be uploaded unchanged as a new version's config (a tolerance left to the graph's precision
        shows as nulls)."""
        return ModelConfig(
            max_batch_size=self.max_batch_size, max_delay_ms=self.max_delay_ms, queue_size=self.queue_size,
            timeout_s=self.timeout_s, precision=self.precision, buckets=self.buckets,  # type: ignore[arg-type]
            fused_conv=self.fused_conv, preprocess=self.preprocess, postprocess=self.postprocess,
            verify_tolerance=self.verify_tolerance or VerifyTolerance(), description=self.description,
        ).shown()
