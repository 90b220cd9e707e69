"""What the optimizer did: per-pass rewrites, node counts and op histograms, the verification result."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import onnx

from service.optimizer.tolerance import tolerance_note
from service.optimizer.verify_inputs import KIND_TEXT


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type of the main graph (domain-qualified outside the default domain)."""
    counts = Counter(
        node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        for node in model.graph.node
    )
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


@dataclasses.dataclass
class PassStat:
    """One pass's effect on the main graph.

    A pass that ran: ``nodes_before`` is the node count before its first rewrite (before its first run when it
    rewrote nothing), ``nodes_after`` the count after its last rewrite (equal to ``nodes_before`` when it
    rewrote nothing). A pass that did not run: ``skipped`` says why and both counts are None, as they are in a
    record of an earlier optimizer that did not keep them."""

    name: str
    rewrites: int = 0
    nodes_before: int | None = None
    nodes_after: int | None = None
    skipped: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PassStat:
        """Records of earlier optimizers wrote 0 -> 0 for a pass that rewrote nothing: unknown counts."""
        fields = {f.name for f in dataclasses.fields(cls)}
        stat = cls(**{k: v for k, v in data.items() if k in fields})
        if not stat.rewrites and stat.nodes_before == stat.nodes_after == 0:
            stat.nodes_before = stat.nodes_after = None
        return stat


@dataclasses.dataclass
class OptimizationReport:
    optimizer_version: str
    config: dict[str, Any]
    nodes_before: int = 0
    nodes_after: int = 0
    opset_before: int = 0
    opset_after: int = 0
    ops_before: dict[str, int] = dataclasses.field(default_factory=dict)
    ops_after: dict[str, int] = dataclasses.field(default_factory=dict)
    passes: list[PassStat] = dataclasses.field(default_factory=list)
    iterations: int = 0
    verified: bool = False
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    verify_batch_sizes: list[int] = dataclasses.field(default_factory=list)
    verify_rtol: float | None = None
    verify_atol: float | None = None
    """The tolerance verification used (None: not verified); ``optimizer.tolerance`` gives the defaults."""
    verify_precision: str | None = None
    """What the original computes in (``fp32``, ``fp16``): the default tolerance follows it. None: not
    verified, or a record written before the precision was kept (read as fp32)."""
    verify_tolerance_source: str | None = None
    """``default`` (the precision's) or ``user`` (the model's own ``verify_tolerance``)."""
    verify_input_kinds: list[str] = dataclasses.field(default_factory=list)
    """The input kinds compared, in order of first use (``optimizer.verify_inputs``)."""
    verify_skipped_kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    """Input kinds on which the original never ran, with its first error (``optimizer.verify_draws``)."""
    verify_unordered_rows: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Outputs compared as sets of detections: their detection count in every verification run."""
    verify_selection_inputs: list[str] = dataclasses.field(default_factory=list)
    """NonMaxSuppression/TopK inputs compared element by element besides the outputs."""
    verify_fed_selections: list[str] = dataclasses.field(default_factory=list)
    """Set when detections differed as sets (``verify_set_mismatch``, how ties fell) and the model was
    verified cut at these selections, fed with the original's results (``optimizer.verify_fed``)."""
    verify_set_mismatch: str = ""
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizationReport:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["passes"] = [PassStat.from_dict(p) for p in data.get("passes", [])]
        return cls(**kwargs)

    def summary(self) -> str:
        """Human-readable multi-line summary (the CLI prints it)."""
        lines = [
            f"nodes: {self.nodes_before} -> {self.nodes_after}   opset: {self.opset_before} -> {self.opset_after}"
            f"   iterations: {self.iterations}   time: {self.duration_s:.2f} s",
            "passes:",
        ]
        for stat in self.passes:
            if stat.rewrites:
                lines.append(
                    f"  {stat.name:<40} rewrites {stat.rewrites:>4}   nodes {stat.nodes_before} -> {stat.nodes_after}"
                )
        if not any(stat.rewrites for stat in self.passes):
            lines.append("  (no rewrites)")
        lines.extend(f"  {stat.name:<40} skipped: {stat.skipped}" for stat in self.passes if stat.skipped)
        lines.append("ops before: " + ", ".join(f"{op} {n}" for op, n in self.ops_before.items()))
        lines.append("ops after:  " + ", ".join(f"{op} {n}" for op, n in self.ops_after.items()))
        if self.verified:
            lines.append(
                f"verified: max |diff| {self.max_abs_diff:.3g}, max rel diff {self.max_rel_diff:.3g}"
                f" (batch sizes {self.verify_batch_sizes}; inputs {', '.join(self.verify_input_kinds) or '?'})"
            )
            note = tolerance_note(self.verify_rtol, self.verify_atol, self.verify_precision,
                                  self.verify_tolerance_source)
            lines.append(f"  tolerance: {note}")
            lines.extend(
                f"  skipped {KIND_TEXT.get(kind, kind)}: the original model fails on them {error}"
                for kind, error in self.verify_skipped_kinds.items()
            )
            lines.extend(self._unordered_lines())
        else:
            lines.append("verified: no (verification disabled)")
        return "\n".join(lines)

    def _unordered_lines(self) -> list[str]:
        lines = []
        if self.verify_selection_inputs:
            lines.append("  NonMaxSuppression/TopK inputs compared: " + ", ".join(self.verify_selection_inputs))
        if self.verify_fed_selections:
            lines.append(
                f"  detections differed as sets ({self.verify_set_mismatch}); verified with the original's"
                f" results of {len(self.verify_fed_selections)} NonMaxSuppression/TopK selections fed in"
            )
        for name, rows in self.verify_unordered_rows.items():
            if any(rows):
                lines.append(
                    f"  {name}: compared as a set, {min(rows)}-{max(rows)} detections per run ({len(rows)} runs)"
                )
            else:
                lines.append(f"  {name}: no detections in any of {len(rows)} runs: the detections were not compared")
        return lines

