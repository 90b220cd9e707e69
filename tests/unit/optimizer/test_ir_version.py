"""``optimizer.ir_version``: a model stamped with an IR version newer than ONNX Runtime reads is lowered to the
one it reads when nothing in the model needs the newer one, else refused naming what needs it and the fix.

Regression: onnx 1.23 writes IR 14 by default and ONNX Runtime 1.31 reads at most 13, so every model made
with ``onnx.helper.make_model`` without ``ir_version`` was refused (422 "Unsupported model IR version: 14")."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.errors import InvalidModelError
from service.optimizer.ir_version import IR_ADDITIONS, runtime_ir_version, servable


def _relu(opset: int = 17, ir_version: int | None = None, **graph: object) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], **graph)  # type: ignore[arg-type]
    opsets = [helper.make_opsetid("", opset)]
    if ir_version is None:
        return helper.make_model(g, opset_imports=opsets)  # onnx's own newest IR version
    return helper.make_model(g, opset_imports=opsets, ir_version=ir_version)


def _loads(model: onnx.ModelProto) -> bool:
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True


def test_onnx_runtime_is_asked_what_it_reads() -> None:
    limit = runtime_ir_version()
    assert _loads(_relu(ir_version=limit)) and not _loads(_relu(ir_version=limit + 1))


def test_a_model_of_onnxs_newest_ir_is_lowered_to_what_onnx_runtime_reads() -> None:
    model = _relu()
    assert model.ir_version == onnx.IR_VERSION > runtime_ir_version(), "the case this module exists for"
    assert not _loads(model)
    before = model.graph.SerializeToString()
    lowered = servable(model)
    assert lowered.ir_version == runtime_ir_version() and lowered.graph.SerializeToString() == before
    onnx.checker.check_model(lowered, full_check=True)
    x = np.array([[-1.0, 0.0, 2.0]], np.float32)
    out = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(out[0], np.maximum(x, 0))


def test_a_model_onnx_runtime_reads_is_left_alone() -> None:
    model = _relu(ir_version=8)
    assert servable(model) is model and model.ir_version == 8


def test_an_opset_that_needs_the_newer_ir_is_refused_with_the_fix() -> None:
    newest = onnx.defs.onnx_opset_version()
    if helper.find_min_ir_version_for([helper.make_opsetid("", newest)]) <= runtime_ir_version():
        pytest.skip("onnx's newest opset needs no IR version newer than ONNX Runtime reads")
    with pytest.raises(InvalidModelError) as caught:
        servable(_relu(opset=newest))
    message = caught.value.message
    assert f"opset {newest} of 'ai.onnx' needs IR version" in message
    assert f"re-export with ir_version <= {runtime_ir_version()}" in message and "make_model(" in message


def test_a_type_of_the_newer_ir_is_refused_naming_the_tensor() -> None:
    newest = max(IR_ADDITIONS)
    if newest <= runtime_ir_version():
        pytest.skip("ONNX Runtime reads every IR version listed")
    data_type = min(IR_ADDITIONS[newest])
    unused = helper.make_tensor("unused", data_type, [1], b"\x00", raw=True)
    with pytest.raises(InvalidModelError, match=rf"tensor 'unused' is of type {TensorProto.DataType.Name(data_type)}"):
        servable(_relu(ir_version=newest, initializer=[unused]))


def test_an_ir_version_whose_additions_are_unknown_is_refused() -> None:
    beyond = max(IR_ADDITIONS) + 1
    with pytest.raises(InvalidModelError, match=f"what IR version {beyond} added is not known"):
        servable(_relu(ir_version=beyond))


def test_types_in_subgraphs_and_attributes_count_too() -> None:
    newest = max(IR_ADDITIONS)
    if newest <= runtime_ir_version():
        pytest.skip("ONNX Runtime reads every IR version listed")
    hidden = helper.make_tensor("hidden", min(IR_ADDITIONS[newest]), [1], b"\x00", raw=True)
    branch = helper.make_graph([helper.make_node("Constant", [], ["c"], value=hidden)], "then", [],
                               [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1])])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                          [numpy_helper.from_array(np.array(True), "unused")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=newest)
    with pytest.raises(InvalidModelError, match="attribute 'value' of node 'Constant'"):
        servable(model)
