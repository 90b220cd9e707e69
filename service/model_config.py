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
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.imaging.config import Postprocess, Preprocess
from service.optimizer.tolerance import DEFAULT_ATOL, DEFAULT_RTOL, FP16_ATOL, FP16_RTOL
from service.settings import Buckets, MaxBatchSize, MaxDelayMs, Precision, QueueSize, ServiceSettings, TimeoutS

MAX_DESCRIPTION = 1000
"""Longest model description, in characters."""


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

    def to_dict(self) -> dict[str, Any]:
        """The fields that were set (JSON-able), as stored in the metadata. ``preprocess`` and
        ``postprocess`` keep their null fields (a null ``resize`` means "no resize", not the default)."""
        data = self.model_dump(mode="json", exclude_none=True, exclude={"preprocess", "postprocess"})
        for key in ("preprocess", "postprocess"):
            value = getattr(self, key)
            if value is not None:
                data[key] = value.model_dump(mode="json")
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
            max_delay_s=_pick(self.max_delay_ms, settings.max_delay_ms) / 1000.0,
            queue_size=_pick(self.queue_size, settings.queue_size),
            timeout_s=_pick(self.timeout_s, settings.request_timeout_s),
            precision=_pick(self.precision, settings.precision),
            buckets=_pick(self.buckets, settings.buckets),
            fused_conv=_pick(self.fused_conv, settings.fused_conv),
            verify=settings.verify,
            preprocess=self.preprocess,
            postprocess=self.postprocess,
            tolerance=self.verify_tolerance if self.verify_tolerance and self.verify_tolerance.is_set else None,
        )


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class EffectiveConfig:
    """A model's resolved configuration."""

    max_batch_size: int
    max_delay_s: float
    queue_size: int
    timeout_s: float
    precision: str
    buckets: tuple[int, ...]
    fused_conv: bool
    verify: bool
    preprocess: Preprocess | None = None
    postprocess: Postprocess | None = None
    tolerance: VerifyTolerance | None = None
    """The model's own verification tolerance; None: the default of the graph's precision."""

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
        if self.tolerance is not None:  # listed only when set, so other models keep their keys
            fields["verify_tolerance"] = self.tolerance.model_dump(exclude_none=True)
        if self.folds_normalization:
            assert self.preprocess is not None
            p = self.preprocess
            fields["input_normalization"] = {"layout": p.layout, "scale": p.scale, "mean": list(p.mean3),
                                             "std": list(p.std3), "wire_dtype": p.wire_dtype}
        return fields

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, for the management API: the labels are counted, not listed (see the labels route)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["buckets"] = list(self.buckets)
        data["tolerance"] = None if self.tolerance is None else self.tolerance.model_dump(exclude_none=True)
        data["preprocess"] = None if self.preprocess is None else self.preprocess.model_dump(mode="json")
        post = self.postprocess
        data["postprocess"] = None if post is None else {
            "softmax": post.softmax, "top_k": post.top_k, "label_count": 0 if post.labels is None else len(post.labels)
        }
        return data
