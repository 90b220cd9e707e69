"""``load_model_file`` with weights in a separate file, as ``torch.onnx.export(dynamo=True)`` writes them.

Regression: every dynamo export (``model.onnx`` + ``model.onnx.data``) was refused as "not a valid ONNX
model" by ``python -m service optimize``.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.errors import InvalidModelError
from service.optimizer import OptimizerConfig, optimize
from service.optimizer.io import load_model_file


def _conv_relu(weight: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 3, 3])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _save_external(model: onnx.ModelProto, path) -> None:
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
        location=f"{path.name}.data", size_threshold=0,
    )


def test_loads_weights_from_the_data_file_next_to_the_model(tmp_path):
    weight = np.random.default_rng(0).standard_normal((3, 2, 3, 3)).astype(np.float32)
    path = tmp_path / "m.onnx"
    _save_external(_conv_relu(weight), path)
    assert (tmp_path / "m.onnx.data").stat().st_size == weight.nbytes

    model = load_model_file(path, external_data=True)

    loaded = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_array_equal(loaded, weight)
    _optimized, report = optimize(model, OptimizerConfig())
    assert report.verified and report.nodes_after == 1


def test_missing_data_file_is_a_clear_refusal(tmp_path):
    path = tmp_path / "m.onnx"
    _save_external(_conv_relu(np.ones((3, 2, 3, 3), np.float32)), path)
    (tmp_path / "m.onnx.data").unlink()

    with pytest.raises(InvalidModelError, match=r"m\.onnx\.data") as info:
        load_model_file(path, external_data=True)
    assert str(tmp_path) not in info.value.message


def test_the_server_default_never_opens_external_files(tmp_path):
    """Without ``external_data=True`` (the registry's call) the reference is left alone, never followed."""
    path = tmp_path / "m.onnx"
    _save_external(_conv_relu(np.ones((3, 2, 3, 3), np.float32)), path)
    model = load_model_file(path)
    weights = [t for t in model.graph.initializer if t.name == "w"]
    assert weights[0].data_location == onnx.TensorProto.EXTERNAL
    assert not weights[0].raw_data
