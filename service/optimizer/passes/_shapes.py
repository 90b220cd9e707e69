"""Dtypes and shapes of intermediate tensors, for the passes that must prove a rewrite keeps them.

Exported models often carry no ``value_info``, so graphsurgeon knows nothing about intermediate tensors.
``ensure_types`` runs ONNX shape inference (with data propagation, so ``Shape -> Gather -> Concat``
chains resolve) on a *weightless* copy of the graph: large initializers become typed graph inputs, so
a 100 MB ResNet costs milliseconds, not a copy of every weight. Inferred facts only fill gaps: a dtype
or shape that graphsurgeon already has is never overwritten, graph inputs/outputs are never touched.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx

from service.optimizer.shapes import UNKNOWN_PREFIX

log = logging.getLogger(__name__)

# Constants up to this many elements travel with their values (shape tensors, axes); larger ones only
# as typed inputs.
_INLINE_CONSTANT_ELEMENTS = 4096


def needs_types(tensors) -> bool:
    """True when any of ``tensors`` lacks a dtype or a shape."""
    return any(t.dtype is None or t.shape is None for t in tensors if isinstance(t, gs.Variable))


def ensure_types(graph: gs.Graph) -> None:
    """Fill missing dtype/shape of intermediate variables from ONNX shape inference. Never raises."""
    try:
        inferred = onnx.shape_inference.infer_shapes(
            _weightless_model(graph), check_type=False, strict_mode=False, data_prop=True
        )
    except Exception as exc:  # an op shape inference cannot handle: passes simply see unknown shapes
        log.debug("shape inference failed: %s", exc)
        return
    boundary = {id(t) for t in graph.inputs} | {id(t) for t in graph.outputs}
    tensors = graph.tensors()
    run = next(_RUNS)
    for info in inferred.graph.value_info:
        tensor = tensors.get(info.name)
        if isinstance(tensor, gs.Variable) and id(tensor) not in boundary:
            _fill(tensor, info, run)


_RUNS = itertools.count()
"""Numbers the inference runs: the dims one run invents (``unk__3``) mean nothing to another."""


def _fill(tensor: gs.Variable, info: onnx.ValueInfoProto, run: int) -> None:
    if not info.type.HasField("tensor_type"):
        return
    tensor_type = info.type.tensor_type
    if tensor.dtype is None and tensor_type.elem_type:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            tensor.dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
    if tensor.shape is None and tensor_type.HasField("shape"):
        tensor.shape = [
            dim.dim_value if dim.HasField("dim_value") else _dim_name(dim.dim_param, run)
            for dim in tensor_type.shape.dim
        ]


def _dim_name(name: str, run: int) -> str | None:
    """A symbolic dim as this run's own: shape inference names the dims it cannot resolve ``unk__N`` afresh
    in every run, so ``unk__250`` of two runs are two unrelated dims. Kept as written, tensors filled by
    different runs would claim equal sizes, and ONNX Runtime, planning memory by those claims, reused one
    tensor's buffer for another of another size (Faster R-CNN: "Shape mismatch attempting to re-use
    buffer {0} != {91}")."""
    if not name:
        return None
    return f"{name}_run{run}" if name.startswith(UNKNOWN_PREFIX) else name


def _weightless_model(graph: gs.Graph) -> onnx.ModelProto:
    nodes = [OnnxExporter.export_node(node) for node in graph.nodes]
    inputs = [_value_info(t) for t in graph.inputs]
    initializers = []
    input_names = {t.name for t in graph.inputs}
    for tensor in graph.tensors().values():
        if not isinstance(tensor, gs.Constant) or tensor.name in input_names:
            continue
        if tensor.shape is not None and int(np.prod(tensor.shape)) <= _INLINE_CONSTANT_ELEMENTS:
            initializers.append(OnnxExporter.export_tensor_proto(tensor))
        else:
            inputs.append(_value_info(tensor))
    outputs = [_value_info(t) for t in graph.outputs]
    onnx_graph = onnx.helper.make_graph(nodes, graph.name or "graph", inputs, outputs, initializers)
    opsets = list(graph.import_domains or []) or [onnx.helper.make_opsetid("", graph.opset)]
    model = onnx.helper.make_model(onnx_graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def _value_info(tensor: gs.Tensor) -> onnx.ValueInfoProto:
    dtype = getattr(tensor, "export_dtype", None) or tensor.dtype
    elem_type = dtype_to_onnx(dtype) if dtype is not None else onnx.TensorProto.UNDEFINED
    shape = None if tensor.shape is None else [d if isinstance(d, (int, str)) else None for d in tensor.shape]
    return onnx.helper.make_tensor_value_info(tensor.name, elem_type, shape)


def static_shape(tensor: gs.Tensor) -> tuple[int, ...] | None:
    """The shape when every dim is a known integer, else None."""
    shape = tensor.shape
    if shape is None or any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
        return None
    return tuple(int(d) for d in shape)


def rank(tensor: gs.Tensor) -> int | None:
    return None if tensor.shape is None else len(tensor.shape)


def tensor_dtype(tensor: gs.Tensor) -> np.dtype | None:
    """The numpy dtype of a tensor when known (None for unknown or exotic types)."""
    dtype = tensor.dtype
    if dtype is None:
        return None
    try:
        return np.dtype(dtype)
    except TypeError:
        return None
