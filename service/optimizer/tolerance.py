"""The tolerance a verification compares with: the user's, or the default for the graph's precision.

An element matches when ``|optimized - original| <= atol + rtol * scale`` (``scale``: the output's largest
finite magnitude; the rule is ``service.optimizer.verify``'s). The default follows the precision the
*original* computes in (``service.graph_precision``): a rewrite must not change it, so a rewrite that
drops an fp32 model to fp16 is still held to fp32's tolerance.

- **fp32**: rtol 1e-4, atol 1e-5. ORT's own optimizer (BN folded into Conv, like our pass) moves the zoo's
  ResNet-50 logits by 1.8e-5 of their scale; a wrong rewrite moves outputs by a sizeable fraction of it.
- **fp16**: rtol 5e-3, atol 5e-4. fp16's unit roundoff is 2^-11 = 4.9e-4, and a correct rewrite rounds at
  other places (a BN folded into an fp16 Conv rounds the folded weights once and skips the BN's rounding):
  on fp16 conv nets of 4-34 layers built in code (``bench/verify_fp16.py``) our optimizer and ORT's own
  ORT_ENABLE_ALL moved the outputs by at most 1.1e-3 of their scale, where the same nets in fp32 moved by
  3.5e-7. 5e-3 (about 10 unit roundoffs) is 4.5x that. Scaling one Conv's weights by 1 % moved them by
  8.9e-3-1.2e-2 (the first Conv: refused) and 5.0e-3-9.5e-3 (the last): a smaller error cannot be told from
  fp16 rounding. atol is rtol / 10, as for fp32.
- **user**: a model's own ``verify_tolerance`` (``service.model_config``) wins; a field it leaves out
  takes the precision's default.

The result and the report record the precision, the tolerance and where it came from.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx

from service.graph_precision import FP16, FP32, graph_precision

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-5
"""fp32's default (the tolerance of every graph that computes in single precision)."""
FP16_RTOL = 5e-3
FP16_ATOL = 5e-4
DEFAULTS: dict[str, tuple[float, float]] = {FP32: (DEFAULT_RTOL, DEFAULT_ATOL), FP16: (FP16_RTOL, FP16_ATOL)}
DEFAULT = "default"
USER = "user"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    precision: str
    """What the original computes in: ``fp32`` or ``fp16``."""
    source: str
    """``default`` (the precision's) or ``user`` (the model's own, possibly completed by the default)."""


def resolve_tolerance(reference: onnx.ModelProto, rtol: float | None, atol: float | None) -> Tolerance:
    """The tolerance to verify ``reference``'s rewrite with: ``rtol``/``atol`` where given (checked), the
    default of ``reference``'s precision for what is None."""
    precision = graph_precision(reference)
    default_rtol, default_atol = DEFAULTS[precision]
    chosen = (default_rtol if rtol is None else rtol, default_atol if atol is None else atol)
    check_tolerance(*chosen)
    source = DEFAULT if rtol is None and atol is None else USER
    return Tolerance(chosen[0], chosen[1], precision, source)


def check_tolerance(rtol: float | None, atol: float | None) -> None:
    """Raise ValueError unless each is None (the precision's default) or finite and >= 0."""
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is None:
            continue
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"verification {name} must be a finite number >= 0, got {value!r}")


def tolerance_text(value: float) -> str:
    """1e-4 rather than 0.0001 or 1e-04."""
    if value and not 1e-2 <= abs(value) < 1e4:
        return np.format_float_scientific(value, trim="-", exp_digits=1)
    return f"{value:g}"


def tolerance_note(rtol: float | None, atol: float | None, precision: str | None = None, source: str | None = None
                   ) -> str:
    """``rtol 1e-4, atol 1e-5 (the default for fp32 graphs)``, or how a model's own departs from that default.
    A record without the precision (written before it was kept) is read against fp32's default."""
    if rtol is None or atol is None:
        return "unknown"
    text = f"rtol {tolerance_text(rtol)}, atol {tolerance_text(atol)}"
    default_rtol, default_atol = DEFAULTS.get(precision or FP32, DEFAULTS[FP32])
    default = f"the default for {precision or FP32} graphs"
    if (rtol, atol) == (default_rtol, default_atol) and source != USER:
        return f"{text} ({default})"
    if (rtol, atol) == (default_rtol, default_atol):
        return f"{text} (set for this model; {default})"
    relation = "LOOSER than" if is_looser(rtol, atol, precision) else "stricter than"
    owner = "set for this model; " if source == USER else ""
    figures = f"rtol {tolerance_text(default_rtol)}, atol {tolerance_text(default_atol)}"
    return f"{text} ({owner}{relation} {default}, {figures})"


def is_looser(rtol: float, atol: float, precision: str | None) -> bool:
    """Looser than the default of ``precision`` (fp32 when unknown) in either figure."""
    default_rtol, default_atol = DEFAULTS.get(precision or FP32, DEFAULTS[FP32])
    return rtol > default_rtol or atol > default_atol
