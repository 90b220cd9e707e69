"""Per-model configuration, stored with every model version.

``ModelConfig`` is what a client may send with an upload: every field is optional and ``None`` means "the
service default" (``ServiceSettings``), so a stored model follows later changes of the defaults. The bounds
match ``service.settings`` so no per-model value can exceed what an operator could configure globally.
``ModelConfig.effective(settings)`` resolves it into the ``EffectiveConfig`` the registry uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.settings import EngineSettings, ServiceSettings

MAX_BUCKETS = 16
"""Each bucket costs an IO binding and (on CUDA) a captured graph: keep the count bounded."""


class ModelConfig(BaseModel):
    """Optional per-model overrides; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int | None = Field(None, ge=1, le=4096, description="Most samples in one engine call.")
    max_delay_ms: float | None = Field(None, ge=0.0, le=1000.0, description="Longest wait for more requests.")
    queue_size: int | None = Field(None, ge=1, le=1_000_000, description="Most samples waiting (503 beyond).")
    timeout_s: float | None = Field(None, gt=0.0, le=3600.0, description="Per-request deadline (504).")
    precision: Literal["fp32", "fp16", "auto"] | None = Field(
        None, description="fp32, fp16 (fp32 inputs/outputs kept), or auto: the engine measures both."
    )
    buckets: tuple[int, ...] | None = Field(None, description="Batch-size buckets of the engine.")
    fused_conv: bool | None = Field(None, description="Allow the com.microsoft.FusedConv variant.")

    @field_validator("buckets")
    @classmethod
    def _valid_buckets(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not value or len(value) > MAX_BUCKETS:
            raise ValueError(f"give 1 to {MAX_BUCKETS} buckets")
        if any(b < 1 or b > 4096 for b in value):
            raise ValueError("buckets must be between 1 and 4096")
        return tuple(sorted(set(value)))

    def to_dict(self) -> dict[str, Any]:
        """The fields that were set (JSON-able), as stored in the metadata."""
        return self.model_dump(mode="json", exclude_none=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ModelConfig:
        return cls.model_validate(data or {})

    def effective(self, settings: ServiceSettings) -> EffectiveConfig:
        """Merge with the service defaults. Global batching off means one request per engine call."""
        batching = settings.batching
        max_batch = self.max_batch_size if self.max_batch_size is not None else batching.max_batch_size
        delay_ms = self.max_delay_ms if self.max_delay_ms is not None else batching.max_delay_ms
        if not batching.enabled:
            max_batch = 1
        return EffectiveConfig(
            max_batch_size=max_batch,
            max_delay_s=delay_ms / 1000.0,
            queue_size=self.queue_size if self.queue_size is not None else batching.queue_size,
            timeout_s=self.timeout_s if self.timeout_s is not None else batching.timeout_s,
            precision=self.precision or settings.precision,
            buckets=self.buckets or settings.engine.buckets,
            fused_conv=self.fused_conv if self.fused_conv is not None else settings.optimizer.fused_conv,
            verify=settings.optimizer.verify,
            inline_max_s=batching.inline_max_ms / 1000.0,
        )


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
    inline_max_s: float = 0.0

    def engine_settings(self, settings: ServiceSettings) -> EngineSettings:
        """The service's engine settings with this model's buckets."""
        return settings.engine.model_copy(update={"buckets": self.buckets})

    def graph_fields(self) -> dict[str, Any]:
        """The settings that change the optimized graph(s), or whether they were verified: part of the
        store's cache key (a model optimized without verification is redone once verification is on)."""
        return {"fused_conv": self.fused_conv, "verify": self.verify}

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["buckets"] = list(self.buckets)
        return data
