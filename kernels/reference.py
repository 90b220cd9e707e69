"""The math of each ai.onnxcnn operator in numpy (float64), the yardstick for the CPU and CUDA kernels.

Written from the ONNX definitions of the operators each one replaces (Conv with ``group == C``, Relu,
HardSwish, GlobalAveragePool, HardSigmoid, Mul), not from the kernels: tests check it against ONNX
Runtime running those unfused operators, and the GPU check (bench/fused_ops.py) checks the CUDA kernels
against it. ``within_tolerance`` is the one comparison rule everything uses.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# float32 kernels against a float64 reference: |got - want| <= ATOL + RTOL * |want| elementwise. The
# kernels accumulate in float32 (up to 25 taps per output, C <= 960 terms per FC dot product in
# MobileNetV3), which stays within a few 1e-6 relative; these bounds leave room for that and no more.
ATOL = 1e-5
RTOL = 1e-4


def relu(v: np.ndarray) -> np.ndarray:
    return np.maximum(v, 0.0)


def hard_sigmoid(v: np.ndarray, alpha: float = 0.2, beta: float = 0.5) -> np.ndarray:
    """ONNX HardSigmoid: max(0, min(1, alpha * v + beta))."""
    return np.clip(alpha * v + beta, 0.0, 1.0)


def hard_swish(v: np.ndarray) -> np.ndarray:
    """ONNX HardSwish: v * HardSigmoid(v) with alpha 1/6, beta 0.5 (= v * relu6(v + 3) / 6)."""
    return v * hard_sigmoid(v, 1.0 / 6.0, 0.5)


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "None": lambda v: v,
    "Relu": relu,
    "HardSwish": hard_swish,
}


def dwconv_act(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray,
    *,
    strides: tuple[int, int] = (1, 1),
    pads: tuple[int, int, int, int] = (0, 0, 0, 0),
    activation: str = "None",
) -> np.ndarray:
    """DepthwiseConvAct: ``act(depthwise_conv(x, w) + b)``; x [N, C, H, W], w [C, 1, kh, kw], b [C]."""
    n, c, h, width = x.shape
    if w.shape[0] != c or w.shape[1] != 1:
        raise ValueError(f"depthwise weight must be [{c}, 1, k, k], not {list(w.shape)}")
    kh, kw = w.shape[2:]
    sh, sw = strides
    top, left, bottom, right = pads
    padded = np.zeros((n, c, h + top + bottom, width + left + right), np.float64)
    padded[:, :, top : top + h, left : left + width] = x
    out_h = (h + top + bottom - kh) // sh + 1
    out_w = (width + left + right - kw) // sw + 1
    out = np.broadcast_to(b.astype(np.float64).reshape(1, c, 1, 1), (n, c, out_h, out_w)).copy()
    for ky in range(kh):
        for kx in range(kw):
            window = padded[:, :, ky : ky + sh * (out_h - 1) + 1 : sh, kx : kx + sw * (out_w - 1) + 1 : sw]
            out += window * w[:, 0, ky, kx].astype(np.float64).reshape(1, c, 1, 1)
    return ACTIVATIONS[activation](out)


def squeeze_excite(
    x: np.ndarray,
    w1: np.ndarray,
    b1: np.ndarray,
    w2: np.ndarray,
    b2: np.ndarray,
    *,
    alpha: float = 0.2,
    beta: float = 0.5,
) -> np.ndarray:
    """SqueezeExcite: ``x * HardSigmoid(W2 relu(W1 mean_hw(x) + b1) + b2)``; W1 [R, C(, 1, 1)], W2 [C, R(, 1, 1)]."""
    n, c = x.shape[:2]
    fc1 = w1.reshape(w1.shape[0], -1).astype(np.float64)
    fc2 = w2.reshape(w2.shape[0], -1).astype(np.float64)
    if fc1.shape[1] != c or fc2.shape != (c, fc1.shape[0]):
        raise ValueError(f"W1 must be [R, {c}] and W2 [{c}, R], not {list(w1.shape)} and {list(w2.shape)}")
    mean = x.astype(np.float64).reshape(n, c, -1).mean(axis=2)  # [N, C]
    hidden = relu(mean @ fc1.T + b1.astype(np.float64))  # [N, R]
    scale = hard_sigmoid(hidden @ fc2.T + b2.astype(np.float64), alpha, beta)  # [N, C]
    return x.astype(np.float64) * scale.reshape(n, c, 1, 1)


def tolerance_ratio(got: np.ndarray, want: np.ndarray, *, atol: float = ATOL, rtol: float = RTOL) -> float:
    """max |got - want| / (atol + rtol |want|) over all elements: <= 1 is within tolerance. inf on a shape
    mismatch or a non-finite value where the reference is finite."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if got.size == 0:
        return 0.0
    bound = atol + rtol * np.abs(want)
    diff = np.abs(got - want)
    diff = np.where(np.isfinite(diff), diff, np.inf)
    return float(np.max(diff / bound))


def within_tolerance(got: np.ndarray, want: np.ndarray, *, atol: float = ATOL, rtol: float = RTOL) -> bool:
    return tolerance_ratio(got, want, atol=atol, rtol=rtol) <= 1.0
