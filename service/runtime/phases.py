"""How long each phase of one model version's load took: the start a user can follow in the log and the metrics.

A load runs these phases, in this order (``PHASES``):
- ``optimize``: optimizing and verifying the original (a child process), or checking that the stored optimized
  files can be reused;
- ``read``: reading the optimized variants;
- ``tune``: choosing what serves at once: a proven record of this GPU, the default configuration (the tuner runs
  once the version serves, ``runtime.switching``: no start waits for it), or the CPU tuner's children;
- ``session``: building the served ONNX Runtime session(s);
- ``warm``: warming every bucket on the engine's thread (``warm_buckets``: each bucket's share);
- ``activate``: starting the batcher and serving one warm-up request through the whole path.
``runtime.loading`` measures read, tune, session and warm (in the engine process when there is one: the
phases travel back with the engine); the registry adds optimize and activate, logs one line per version and
sets ``service_model_load_seconds``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

PHASES = ("optimize", "read", "tune", "session", "warm", "activate")


@dataclasses.dataclass
class LoadPhases:
    """Seconds per phase (only the phases that ran), a note per phase where one helps (``reused``), and each
    bucket's warm-up."""

    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    warm_buckets: dict[int, float] = dataclasses.field(default_factory=dict)

    def add(self, phase: str, seconds: float, note: str | None = None) -> None:
        """Count ``seconds`` more for ``phase`` (one of ``PHASES``)."""
        if phase not in PHASES:
            raise ValueError(f"unknown load phase {phase!r}")
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, seconds)
        if note:
            self.notes[phase] = note

    def add_engine(self, info: Mapping[str, Any]) -> None:
        """The session and warm-up times an engine's ``describe()`` reports (a split engine: both of its own)."""
        large = (info.get("large_buckets") or {}).get("engine") or {}
        for part in (info, large):
            self.add("session", float(part.get("session_s", 0.0)))
            warm = {int(b): float(s) for b, s in (part.get("warm_s") or {}).items()}
            self.add("warm", sum(warm.values()))
            if part is info:
                self.warm_buckets.update(warm)
        if large:
            self.notes["warm"] = f"with the large-batch engine's {sum((large.get('warm_s') or {}).values()):.2f}s"

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def text(self) -> str:
        """``optimize 0.01s (reused), read 0.10s, ..., warm 2.31s (b1 0.40, b2 0.31); total 2.50s``."""
        parts = []
        for phase in PHASES:
            if phase not in self.seconds:
                continue
            detail = [self.notes[phase]] if phase in self.notes else []
            if phase == "warm" and self.warm_buckets:
                detail.append(", ".join(f"b{b} {s:.2f}" for b, s in sorted(self.warm_buckets.items())))
            parts.append(f"{phase} {self.seconds[phase]:.2f}s" + (f" ({'; '.join(detail)})" if detail else ""))
        return ", ".join(parts) + f"; total {self.total_s:.2f}s"

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": {k: round(v, 3) for k, v in self.seconds.items()}, "notes": dict(self.notes),
                "warm_buckets": {str(b): round(s, 3) for b, s in self.warm_buckets.items()}}


__all__ = ["PHASES", "LoadPhases"]
