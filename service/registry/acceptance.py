"""Acceptance rules for uploaded models and model names.

Uploaded models are hostile until proven otherwise. Known attacks on model servers this module closes:
path traversal through ONNX external data (CVE-2022-25882, CVE-2024-27318 and symlink variants: we accept
NO external data anywhere, so no file outside the upload is ever opened), custom-domain ops that would load
native code or hit unreviewed kernels (only the standard and ONNX Runtime domains are allowed), absurd
nesting of subgraphs (stack exhaustion) and absurd declared shapes. Memory bombs in foldable constants are
handled by running the optimizer in a resource-limited child process (``registry.sandbox``); the
ones that only go off for some request values (``ConstantOfShape`` of a number taken from the input) are
refused here, because they would go off in the server itself, at inference time: a size or trip count
taken from request values must have a bound (``SIZE_INPUTS``, ``registry.value_bounds``).

``accepted_model`` is the one check of a model file, however it arrives: the upload's sandboxed child and the
CLI (``python -m service optimize``) both call it, so they refuse the same files with the same message.

``validate_model_name`` keeps names safe to use as one path component: the store still resolves and checks
every path it builds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence

import onnx
from onnx import AttributeProto, TensorProto

from service.errors import BadRequestError, InvalidModelError, printable
from service.optimizer.io import parse_model_bytes
from service.optimizer.ir_version import servable
from service.registry import intervals
from service.registry.value_bounds import ValueBounds
from service.runtime.contract import MAX_FIXED_ELEMENTS, ONNX_TO_NUMPY

ALLOWED_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})
MAX_GRAPH_DEPTH = 8
"""Deepest accepted nesting of subgraphs (If/Loop/Scan bodies); the main graph is depth 0."""
MAX_NODES = 200_000
MAX_RANK = 8
MIN_DEFAULT_OPSET = 7
SIZE_INPUTS: dict[str, tuple[int, ...]] = {
    "ConstantOfShape": (0,),
    "Expand": (1,),
    "Tile": (1,),
    "Range": (0, 1, 2),
    "OneHot": (1,),
    "Resize": (2, 3),
    "Upsample": (1,),
    "Pad": (1,),
    "CenterCropPad": (1,),
    "MaxUnpool": (2,),
    "Col2Im": (1, 2),
    "AffineGrid": (1,),
    "DFT": (1,),
    "STFT": (2, 3),
    "HannWindow": (0,),
    "HammingWindow": (0,),
    "BlackmanWindow": (0,),
    "MelWeightMatrix": (0, 1),
    "ImageDecoder": (0,),
    "Loop": (0,),
}
"""Standard ops whose listed inputs set, by their VALUES, an output size (Loop: the trip count; Resize's roi
sets none). Where such an input depends on the values of the model's inputs, one request (a large number
in an image) could make the server allocate without bound or loop forever at inference time, where no
child process limits it; so it must have a finite upper bound (``registry.value_bounds``: clipped by
constants, e.g. torchvision's Mask R-CNN clips boxes to the image) and the size it sets must stay within
``MAX_FIXED_ELEMENTS`` elements (a Range's delta must stay away from 0). Depending on input *shapes*
(through Shape/Size) is fine: the request size limits bound those, so a bound that grows with the request's
shapes is accepted when it holds at the smallest request; verification has run the model at small batch
sizes under the optimizer's limits. Left to that: arithmetic on shapes that grows superlinearly or
overflows only at large request shapes."""
_SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})
_DIRECT_SIZES = frozenset({("ConstantOfShape", 0), ("Expand", 1), ("OneHot", 1), ("Resize", 3)})
"""Size inputs ONNX Runtime takes as output dims as they are: an astronomically large or negative value
(``intervals.Bound.far``: a NaN or inf cast to int64) fails the request there. Where the op first computes
with it (Tile multiplies, Pad adds, a Loop counts) it could wrap to an ordinary size, so there it is refused."""

MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME_RE = re.compile(MODEL_NAME_PATTERN.strip("^$"), re.ASCII)
NAME_RULE = "1-64 characters: letters, digits, '_', '.', '-', starting with a letter or digit, no '..'"


def validate_model_name(name: object) -> str:
    """Return ``name`` if it is a safe model name, else raise BadRequestError (never echoing it)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise BadRequestError(f"invalid model name: use {NAME_RULE}")
    return name


RESERVED_NAMES = frozenset({"stats"})
"""Names a new model cannot take: ``GET /v2/models/stats`` is Triton's statistics extension, so a model named
``stats`` could never be described over KServe V2 REST."""


def validate_new_model_name(name: object) -> str:
    """``validate_model_name``, and not one of ``RESERVED_NAMES`` (for uploads and imports, not lookups)."""
    checked = validate_model_name(name)
    if checked in RESERVED_NAMES:
        raise BadRequestError(f"the model name {checked!r} is reserved: GET /v2/models/{checked} is Triton's "
                              "statistics extension")
    return checked


def accepted_model(data: bytes) -> onnx.ModelProto:
    """The bytes of a model file as the model that will be optimized and served, or InvalidModelError with
    the message a client (or the CLI's user) gets. Nothing it names is opened: no external data. An IR
    version newer than ONNX Runtime reads is lowered where nothing in the model needs it
    (``optimizer.ir_version``), before the rules below check the model at its new version."""
    model = servable(parse_model_bytes(data))
    validate_model(model)
    return model


def validate_model(model: onnx.ModelProto) -> None:
    """Raise InvalidModelError with a clear message unless ``model`` is acceptable for serving."""
    if not isinstance(model, onnx.ModelProto) or not model.HasField("graph"):
        raise InvalidModelError("not an ONNX model: no graph")
    if len(model.training_info):
        raise InvalidModelError("models with training information are not accepted")
    functions = {(f.domain, f.name) for f in model.functions}
    _check_opset_imports(model, {domain for domain, _ in functions})
    _check_function_calls(model, functions)
    node_count = 0
    for where, graph, depth in _all_graphs(model):
        if depth > MAX_GRAPH_DEPTH:
            raise InvalidModelError(f"subgraphs are nested deeper than {MAX_GRAPH_DEPTH} levels")
        node_count += len(graph.node)
        if node_count > MAX_NODES:
            raise InvalidModelError(f"the model has more than {MAX_NODES} nodes")
        _check_graph(graph, where, functions)
    _check_signature(model.graph)
    _run_checker(model)
    _check_value_dependent_sizes(model)


# ---------------------------------------------------------------------- domains and functions


def _check_opset_imports(model: onnx.ModelProto, function_domains: set[str]) -> None:
    if not model.opset_import:
        raise InvalidModelError("not an ONNX model: no opset import")
    for opset in model.opset_import:
        if opset.domain not in ALLOWED_DOMAINS and opset.domain not in function_domains:
            domain = printable(opset.domain)
            raise InvalidModelError(f"operator domain {domain!r} is not allowed; " + _domains_hint())
        newest = onnx.defs.onnx_opset_version()
        if opset.domain in ("", "ai.onnx") and not MIN_DEFAULT_OPSET <= opset.version <= newest:
            raise InvalidModelError(f"opset {opset.version} is unsupported: use {MIN_DEFAULT_OPSET}-{newest}")


def _check_function_calls(model: onnx.ModelProto, functions: set[tuple[str, str]]) -> None:
    """Model-local functions may call each other, but not recursively (that never terminates)."""
    calls = {
        (f.domain, f.name): {(n.domain, n.op_type) for n in f.node if (n.domain, n.op_type) in functions}
        for f in model.functions
    }
    state: dict[tuple[str, str], int] = {}

    def visit(key: tuple[str, str], depth: int) -> None:
        if state.get(key) == 2:
            return
        if state.get(key) == 1 or depth > MAX_GRAPH_DEPTH:
            raise InvalidModelError("model-local functions call each other recursively or too deeply")
        state[key] = 1
        for callee in calls.get(key, ()):
            visit(callee, depth + 1)
        state[key] = 2

    for key in calls:
        visit(key, 0)


def _domains_hint() -> str:
    return "only the standard ONNX domains and com.microsoft (ONNX Runtime) are accepted"


# ---------------------------------------------------------------------- graph walk


def _all_graphs(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.GraphProto, int]]:
    """Every graph with its nesting depth: the main graph, subgraphs, and model-local function bodies."""
    stack: list[tuple[str, onnx.GraphProto, int]] = [("main graph", model.graph, 0)]
    for function in model.functions:
        wrapper = onnx.GraphProto(name=function.name)
        wrapper.node.extend(function.node)
        stack.append((f"function {printable(function.name)!r}", wrapper, 1))
    while stack:
        where, graph, depth = stack.pop()
        yield where, graph, depth
        if depth > MAX_GRAPH_DEPTH:
            return
        for node in graph.node:
            for attr in node.attribute:
                subgraphs = [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)
                for sub in subgraphs:
                    stack.append((f"subgraph of node {printable(node.name or node.op_type)!r}", sub, depth + 1))


def _check_graph(graph: onnx.GraphProto, where: str, functions: set[tuple[str, str]]) -> None:
    for tensor in graph.initializer:
        _no_external_data(tensor, f"initializer {printable(tensor.name)!r} ({where})")
    for sparse in graph.sparse_initializer:
        _no_external_sparse(sparse, f"sparse initializer ({where})")
    for node in graph.node:
        label = f"node {printable(node.name or node.op_type)!r} ({where})"
        if node.domain not in ALLOWED_DOMAINS and (node.domain, node.op_type) not in functions:
            raise InvalidModelError(
                f"{label} uses operator {printable(node.op_type)!r} of domain {printable(node.domain)!r}; "
                + _domains_hint()
            )
        for attr in node.attribute:
            _check_attribute(attr, label)


def _check_attribute(attr: AttributeProto, label: str) -> None:
    what = f"attribute {printable(attr.name)!r} of {label}"
    if attr.HasField("t"):
        _no_external_data(attr.t, what)
    for tensor in attr.tensors:
        _no_external_data(tensor, what)
    if attr.HasField("sparse_tensor"):
        _no_external_sparse(attr.sparse_tensor, what)
    for sparse in attr.sparse_tensors:
        _no_external_sparse(sparse, what)


def _no_external_data(tensor: TensorProto, what: str) -> None:
    if tensor.data_location == TensorProto.EXTERNAL or len(tensor.external_data):
        raise InvalidModelError(
            f"{what} refers to external data; external data files are not accepted: give one self-contained "
            ".onnx file (onnx.save_model(onnx.load(path), out) writes the weights into it)"
        )


def _no_external_sparse(sparse: onnx.SparseTensorProto, what: str) -> None:
    _no_external_data(sparse.values, what)
    _no_external_data(sparse.indices, what)


# ---------------------------------------------------------------------- sizes set by request values


def _check_value_dependent_sizes(model: onnx.ModelProto) -> None:
    """Follow which tensors depend on the VALUES of the model's inputs (not only on their shapes); a
    size-setting input (``SIZE_INPUTS``) among them must be bounded (``_check_bounded``). Runs after the
    checker, which guarantees topologically sorted nodes, so one forward pass sees every producer before its
    consumers. The bounds analysis (shape inference included) runs only for a scope that needs it."""
    scopes = [("main graph", model.graph.node, {v.name for v in _real_inputs(model.graph)},
               lambda: ValueBounds.of_model(model))]
    for function in model.functions:  # conservatively: every formal input may carry request values
        scopes.append((f"function {printable(function.name)!r}", function.node, set(function.input),
                       lambda function=function: ValueBounds.of_function(function)))
    for where, nodes, tainted, analyse in scopes:
        found: list[tuple[onnx.NodeProto, list[int], str]] = []
        _taint_nodes(nodes, tainted, where, found)
        if found:
            bounds = analyse()
            for node, indices, node_where in found:
                _check_bounded(node, indices, f"node {printable(node.name or node.op_type)!r} ({node_where})",
                               bounds)


def _taint_nodes(nodes: Sequence[onnx.NodeProto], tainted: set[str], where: str,
                 found: list[tuple[onnx.NodeProto, list[int], str]]) -> None:
    """Add to ``tainted`` the outputs of ``nodes`` computed from tainted values, and to ``found`` each
    standard node with tainted size inputs. One shared set serves nested subgraphs (ONNX names are unique
    across scopes, and a shared set can only over-approximate)."""
    for node in nodes:
        standard = node.domain in ("", "ai.onnx")
        from_values = any(name in tainted for name in node.input if name)
        if standard:
            if node.op_type == "Loop" and (not node.input or not node.input[0]):
                raise InvalidModelError(f"node {printable(node.name or node.op_type)!r} ({where}): a Loop needs a "
                                        "trip count (while-loops are not accepted)")
            indices = [i for i in SIZE_INPUTS.get(node.op_type, ()) if i < len(node.input) and node.input[i] in tainted]
            if indices:
                found.append((node, indices, where))
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs):
                if from_values:
                    tainted.update(v.name for v in sub.input)
                _taint_nodes(sub.node, tainted, f"subgraph of node {printable(node.name or node.op_type)!r}", found)
                from_values = from_values or any(v.name in tainted for v in sub.output)
        if from_values and not (standard and node.op_type in _SHAPE_ONLY_OPS):
            tainted.update(name for name in node.output if name)


def _check_bounded(node: onnx.NodeProto, indices: list[int], label: str, bounds: ValueBounds) -> None:
    """Refuse unless every size that ``node`` takes from request values has a finite bound and sets at most
    ``MAX_FIXED_ELEMENTS`` elements (or loop iterations); a bound that grows with the request's shapes is
    accepted when it holds at the smallest request (the request limits bound the rest)."""
    checks = [_range_count(node, bounds)] if node.op_type == "Range" else [
        (index, *_size_count(node, index, bounds)) for index in indices]
    for index, count, why in checks:
        if why is None and count > MAX_FIXED_ELEMENTS:
            unit = "iterations" if node.op_type == "Loop" else "elements"
            why = f"is bounded only at {count:,.0f} {unit}, more than the limit of {MAX_FIXED_ELEMENTS:,}"
        if why is not None:
            raise InvalidModelError(
                f"{label}: input {index} ({_input_name(node.op_type, index)}) of {node.op_type} sets a tensor "
                f"size (or trip count) from the values of the model's inputs and {why}, so one request could "
                "exhaust the server's memory or time; bound it by constants (Clip, Min or Max) or take it from "
                "input shapes"
            )


def _size_count(node: onnx.NodeProto, index: int, bounds: ValueBounds) -> tuple[float, str | None]:
    """An upper bound on the elements (Loop: iterations) input ``index`` makes, at the smallest request;
    or why there is none."""
    value = bounds.val(node.input[index])
    if intervals.unbounded(value.whole):
        return 0.0, f"has no upper bound (traced to {value.lost or 'an unbounded value'})"
    far = [b for b in (value.elems or (value.whole,)) if b.far is not None]
    harmless = (node.op_type, index) in _DIRECT_SIZES or (node.op_type == "Loop" and all(b.far_side == -1 for b in far))
    if far and not harmless:  # (a Loop runs no iteration for INT64_MIN and the like)
        return 0.0, "a NaN or infinite request value cast to an integer could make it astronomically large or wrap"
    if node.op_type == "Loop":
        return max(value.whole.fixed_hi, 0.0), None
    items = [b.fixed_hi for b in value.elems] if value.elems is not None else None
    if items is None:
        length = _static_count(bounds.dims(node.input[index]))
        if length is None and value.whole.fixed_hi > 1:
            return 0.0, "its length is not known statically"
        items = [value.whole.fixed_hi] * int(length or 0)
    dims_only = node.op_type in ("ConstantOfShape", "Loop") or (node.op_type, index) == ("Resize", 3) or index == 0
    data = 1.0 if dims_only else float(_static_count(bounds.dims(node.input[0]), unknown=1) or 1)
    if node.op_type in ("Resize", "Upsample", "Expand", "Tile", "OneHot", "ConstantOfShape"):
        return data * math.prod(max(x, 1.0) for x in items), None
    return data * math.prod(1.0 + max(x, 0.0) for x in items), None  # Pad and the like: add to each dim


def _range_count(node: onnx.NodeProto, bounds: ValueBounds) -> tuple[int, float, str | None]:
    """Range makes ceil((limit - start) / delta) elements, (limit - start) computed in its element type:
    the input to blame, the count at the smallest request, or why there is none."""
    start, limit, delta = (bounds.val(name) for name in node.input[:3])
    if delta.whole.lo <= 0 <= delta.whole.hi:
        return 2, 0.0, "it may be 0 or arbitrarily close to it"
    for index, value in ((0, start), (1, limit)):
        if intervals.unbounded(value.whole):
            return index, 0.0, f"has no upper bound (traced to {value.lost or 'an unbounded value'})"
    span = intervals.realized(intervals.sub(limit.whole, start.whole, start.elem))
    if math.isinf(span.hi) or math.isinf(span.lo):
        return 1, 0.0, "the span from start to limit has no bound"
    d = delta.whole
    return 1, max(math.ceil(span.fixed_hi / d.fixed_lo if d.lo > 0 else span.fixed_lo / d.fixed_hi), 0), None


def _static_count(dims: list[int | None] | None, unknown: int | None = None) -> int | None:
    """The product of ``dims``; an unknown dim counts as ``unknown`` (None: the product is unknown)."""
    if dims is None or (unknown is None and None in dims):
        return unknown
    return math.prod(d if d is not None else unknown for d in dims)  # type: ignore[misc]


def _input_name(op_type: str, index: int) -> str:
    try:
        return onnx.defs.get_schema(op_type).inputs[index].name
    except (onnx.defs.SchemaError, IndexError):
        return "size"


# ---------------------------------------------------------------------- inputs and outputs


def _real_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    initializers = {t.name for t in graph.initializer} | {s.values.name for s in graph.sparse_initializer}
    return [v for v in graph.input if v.name not in initializers]


def _check_signature(graph: onnx.GraphProto) -> None:
    inputs = _real_inputs(graph)
    if not inputs:
        raise InvalidModelError("the model has no inputs")
    if not graph.output:
        raise InvalidModelError("the model has no outputs")
    for value in inputs:
        _check_tensor_value(value, "input")
        _check_input_dims(value)
    for value in graph.output:
        _check_tensor_value(value, "output")


def _check_tensor_value(value: onnx.ValueInfoProto, kind: str) -> None:
    label = f"{kind} {printable(value.name)!r}"
    if not value.name:
        raise InvalidModelError(f"an {kind} has no name")
    if not value.type.HasField("tensor_type"):
        raise InvalidModelError(f"{label} is not a tensor (sequence, map and optional types are unsupported)")
    elem = value.type.tensor_type.elem_type
    if elem not in ONNX_TO_NUMPY:
        name = TensorProto.DataType.Name(elem) if elem in TensorProto.DataType.values() else str(elem)
        raise InvalidModelError(f"{label} has unsupported element type {name}")


def _check_input_dims(value: onnx.ValueInfoProto) -> None:
    label = f"input {printable(value.name)!r}"
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        raise InvalidModelError(f"{label} has no declared shape (rank)")
    dims = tensor_type.shape.dim
    if not 1 <= len(dims) <= MAX_RANK:
        raise InvalidModelError(f"{label} has rank {len(dims)}; ranks 1-{MAX_RANK} (batch dimension first)")
    fixed = []
    for dim in dims:
        if dim.HasField("dim_value"):
            if dim.dim_value <= 0:
                raise InvalidModelError(f"{label} has a non-positive fixed dimension ({dim.dim_value})")
            fixed.append(dim.dim_value)
    if math.prod(fixed) > MAX_FIXED_ELEMENTS:
        raise InvalidModelError(f"{label} declares more than {MAX_FIXED_ELEMENTS} elements")


# ---------------------------------------------------------------------- the ONNX checker


def _run_checker(model: onnx.ModelProto) -> None:
    """onnx.checker with full (strict shape inference) checks; refuses what ONNX itself calls invalid."""
    if model.ByteSize() >= 2**31 - 1:
        raise InvalidModelError("models of 2 GiB or more would need external data, which is not accepted")
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as exc:
        text = str(exc).strip()
        first_line = text.splitlines()[0] if text else type(exc).__name__
        raise InvalidModelError(f"the ONNX checker refused the model: {first_line[:300]}") from exc
