"""Verification of a graph whose input normalisation was folded in (``fold_input_normalization``).

The generic check (``verify.verify_equivalent``) compares two graphs of the same signature. Here the
signature changed (float NCHW in, pixels out of the wire dtype and layout in), so the reference is the
*original* graph composed with the normalisation done in numpy: random pixels ``p`` (uniform integers
0..255, in the wire layout; float32 for a float wire) go to the optimized graph as they are, and to the
original as ``(p * scale - mean) / std`` computed in float64, transposed to NCHW and cast to the input's
float type. Outputs are compared exactly as ``verify_equivalent`` compares them (same tolerance rule, same
messages), on ONNX Runtime's CPU provider with its optimizations off. Inputs other than the image input
get the generic random values, the same for both graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from service.errors import OptimizationError, VerificationError
from service.optimizer.passes.fold_input_normalization import InputNormalization

# Package-private helpers of the generic verifier: one comparison rule for every check of the optimizer.
from service.optimizer.verify import VerificationResult, _Comparison, _short, check_tolerance
from service.optimizer.verify_inputs import effective_batch_sizes, kind_of_trial, random_feeds
from service.optimizer.verify_targets import plan

_PIXEL_HIGH = 256


def verify_input_normalization(
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    normalization: InputNormalization,
    *,
    batch_sizes: Sequence[int] = (1, 2),
    trials: int = 2,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
) -> VerificationResult:
    """Compare ``candidate`` (pixels in) against ``reference`` (normalised floats in) on random images.

    Raises VerificationError on a mismatch and OptimizationError when a model cannot run.
    """
    check_tolerance(rtol, atol)
    comparison = _Comparison(plan(reference, candidate), rtol, atol)
    name = normalization.input_name
    if not any(spec.name == name for spec in comparison.specs):
        raise OptimizationError(f"cannot verify: the original model has no input '{name}'")
    rng = np.random.default_rng(seed)
    for batch in effective_batch_sizes(comparison.specs, batch_sizes):
        for trial in range(max(1, trials)):
            feeds = random_feeds(comparison.specs, batch, rng, kind_of_trial(trial))
            float_input = feeds[name]
            pixels = _pixels(float_input.shape, normalization, rng)
            _check_wire_input(comparison.candidate, name, pixels)
            feeds[name] = _normalise(pixels, normalization, float_input.dtype)
            candidate_feeds = {k: v for k, v in feeds.items() if k in comparison.candidate_inputs} | {name: pixels}
            expected = _run(comparison.reference, [t.reference for t in comparison.targets], feeds, "original", batch)
            got = _run(comparison.candidate, [t.candidate for t in comparison.targets], candidate_feeds, "optimized",
                       batch)
            comparison._compare_run(f"at batch {batch} (random pixels)", expected, got)
        comparison.compared.append(batch)
    return VerificationResult(comparison.max_abs, comparison.max_rel, tuple(comparison.compared), rtol=rtol,
                              atol=atol, input_kinds=tuple(kind_of_trial(t) for t in range(max(1, trials))))


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


def _run(session, output_names: list[str], feeds: dict[str, np.ndarray], role: str, batch: int) -> list:
    try:
        return session.run(output_names, {i.name: feeds[i.name] for i in session.get_inputs()})
    except Exception as exc:
        raise OptimizationError(
            f"the {role} model fails to run at batch {batch} on ONNX Runtime: {_short(exc)}"
        ) from exc
