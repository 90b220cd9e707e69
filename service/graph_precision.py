"""The floating-point precision a graph computes in, read from the graph itself.

``graph_precision(model)`` is ``"fp16"`` when some of the main graph's arithmetic is in half precision:
a float16 initializer or ``Constant``, a float16 graph input or output, or a ``Cast`` to float16 (what
``onnxruntime.transformers.float16`` writes around an fp16 body kept behind fp32 inputs and outputs);
otherwise ``"fp32"``. One fp16 tensor on the way is enough: its rounding (a unit roundoff of 2^-11, about
4.9e-4, against float32's 2^-24) then bounds how closely any two computations of the graph can agree.
Only the main graph is read: the If/Loop bodies of exported detectors hold index and shape arithmetic.

Both the optimizer (its verification tolerance) and the runtime (what an engine reports) ask this one
function, so the two layers agree on what an fp16 graph is.
"""

from __future__ import annotations

import onnx

FP16 = "fp16"
FP32 = "fp32"
_HALF = onnx.TensorProto.FLOAT16


def graph_precision(model: onnx.ModelProto) -> str:
    """``"fp16"`` when the main graph computes in half precision somewhere (see the module docstring), else
    ``"fp32"``."""
    graph = model.graph
    if any(t.data_type == _HALF for t in graph.initializer):
        return FP16
    if any(_elem_type(v) == _HALF for v in (*graph.input, *graph.output)):
        return FP16
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Cast" and any(a.name == "to" and a.i == _HALF for a in node.attribute):
            return FP16
        if node.op_type == "Constant" and any(a.name == "value" and a.t.data_type == _HALF for a in node.attribute):
            return FP16
    return FP32


def _elem_type(value: onnx.ValueInfoProto) -> int:
    return value.type.tensor_type.elem_type if value.type.HasField("tensor_type") else 0
