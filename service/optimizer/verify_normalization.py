"""Verification of a graph whose input normalisation was folded in (``fold_input_normalization``).

The generic check (``verify.verify_equivalent``) compares two graphs of the same signature. Here the
signature changed (float NCHW in, pixels out of the wire dtype and layout in), so the reference is the
*original* graph composed with the normalisation done in numpy: random pixels ``p`` (uniform integers
0..255, in the wire layout; float32 for a float wire) go to the optimized graph as they are, and to the
original as ``(p * scale - mean) / std`` computed in float64, transposed to NCHW and cast to the input's
float type. Outputs are compared exactly as ``verify_equivalent`` compares them (same tolerance rule and
default by precision, same messages), on ONNX Runtime's CPU provider with its optimizations off, on the
draws that ``verify_draws`` makes (pixels the original cannot run on are drawn again). Inputs other than
the image input get the generic random values of each kind, the same for both graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from service.errors import OptimizationError, VerificationError
from service.optimizer.passes.fold_input_normalization import InputNormalization
from service.optimizer.tolerance import Tolerance, resolve_tolerance

# Package-private helpers of the generic verifier: one comparison rule for every check of the optimizer.
from service.optimizer.verify import VerificationResult, _Comparison, _short, run_all
from service.optimizer.verify_inputs import random_feeds
from service.optimizer.verify_shared import reference_run
from service.optimizer.verify_targets import plan

_PIXEL_HIGH = 256


def verify_input_normalization(
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    normalization: InputNormalization,
    *,
    batch_sizes: Sequence[int] = (1, 2),
    trials: int = 2,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> VerificationResult:
    """Compare ``candidate`` (pixels in) against ``reference`` (normalised floats in) on random images;
    ``rtol``/``atol`` left None take the default of ``reference``'s precision.

    Raises VerificationError on a mismatch and OptimizationError when a model cannot run.
    """
    tolerance = resolve_tolerance(reference, rtol, atol)
    comparison = _PixelComparison(reference, candidate, normalization, tolerance)
    drawn = run_all(comparison, batch_sizes, max(1, trials), seed)
    return VerificationResult(
        comparison.max_abs, comparison.max_rel, tuple(drawn.batches), rtol=tolerance.rtol, atol=tolerance.atol,
        precision=tolerance.precision, tolerance_source=tolerance.source, input_kinds=tuple(drawn.used),
        skipped_kinds=dict(drawn.skipped),
    )  # fmt: skip


class _PixelComparison(_Comparison):
    """The generic comparison with pixels drawn for the image input: as they are for the candidate,
    normalised in numpy for the original."""

    def __init__(
        self, reference: onnx.ModelProto, candidate: onnx.ModelProto, normalization: InputNormalization,
        tolerance: Tolerance,
    ) -> None:  # fmt: skip
        super().__init__(plan(reference, candidate), tolerance)
        self.normalization = normalization
        self.name = normalization.input_name
        spec = next((spec for spec in self.specs if spec.name == self.name), None)
        if spec is None:
            raise OptimizationError(f"cannot verify: the original model has no input '{self.name}'")
        self.float_dtype = spec.dtype

    def draw(self, batch: int, kind: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
        feeds = random_feeds(self.specs, batch, rng, kind)
        feeds[self.name] = _pixels(feeds[self.name].shape, self.normalization, rng)
        return feeds

    def attempt(self, batch: int, kind: str, feeds: dict[str, np.ndarray]) -> str | None:
        pixels = feeds[self.name]
        _check_wire_input(self.candidate, self.name, pixels)
        normalised = {**feeds, self.name: _normalise(pixels, self.normalization, self.float_dtype)}
        try:
            expected = reference_run(self.reference, [t.reference for t in self.targets], normalised)
        except Exception as exc:
            return _short(exc)
        where = f"at batch {batch} (random pixels)"
        self._compare_run(where, expected, self.run_candidate(feeds, where))
        return None


def _pixels(nchw_shape: tuple[int, ...], normalization: InputNormalization, rng: np.random.Generator) -> np.ndarray:
    n, c, h, w = nchw_shape
    shape = (n, h, w, c) if normalization.layout == "NHWC" else (n, c, h, w)
    pixels = rng.integers(0, _PIXEL_HIGH, size=shape, dtype=np.uint8)
    return pixels if normalization.wire_dtype == "uint8" else pixels.astype(np.float32)


def _check_wire_input(session, name: str, pixels: np.ndarray) -> None:
    """The optimized graph's input must take what the normalisation says goes on the wire."""
    (arg,) = [i for i in session.get_inputs() if i.name == name]
    dtype = {"tensor(uint8)": np.uint8, "tensor(float)": np.float32}.get(arg.type)
    fixed_dims_match = len(arg.shape) == pixels.ndim and all(
        not isinstance(d, int) or d == n for d, n in zip(arg.shape, pixels.shape, strict=True)
    )
    if dtype != pixels.dtype or not fixed_dims_match:
        kind = arg.type.removeprefix("tensor(").removesuffix(")").replace("float", "float32")
        raise VerificationError(
            f"the optimized model's input '{name}' takes {kind} {list(arg.shape)}, but the normalisation puts "
            f"{pixels.dtype} {list(pixels.shape)} on the wire"
        )


def _normalise(pixels: np.ndarray, normalization: InputNormalization, dtype: np.dtype) -> np.ndarray:
    """``(p * scale - mean) / std`` in float64, as NCHW in the original input's dtype."""
    nchw = pixels.transpose(0, 3, 1, 2) if normalization.layout == "NHWC" else pixels
    channels = nchw.shape[1]
    mean = np.broadcast_to(np.asarray(normalization.mean, np.float64), (channels,)).reshape(1, -1, 1, 1)
    std = np.broadcast_to(np.asarray(normalization.std, np.float64), (channels,)).reshape(1, -1, 1, 1)
    return np.ascontiguousarray((nchw.astype(np.float64) * normalization.scale - mean) / std).astype(dtype)
