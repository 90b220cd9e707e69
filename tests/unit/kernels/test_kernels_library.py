"""The custom-op library in ONNX Runtime (its CPU kernels; the CUDA ones run in bench/fused_ops.py on a GPU):
registration, attributes, shape inference, error messages, the numbers against kernels.reference, and the
optimizer's rewrite computing what the unfused graph computes."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper
from test_kernels_reference import DW_SPECS, SE_SPECS, dw_reference, ort_cpu, se_reference

from kernels import graphs, reference
from service.optimizer.fused_ops import apply_fused_ops
from service.runtime import fused_ops as runtime_fused_ops

pytestmark = pytest.mark.slow  # the first test builds the library (about 10 s)


def library_session(model, library) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("spec", DW_SPECS, ids=lambda s: s.label)
@pytest.mark.parametrize("batch", [1, 3])
def test_dwconv_kernel_matches_the_reference(cpu_library, spec, batch):
    model = graphs.dwconv_model(spec, fused=True, seed=batch)
    x = graphs.input_array((batch, spec.channels, spec.height, spec.width), seed=11)
    got = library_session(model, cpu_library).run(None, {"x": x})[0]
    want = dw_reference(model, spec, x)
    assert got.dtype == np.float32
    assert reference.within_tolerance(got, want), reference.tolerance_ratio(got, want)


@pytest.mark.parametrize("spec", SE_SPECS, ids=lambda s: s.label)
@pytest.mark.parametrize("batch", [1, 4])
def test_se_kernel_matches_the_reference(cpu_library, spec, batch):
    model = graphs.se_model(spec, fused=True, seed=batch)
    x = graphs.input_array((batch, spec.channels, spec.height, spec.width), seed=5)
    got = library_session(model, cpu_library).run(None, {"x": x})[0]
    want = se_reference(model, spec, x)
    assert reference.within_tolerance(got, want), reference.tolerance_ratio(got, want)


@pytest.mark.parametrize(
    "model",
    [
        graphs.dwconv_model(graphs.DwSpec(24, 14, 14, 5, 2, "HardSwish"), copies=2),
        graphs.dwconv_model(graphs.DwSpec(16, 10, 10, 3, 1, "Relu")),
        graphs.se_model(graphs.SeSpec(40, 7, 7, 10), copies=2),
    ],
    ids=["dw-k5s2-hardswish", "dw-k3s1-relu", "se"],
)
def test_rewritten_graph_computes_what_the_original_computes(cpu_library, model):
    lowered, stats = apply_fused_ops(model)
    assert sum(stats.values()) == len(model.graph.output)
    shape = [d.dim_value or 2 for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = graphs.input_array(tuple(shape), seed=1)
    want = [ort_cpu(model, x)] if len(model.graph.output) == 1 else _all_outputs(model, x)
    got = library_session(lowered, cpu_library).run(None, {"x": x})
    for g, w in zip(got, want, strict=True):
        assert reference.within_tolerance(g, w), reference.tolerance_ratio(g, w)


def _all_outputs(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_output_shape_is_inferred(cpu_library):
    spec = graphs.DwSpec(8, 15, 9, 5, 2, "Relu")
    model = graphs.dwconv_model(spec, batch=2, fused=True)
    model.graph.output[0].type.tensor_type.ClearField("shape")  # leave the output shape to the op
    session = library_session(model, cpu_library)
    assert session.get_outputs()[0].shape == [2, 8, *spec.out_hw]


def _fused_dw(weight_shape, **attrs):
    model = graphs.dwconv_model(graphs.DwSpec(4, 6, 6, 3, 1, "Relu"), fused=True)
    node = model.graph.node[0]
    for name, value in attrs.items():
        for a in list(node.attribute):
            if a.name == name:
                node.attribute.remove(a)
        node.attribute.append(helper.make_attribute(name, value))
    weight = next(t for t in model.graph.initializer if t.name == "w0")
    weight.CopyFrom(helper.make_tensor("w0", weight.data_type, weight_shape,
                                       np.zeros(int(np.prod(weight_shape)), np.float32)))
    return model


@pytest.mark.parametrize(
    ("weight_shape", "attrs", "message"),
    [
        ((4, 1, 3, 5), {}, "W must be \\[C, 1, k, k\\]"),
        ((4, 1, 7, 7), {}, "k 3 or 5"),
        ((4, 1, 3, 3), {"strides": [2, 1]}, "strides must be"),
        ((4, 1, 3, 3), {"pads": [1, 1, 0, 0]}, "pads must be symmetric"),
        ((4, 1, 3, 3), {"pads": [3, 3, 3, 3]}, "smaller than the kernel"),
        ((4, 1, 3, 3), {"activation": "Gelu"}, "activation must be None, Relu or HardSwish"),
    ],
)
def test_unsupported_node_fails_with_a_clear_message(cpu_library, weight_shape, attrs, message):
    model = _fused_dw(weight_shape, **attrs)
    with pytest.raises(Exception, match=message):  # at session creation (attributes) or run (shapes)
        library_session(model, cpu_library).run(None, {"x": np.zeros((1, 4, 6, 6), np.float32)})


def test_se_weights_of_the_wrong_shape_fail_with_a_clear_message(cpu_library):
    model = graphs.se_model(graphs.SeSpec(8, 4, 4, 2), fused=True)
    w2 = next(t for t in model.graph.initializer if t.name == "w2_0")
    w2.CopyFrom(helper.make_tensor("w2_0", w2.data_type, [8, 3, 1, 1], np.zeros(24, np.float32)))
    with pytest.raises(Exception, match="SqueezeExcite: W2 must be \\[8, 2"):
        library_session(model, cpu_library).run(None, {"x": np.zeros((1, 8, 4, 4), np.float32)})


def test_the_library_loads_and_names_itself(cpu_library):
    assert runtime_fused_ops.library_loads(cpu_library)
    info = runtime_fused_ops.build_info(cpu_library)
    assert info is not None and "ORT API" in info
