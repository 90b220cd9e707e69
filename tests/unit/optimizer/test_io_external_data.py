"""``load_model_file`` never follows a reference to weights in a separate file (as
``torch.onnx.export(dynamo=True)`` writes them): the acceptance check refuses such a model, in the server and in
the CLI alike (tests/integration/api/test_cli_matches_upload.py)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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


def test_the_server_default_never_opens_external_files(tmp_path):
    """The reference is left alone, never followed."""
    path = tmp_path / "m.onnx"
    _save_external(_conv_relu(np.ones((3, 2, 3, 3), np.float32)), path)
    model = load_model_file(path)
    weights = [t for t in model.graph.initializer if t.name == "w"]
    assert weights[0].data_location == onnx.TensorProto.EXTERNAL
    assert not weights[0].raw_data
