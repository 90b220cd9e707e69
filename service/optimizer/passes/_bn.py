"""BatchNormalization in inference form, as the per-channel affine map it is: ``y = x * scale + shift``."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from service.optimizer.passes._match import DEFAULT_DOMAINS, FLOAT_DTYPES, constant_value


def bn_affine(bn: gs.Node, graph: gs.Graph) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, shift) in float64 for an inference BatchNormalization with constant parameters, else None.

    Refused: training mode (``training_mode=1``, or ``is_test=0`` before opset 7), ``spatial=0``
    (opset < 9), any named extra output (even unused: ONNX Runtime runs BN in training mode when a node
    declares running-mean/var outputs), non-constant or non-1-D parameters, a negative ``var + epsilon``
    or non-finite parameters.
    """
    if bn.op != "BatchNormalization" or bn.domain not in DEFAULT_DOMAINS or len(bn.inputs) != 5:
        return None
    if int(bn.attrs.get("training_mode", 0)):
        return None
    if graph.opset < 7 and not int(bn.attrs.get("is_test", 0)):
        return None
    if graph.opset < 9 and not int(bn.attrs.get("spatial", 1)):
        return None
    if any(not t.is_empty() for t in bn.outputs[1:]):
        return None
    params = [constant_value(t) for t in bn.inputs[1:]]
    if any(p is None or p.dtype not in FLOAT_DTYPES or p.ndim != 1 for p in params):
        return None
    gamma, beta, mean, var = (p.astype(np.float64) for p in params)
    if len({gamma.shape, beta.shape, mean.shape, var.shape}) != 1:
        return None
    epsilon = float(bn.attrs.get("epsilon", 1e-5))
    denominator = var + epsilon
    if not all(np.isfinite(p).all() for p in (gamma, beta, mean, var)) or (denominator <= 0).any():
        return None
    scale = gamma / np.sqrt(denominator)
    return scale, beta - mean * scale
