"""kernels.reference against ONNX Runtime's CPU provider running the unfused operators: the numpy math
that the CUDA kernels are checked against on the GPU is ONNX's math."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from kernels import graphs, reference

DW_SPECS = [
    graphs.DwSpec(5, 9, 11, 3, 1, "Relu"),
    graphs.DwSpec(5, 9, 11, 3, 2, "HardSwish"),
    graphs.DwSpec(4, 8, 8, 5, 1, "None"),
    graphs.DwSpec(4, 13, 7, 5, 2, "HardSwish"),
    graphs.DwSpec(3, 6, 6, 3, 1, "Relu", pad=0),
    graphs.DwSpec(3, 7, 7, 5, 2, "Relu", pad=1),
    graphs.DwSpec(3, 7, 7, 5, 1, "None", pad=4),
]
SE_SPECS = [
    graphs.SeSpec(8, 5, 5, 4),
    graphs.SeSpec(13, 3, 7, 5),
    graphs.SeSpec(16, 1, 1, 8),
    graphs.SeSpec(72, 28, 28, 24),
    graphs.SeSpec(9, 4, 4, 3, alpha=0.2, beta=0.5),
]


def ort_cpu(model, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def dw_reference(model, spec: graphs.DwSpec, x: np.ndarray) -> np.ndarray:
    w = graphs.model_weights(model)
    return reference.dwconv_act(x, w["w0"], w["b0"], strides=(spec.stride,) * 2, pads=spec.pads,
                                activation=spec.activation)


def se_reference(model, spec: graphs.SeSpec, x: np.ndarray) -> np.ndarray:
    w = graphs.model_weights(model)
    return reference.squeeze_excite(x, w["w1_0"], w["b1_0"], w["w2_0"], w["b2_0"], alpha=spec.alpha, beta=spec.beta)


@pytest.mark.parametrize("spec", DW_SPECS, ids=lambda s: s.label)
@pytest.mark.parametrize("batch", [1, 3])
def test_dwconv_reference_matches_onnxruntime(spec, batch):
    model = graphs.dwconv_model(spec, seed=batch)
    x = graphs.input_array((batch, spec.channels, spec.height, spec.width), seed=7)
    want = dw_reference(model, spec, x)
    got = ort_cpu(model, x)
    assert got.shape == want.shape == (batch, spec.channels, *spec.out_hw)
    assert reference.within_tolerance(got, want), reference.tolerance_ratio(got, want)


@pytest.mark.parametrize("spec", SE_SPECS, ids=lambda s: s.label)
@pytest.mark.parametrize("batch", [1, 4])
def test_se_reference_matches_onnxruntime(spec, batch):
    model = graphs.se_model(spec, seed=batch)
    x = graphs.input_array((batch, spec.channels, spec.height, spec.width), seed=3)
    want = se_reference(model, spec, x)
    got = ort_cpu(model, x)
    assert reference.within_tolerance(got, want), reference.tolerance_ratio(got, want)


def test_inputs_exercise_every_activation_region():
    """The test weights put conv outputs on both sides of HardSwish's bends and the gate clipped and not."""
    spec = graphs.DwSpec(16, 12, 12, 3, 1, "None")
    model = graphs.dwconv_model(spec)
    pre = dw_reference(model, spec, graphs.input_array((2, 16, 12, 12), seed=0))
    assert (pre < -3).any() and (pre > 3).any() and ((pre > -3) & (pre < 3)).mean() > 0.3
    se = graphs.SeSpec(32, 6, 6, 8)
    w = graphs.model_weights(graphs.se_model(se))
    x = graphs.input_array((4, 32, 6, 6), seed=0).astype(np.float64)
    hidden = reference.relu(x.mean(axis=(2, 3)) @ w["w1_0"].reshape(8, 32).T + w["b1_0"])
    gate_input = (hidden @ w["w2_0"].reshape(32, 8).T + w["b2_0"]) / 6 + 0.5
    assert (gate_input < 0).any() and (gate_input > 1).any() and ((gate_input > 0) & (gate_input < 1)).any()


def test_tolerance_rule():
    want = np.array([1.0, -2.0, 0.0])
    assert reference.within_tolerance(want + np.array([1e-4, -2e-4, 1e-5]), want)
    assert not reference.within_tolerance(want + np.array([2e-4, 0, 0]), want)
    assert reference.tolerance_ratio(np.array([np.nan, -2.0, 0.0]), want) == np.inf
    assert reference.tolerance_ratio(want[:2], want) == np.inf
    assert reference.tolerance_ratio(want, want) == 0.0


def test_reference_refuses_weights_of_the_wrong_shape():
    x = np.zeros((1, 4, 5, 5), np.float32)
    with pytest.raises(ValueError, match="depthwise weight"):
        reference.dwconv_act(x, np.zeros((4, 2, 3, 3)), np.zeros(4))
    with pytest.raises(ValueError, match="W1 must be"):
        reference.squeeze_excite(x, np.zeros((2, 3)), np.zeros(2), np.zeros((4, 2)), np.zeros(4))
