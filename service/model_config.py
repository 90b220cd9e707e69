"""Per-model configuration, stored with every model version.

``ModelConfig`` is what a client may send with an upload: every field is optional and ``None`` means "the
service default", so a stored model follows later changes of the defaults. Each field's bounds are the very
types of ``service.settings``, so no per-model value can exceed what an operator could configure globally.
``ModelConfig.effective(settings)`` resolves it into the ``EffectiveConfig`` the registry uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.settings import Buckets, MaxBatchSize, MaxDelayMs, Precision, QueueSize, ServiceSettings, TimeoutS


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

    def to_dict(self) -> dict[str, Any]:
        """The fields that were set (JSON-able), as stored in the metadata."""
        return self.model_dump(mode="json", exclude_none=True)

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

    def graph_fields(self) -> dict[str, Any]:
        """The settings that change the optimized graph(s), or whether they were verified: part of the
        store's cache key (a model optimized without verification is redone once verification is on)."""
        return {"fused_conv": self.fused_conv, "verify": self.verify}

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["buckets"] = list(self.buckets)
        return data
