"""The demo model zoo: valid ONNX, runnable, torchvision-shaped, 2019-exporter-shaped, sane activations.

Expected op counts come from torchvision's architectures and from the real export measured in
/work/shared/anchors.md (MobileNetV3-Large with BN kept: 549 nodes; 62 Conv, 116 Constant, 39 Add,
29 Clip/Mul/Div, 19 Relu), not from the code under test.
"""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from service import zoo

REPO = Path(__file__).resolve().parents[2]
ALL_MODELS = ["mobilenet_v3_large", "mobilenet_v3_small", "mobilenet_v3_large_native", "resnet18", "resnet50"]


@functools.cache
def built(name: str, seed: int = 0, opset: int | None = None) -> onnx.ModelProto:
    """Build once per test session (resnet50 takes a second or two); callers must not mutate it."""
    return zoo.build(name, seed=seed, opset=opset)


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def images(batch: int, seed: int = 123) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 224, 224), dtype=np.float32)


def histogram(model: onnx.ModelProto) -> Counter[str]:
    return Counter(node.op_type for node in model.graph.node)


def constant_value(model: onnx.ModelProto, tensor: str) -> float:
    (node,) = [n for n in model.graph.node if n.op_type == "Constant" and n.output[0] == tensor]
    return float(numpy_helper.to_array(node.attribute[0].t))


def test_list_models_has_the_required_models() -> None:
    assert set(ALL_MODELS) <= set(zoo.list_models())


def test_unknown_name_is_a_value_error_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"mobilenet_v3_large.*resnet50"):
        zoo.build("vgg16")


@pytest.mark.parametrize(
    ("name", "opset"), [("resnet18", 8), ("resnet18", 18), ("mobilenet_v3_large_native", 13)]
)
def test_unsupported_opset_is_a_value_error(name: str, opset: int) -> None:
    with pytest.raises(ValueError, match="opset"):
        zoo.build(name, opset=opset)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_model_is_valid_onnx_with_dynamic_batch(name: str) -> None:
    model = built(name)
    onnx.checker.check_model(model, full_check=True)
    opset = {o.domain: o.version for o in model.opset_import}[""]
    assert opset == (14 if name.endswith("_native") else 11)
    assert model.ir_version <= 8
    (inp,), (out,) = model.graph.input, model.graph.output
    assert inp.name == "input" and out.name == "output"
    in_dims = inp.type.tensor_type.shape.dim
    out_dims = out.type.tensor_type.shape.dim
    assert in_dims[0].dim_param and not in_dims[0].HasField("dim_value")
    assert [d.dim_value for d in in_dims[1:]] == [3, 224, 224]
    assert out_dims[0].dim_param == in_dims[0].dim_param and out_dims[1].dim_value == 1000
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.FLOAT


@pytest.mark.parametrize("name", ALL_MODELS)
def test_runs_in_ort_at_batch_1_and_3_in_inference_form(name: str) -> None:
    sess = session(built(name))
    x = images(3)
    (y3,) = sess.run(["output"], {"input": x})
    (y1,) = sess.run(["output"], {"input": x[:1]})
    assert y3.shape == (3, 1000) and y1.shape == (1, 1000)
    assert np.isfinite(y3).all()
    # BN in inference form: an item's output does not depend on the rest of the batch.
    np.testing.assert_allclose(y1[0], y3[0], rtol=1e-4, atol=1e-4)


MNV3_LARGE_2019 = {  # anchors.md, real 2019-style export with BatchNormalization kept (549 nodes)
    "Conv": 62,
    "BatchNormalization": 46,
    "Constant": 116,
    "Add": 39,
    "Clip": 29,
    "Mul": 29,
    "Div": 29,
    "Relu": 19,
    "GlobalAveragePool": 9,
    "Flatten": 1,
    "Gemm": 2,
}
EXPECTED_OPS = {
    "mobilenet_v3_large": MNV3_LARGE_2019,
    # torchvision small: 52 Conv (18 SE), 19 hard-swish + 9 hard-sigmoid = 28 Clip, 6 residual Adds.
    "mobilenet_v3_small": {
        "Conv": 52,
        "BatchNormalization": 34,
        "Clip": 28,
        "Div": 28,
        "Mul": 28,
        "Add": 34,
        "Constant": 112,
        "Relu": 14,
        "GlobalAveragePool": 10,
        "Gemm": 2,
    },
    "mobilenet_v3_large_native": {
        "Conv": 62,
        "BatchNormalization": 46,
        "HardSwish": 21,
        "HardSigmoid": 8,
        "Mul": 8,
        "Add": 10,
        "Relu": 19,
        "Clip": 0,
        "Div": 0,
        "Constant": 0,
    },
    "resnet18": {"Conv": 20, "BatchNormalization": 20, "Relu": 17, "Add": 8, "MaxPool": 1, "Gemm": 1},
    "resnet50": {"Conv": 53, "BatchNormalization": 53, "Relu": 49, "Add": 16, "MaxPool": 1, "Gemm": 1},
}


@pytest.mark.parametrize("name", ALL_MODELS)
def test_op_histogram_matches_torchvision(name: str) -> None:
    hist = histogram(built(name))
    for op, count in EXPECTED_OPS[name].items():
        assert hist[op] == count, f"{name}: {op} {hist[op]} != {count}"
    assert hist["Identity"] > 0
    if name.startswith("resnet"):
        assert hist["Clip"] == 0 and hist["Flatten"] == 1 and hist["GlobalAveragePool"] == 1


def test_mobilenet_v3_large_node_count_matches_the_real_export() -> None:
    model = built("mobilenet_v3_large")
    assert 500 <= len(model.graph.node) <= 600
    assert len(model.graph.node) == 549  # anchors.md
    assert histogram(model)["Identity"] == 549 - sum(MNV3_LARGE_2019.values())


@pytest.mark.parametrize("name", ["mobilenet_v3_large", "resnet50"])
def test_identity_nodes_route_initializers(name: str) -> None:
    model = built(name)
    weights = {t.name for t in model.graph.initializer}
    consumers = {i for n in model.graph.node for i in n.input}
    for node in model.graph.node:
        if node.op_type == "Identity":
            assert node.input[0] in weights and node.output[0] in consumers


def test_conv_before_bn_has_no_bias_and_bn_attributes() -> None:
    model = built("mobilenet_v3_large")
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        conv = producer[node.input[0]]
        assert conv.op_type == "Conv" and len(conv.input) == 2
        attrs = {a.name: a.f for a in node.attribute}
        assert attrs["epsilon"] == pytest.approx(1e-3) and attrs["momentum"] == pytest.approx(0.99)
    resnet_bn = next(n for n in built("resnet18").graph.node if n.op_type == "BatchNormalization")
    assert {a.name: a.f for a in resnet_bn.attribute}["epsilon"] == pytest.approx(1e-5)


def test_clip_takes_attributes_below_opset_11_and_constant_inputs_from_11() -> None:
    old, new = built("mobilenet_v3_small", opset=9), built("mobilenet_v3_small", opset=11)
    onnx.checker.check_model(old, full_check=True)
    assert old.ir_version == 4 and new.ir_version == 6
    old_clips = [n for n in old.graph.node if n.op_type == "Clip"]
    new_clips = [n for n in new.graph.node if n.op_type == "Clip"]
    assert len(old_clips) == len(new_clips) == 28
    for clip in old_clips:
        assert len(clip.input) == 1
        assert {a.name: a.f for a in clip.attribute} == {"min": 0.0, "max": 6.0}
    for clip in new_clips:
        assert len(clip.input) == 3 and not clip.attribute
        assert constant_value(new, clip.input[1]) == 0.0 and constant_value(new, clip.input[2]) == 6.0
    # The scalars of hard-swish: Add 3 and Div 6, each from its own Constant node.
    for model in (old, new):
        adds = [n for n in model.graph.node if n.op_type == "Add" and _is_constant(model, n.input[1])]
        assert len(adds) == 28 and {constant_value(model, n.input[1]) for n in adds} == {3.0}
        divs = [constant_value(model, n.input[1]) for n in model.graph.node if n.op_type == "Div"]
        assert set(divs) == {6.0}
        const_outputs = [n.output[0] for n in model.graph.node if n.op_type == "Constant"]
        uses = Counter(i for n in model.graph.node for i in n.input)
        assert all(uses[c] == 1 for c in const_outputs)
    assert histogram(new)["Constant"] - histogram(old)["Constant"] == 2 * 28
    # Same seed, same weights: both opsets compute the same function.
    x = images(2)
    np.testing.assert_allclose(
        session(old).run(None, {"input": x})[0], session(new).run(None, {"input": x})[0], rtol=1e-3, atol=1e-3
    )


def _is_constant(model: onnx.ModelProto, tensor: str) -> bool:
    return any(n.op_type == "Constant" and n.output[0] == tensor for n in model.graph.node)


def test_opset_17_uses_ir_8_and_bn_training_mode_off() -> None:
    model = built("mobilenet_v3_small", opset=17)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    assert {a.name: a.i for a in bn.attribute if a.name == "training_mode"} == {"training_mode": 0}


def test_native_model_computes_the_same_function_as_the_2019_one() -> None:
    x = images(2)
    decomposed = session(built("mobilenet_v3_large", opset=14)).run(None, {"input": x})[0]
    native = session(built("mobilenet_v3_large_native")).run(None, {"input": x})[0]
    np.testing.assert_allclose(native, decomposed, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["mobilenet_v3_large", "mobilenet_v3_small", "resnet50"])
def test_activations_neither_vanish_nor_explode(name: str) -> None:
    model = built(name)
    probes = [n.output[0] for n in model.graph.node if n.op_type in ("Conv", "BatchNormalization", "Add")]
    assert len(probes) > 50
    names = ["output", *probes]
    values = session(zoo.with_outputs(model, probes)).run(names, {"input": images(2, seed=7)})
    for tensor, value in zip(names, values, strict=True):
        assert np.isfinite(value).all(), tensor
        assert 1e-3 < float(value.std()) < 1e4, f"{name}: tensor {tensor} std {value.std()}"
    logits = values[0]
    assert 0.1 < float(logits.std()) < 100
    # Different images give different predictions (the signal survives the depth).
    assert float(np.abs(logits[0] - logits[1]).mean()) > 1e-2 * float(logits.std())


def test_bn_statistics_are_calibrated_not_fresh_defaults() -> None:
    weights = {t.name: numpy_helper.to_array(t) for t in built("resnet18").graph.initializer}
    var = weights["layer4.1.bn2.running_var"]
    mean = weights["layer4.1.bn2.running_mean"]
    assert not np.allclose(var, 1.0) and not np.allclose(mean, 0.0) and (var > 0).all()


def test_same_seed_same_bytes_other_seed_other_weights() -> None:
    first = zoo.build("mobilenet_v3_small", seed=3).SerializeToString()
    again = zoo.build("mobilenet_v3_small", seed=3).SerializeToString()
    other = zoo.build("mobilenet_v3_small", seed=4)
    assert first == again
    base = {t.name: t.raw_data for t in onnx.load_from_string(first).graph.initializer}
    changed = [t.name for t in other.graph.initializer if base[t.name] != t.raw_data]
    assert len(changed) == len(base)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", "zoo", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_cli_lists_and_builds(tmp_path: Path) -> None:
    listed = run_cli("--list")
    assert listed.returncode == 0, listed.stderr
    assert set(ALL_MODELS) <= set(listed.stdout.split())
    out = tmp_path / "x.onnx"
    made = run_cli("resnet18", str(out))
    assert made.returncode == 0, made.stderr
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert histogram(model)["Conv"] == 20
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644 & ~umask, "an ordinary file, not a private temp file"
    assert run_cli("nope", str(out)).returncode != 0
