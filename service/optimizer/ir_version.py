"""Lowering a model's IR version to the newest one ONNX Runtime reads.

onnx writes its own newest IR version into every model it makes (``onnx.helper.make_model`` without
``ir_version``: 14 with onnx 1.23), and ONNX Runtime refuses a model whose IR version is newer than the one it
was built with (13 for ORT 1.31), however old everything in the model is. The IR version is a stamp on the
file: each version only adds things a model may use (``IR_ADDITIONS``, from onnx's ``onnx.proto``). So a model
that uses none of what came after ONNX Runtime's version means the same at that version, and ``servable``
lowers the stamp; one that uses any of it (or comes from an IR version whose additions are not listed here)
is refused with the fix. ONNX Runtime's version is asked of ONNX Runtime itself (``runtime_ir_version``).

Why no numeric check: the lowering changes the ``ir_version`` field and nothing else (no node, attribute,
tensor, type or opset), and ONNX Runtime cannot run the model before it, so there is nothing to compare it
with. The lowered model is what the acceptance rules then check (``onnx.checker`` at the lowered version) and
what every rewrite of the optimizer is verified against.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import onnx
from onnx import AttributeProto, TensorProto, TypeProto, helper

from service.errors import InvalidModelError, printable

IR_ADDITIONS: dict[int, frozenset[int]] = {
    12: frozenset({24}),  # FLOAT8E8M0
    13: frozenset({25, 26}),  # UINT2, INT2
    14: frozenset({27, 28}),  # FLOAT6E2M3, FLOAT6E3M2; and opaque types outside ONNX-ML builds
}
"""Per IR version, the tensor data types it added (``TensorProto.DataType`` numbers): with the opsets that
need it (``onnx.helper.find_min_ir_version_for``), what a model could use of that version. A model is lowered
only past versions listed here; opaque types are taken as needing IR 14."""
OPAQUE_IR = 14
_PROBE_OPSET = 13
"""The ``ai.onnx`` opset of the probe model: any ONNX Runtime able to read IR 7 or newer has it."""


@functools.cache
def runtime_ir_version() -> int:
    """The newest IR version this process's ONNX Runtime loads, found by loading a one-node model at each
    version from onnx's newest down (ONNX Runtime has no call that tells it)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # the refusals of the newer versions are the answer, not errors to log
    for version in range(onnx.IR_VERSION, 6, -1):
        try:
            ort.InferenceSession(_probe(version), options, providers=["CPUExecutionProvider"])
        except Exception:  # ORT raises its own Fail for a version it does not read
            continue
        return version
    raise RuntimeError("ONNX Runtime loads no model of IR version 7 or newer")


def servable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its IR version lowered (in place) to ``runtime_ir_version()`` where it is newer and
    nothing in the model needs it; InvalidModelError naming what needs it, and the fix, otherwise."""
    limit = runtime_ir_version()
    if model.ir_version <= limit:
        return model
    why = _needs_newer(model, limit)
    if why is not None:
        raise InvalidModelError(
            f"the model's IR version {model.ir_version} is newer than ONNX Runtime here reads ({limit} at most), "
            f"and the model needs it: {why}; re-export with ir_version <= {limit} and an opset and types that "
            f"allow it (onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid('', 17)], "
            f"ir_version={limit}))"
        )
    model.ir_version = limit
    return model


def _needs_newer(model: onnx.ModelProto, limit: int) -> str | None:
    """What in ``model`` needs an IR version above ``limit``, in words; None when nothing does."""
    unknown = [v for v in range(limit + 1, model.ir_version + 1) if v not in IR_ADDITIONS]
    if unknown:
        return f"what IR version {unknown[0]} added is not known to this server"
    newer = {dt for v, types in IR_ADDITIONS.items() if v > limit for dt in types}
    opsets = [*model.opset_import, *(o for f in model.functions for o in f.opset_import)]
    for opset in opsets:
        needed = helper.find_min_ir_version_for([opset], ignore_unknown=True)
        if needed > limit:
            return f"opset {opset.version} of {printable(opset.domain or 'ai.onnx')!r} needs IR version {needed}"
    for what, elem_type in _data_types(model):
        if elem_type == -1 and limit < OPAQUE_IR:
            return f"{what} has an opaque type (IR version {OPAQUE_IR})"
        if elem_type in newer:
            return f"{what} is of type {TensorProto.DataType.Name(elem_type)}"
    return None


def _data_types(model: onnx.ModelProto) -> Iterator[tuple[str, int]]:
    """(what, data type) of every tensor and typed value in the model, subgraphs and functions included;
    an opaque type is data type -1."""
    graphs: list[onnx.GraphProto] = [model.graph]
    nodes: list[onnx.NodeProto] = [n for f in model.functions for n in f.node]
    for function in model.functions:
        for info in function.value_info:
            yield from _typed(f"value {printable(info.name)!r}", info.type)
    while graphs:
        graph = graphs.pop()
        nodes.extend(graph.node)
        for tensor in graph.initializer:
            yield f"tensor {printable(tensor.name)!r}", tensor.data_type
        for sparse in graph.sparse_initializer:
            yield f"tensor {printable(sparse.values.name)!r}", sparse.values.data_type
        for info in (*graph.input, *graph.output, *graph.value_info):
            yield from _typed(f"value {printable(info.name)!r}", info.type)
        while nodes:
            node = nodes.pop()
            for attr in node.attribute:
                yield from _attribute_types(attr, f"attribute {printable(attr.name)!r} of node "
                                                  f"{printable(node.name or node.op_type)!r}")
                graphs.extend([attr.g] if attr.type == AttributeProto.GRAPH else attr.graphs)


def _attribute_types(attr: AttributeProto, what: str) -> Iterator[tuple[str, int]]:
    for tensor in (*([attr.t] if attr.HasField("t") else []), *attr.tensors):
        yield what, tensor.data_type
    for sparse in (*([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []), *attr.sparse_tensors):
        yield what, sparse.values.data_type
    for type_proto in (*([attr.tp] if attr.HasField("tp") else []), *attr.type_protos):
        yield from _typed(what, type_proto)


def _typed(what: str, type_proto: TypeProto) -> Iterator[tuple[str, int]]:
    """The element types inside a TypeProto (sequences, maps and optionals unwrapped)."""
    kind = type_proto.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        yield what, getattr(type_proto, kind).elem_type
    elif kind in ("sequence_type", "optional_type"):
        yield from _typed(what, getattr(type_proto, kind).elem_type)
    elif kind == "map_type":
        yield what, type_proto.map_type.key_type
        yield from _typed(what, type_proto.map_type.value_type)
    elif kind == "opaque_type":
        yield what, -1


def _probe(ir_version: int) -> bytes:
    """A one-node (Identity) model stamped with ``ir_version``."""
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [value],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _PROBE_OPSET)], ir_version=ir_version)
    return model.SerializeToString()
