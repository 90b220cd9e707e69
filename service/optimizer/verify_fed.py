"""The optimized model cut at its selections, to verify it where ties make detections differ as sets.

A selection (NonMaxSuppression, TopK, or an If/Loop/Scan whose body holds one) decides *which*
candidates survive by comparing their scores. Candidates whose scores are equal within the tolerance may
survive in one model and not in the other, and with them everything computed from them: an untrained
SSDLite scores every anchor of a class alike whatever the input, so 39-86 of its 300 detections differed
between the original and a correct rewrite whose scores differ by 1e-7. No comparison of the outputs alone
can tell such a tie from a wrong rewrite.

So verification then cuts the optimized model at its selections (``fed_plan``): every selection node of the
main graph is removed and its outputs become graph inputs, fed with what the *original's* selections
produced on the same inputs. What is left is compared element by element, in order: every graph output,
and every tensor a selection reads (its inputs, and for a control-flow node the outer values its body
uses). With the selections identical nodes in both models (same op, attributes, input names and body;
constant inputs equal), that shows the optimized model computes what the original computes, up to where
ties fall. Where a selection differs between the two models, or reads a tensor the optimized model does
not compute under the same name, no cut is made (``fed_plan`` returns None) and the set mismatch stands.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx.version_converter
from onnx import numpy_helper

from service.optimizer.unordered import holds_selection
from service.optimizer.verify_targets import with_outputs


@dataclasses.dataclass(frozen=True)
class FedPlan:
    """How to run one fed comparison: both models' bytes, what to feed and what to compare."""

    reference_bytes: bytes
    """The original, with the selections' outputs and the compared tensors as extra graph outputs."""
    candidate: bytes
    """The optimized model without its selection nodes, encoded (their outputs still to be declared as inputs)."""
    fed: tuple[str, ...]
    """The selections' outputs: computed by the original, fed to the cut candidate."""
    compared: tuple[tuple[str, str], ...]
    """(reference name, candidate name): the graph outputs, then every computed tensor a selection reads."""
    selections: tuple[str, ...]
    """How messages name the cut nodes: ``TopK 'topk_1'``."""

    def candidate_bytes(self, fed_values: dict[str, np.ndarray]) -> bytes:
        """The cut candidate with each fed tensor declared as a graph input of its value's dtype (appended
        to the encoding: protobuf merges repeated fields, so the weights are not copied again)."""
        inputs = [
            onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(fed_values[name].dtype), None)
            for name in self.fed
        ]
        return self.candidate + onnx.ModelProto(graph=onnx.GraphProto(input=inputs)).SerializeToString()


def fed_plan(reference: onnx.ModelProto, candidate: onnx.ModelProto) -> FedPlan | None:
    """The cut of ``candidate`` at the selections it shares with ``reference`` (``_same_selection``); None
    when some selection is not shared or reads what the candidate does not compute."""
    ref_cut = [n for n in reference.graph.node if holds_selection(n)]
    cut_at = [i for i, n in enumerate(candidate.graph.node) if holds_selection(n)]
    if not ref_cut or len(ref_cut) != len(cut_at):
        return None
    by_output = {candidate.graph.node[i].output[0]: candidate.graph.node[i] for i in cut_at}
    ref_fixed, cand_fixed = _fixed_values(reference), _fixed_values(candidate)
    read: dict[str, str] = {}  # reference name -> candidate name of every tensor a selection reads
    upgraded = _Upgraded(reference, candidate)
    for node in ref_cut:
        twin = by_output.get(node.output[0]) if node.output else None
        pairs = _same_selection(node, twin, ref_fixed, cand_fixed) if twin is not None else None
        if pairs is None and twin is not None:
            pairs = upgraded.same_selection(node, twin, cand_fixed)
        if pairs is None:
            return None
        read.update(pairs)
    fed = [name for node in ref_cut for name in node.output if name]
    graph_inputs = {i.name for i in reference.graph.input} - set(ref_fixed)
    cand_computed = {name for i, n in enumerate(candidate.graph.node) if i not in cut_at for name in n.output}
    ref_computed = {name for n in reference.graph.node for name in n.output}
    computed: list[tuple[str, str]] = []
    for ref_name, cand_name in sorted(read.items()):
        if ref_name in fed:
            if cand_name != ref_name:
                return None
        elif ref_name in ref_fixed:
            if cand_name not in cand_fixed or not np.array_equal(ref_fixed[ref_name], cand_fixed[cand_name]):
                return None
        elif ref_name in graph_inputs:
            if cand_name != ref_name:
                return None
        elif cand_name in cand_computed and ref_name in ref_computed:
            computed.append((ref_name, cand_name))
        else:
            return None
    outputs = [(o.name, o.name) for o in reference.graph.output if o.name not in fed]
    compared = outputs + [pair for pair in computed if pair not in outputs]
    output_names = {name for name, _ in outputs}
    return FedPlan(
        reference_bytes=with_outputs(reference, [n for n in fed + [r for r, _ in compared] if n not in output_names]),
        candidate=_cut(candidate, set(cut_at), [c for _, c in compared]).SerializeToString(),
        fed=tuple(fed),
        compared=tuple(compared),
        selections=tuple(f"{n.op_type} '{n.name or n.output[0]}'" for n in ref_cut),
    )


class _Upgraded:
    """The reference converted to the candidate's opset (once, on demand): the optimizer upgrades old
    opsets first, which rewrites a selection's body (opset 11's Unsqueeze ``axes`` attribute becomes an
    input at 13), so such a selection is the same as the original's converted one, not as the original's."""

    def __init__(self, reference: onnx.ModelProto, candidate: onnx.ModelProto) -> None:
        self.reference, self.target = reference, _opset(candidate)
        self.nodes: dict[str, onnx.NodeProto] | None = None
        self.fixed: dict[str, np.ndarray] = {}

    def same_selection(
        self, node: onnx.NodeProto, twin: onnx.NodeProto, cand_fixed: dict[str, np.ndarray]
    ) -> dict[str, str] | None:
        if self.target is None or _opset(self.reference) in (None, self.target) or not node.output:
            return None
        if self.nodes is None:
            try:
                converted = onnx.version_converter.convert_version(self.reference, self.target)
            except Exception:  # a model the converter cannot take: no cut
                self.nodes = {}
                return None
            self.nodes = {n.output[0]: n for n in converted.graph.node if n.output}
            self.fixed = _fixed_values(converted)
        upgraded = self.nodes.get(node.output[0])
        if upgraded is None or list(upgraded.input) != list(node.input):
            return None
        return _same_selection(upgraded, twin, self.fixed, cand_fixed)


def _opset(model: onnx.ModelProto) -> int | None:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def _same_selection(
    ref: onnx.NodeProto, cand: onnx.NodeProto, ref_fixed: dict[str, np.ndarray], cand_fixed: dict[str, np.ndarray]
) -> dict[str, str] | None:
    """Reference name -> candidate name of every outer tensor the two read, when they are the same
    selection: op, domain, outputs and plain attributes equal, bodies equal up to node order and to where
    their constants live (``_canonical``), inputs paired by position (a removed Cast before one renames
    it); else None."""
    if (ref.op_type, ref.domain, list(ref.output)) != (cand.op_type, cand.domain, list(cand.output)):
        return None
    if len(ref.input) != len(cand.input) or len(ref.attribute) != len(cand.attribute):
        return None
    for a, b in zip(ref.attribute, cand.attribute, strict=True):
        if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            same = a.name == b.name and [_canonical(g, ref_fixed) for g in _graphs(a)] == [
                _canonical(g, cand_fixed) for g in _graphs(b)
            ]
            if not same:
                return None
        elif a.SerializeToString() != b.SerializeToString():
            return None
    pairs = {r: c for r, c in zip(ref.input, cand.input, strict=True) if r or c}
    if any(not r or not c for r, c in pairs.items()):
        return None
    for graph in _bodies(ref):
        initializers = {t.name for t in graph.initializer}
        pairs.update({name: name for name in _free_names(graph) if name not in initializers})
    return pairs


def _canonical(graph: onnx.GraphProto, outer_fixed: dict[str, np.ndarray]) -> tuple:
    """A body as its inputs, outputs, sorted nodes and the value of every name it reads from outside
    (or "computed"). Passes re-sort nodes, re-encode constants (raw bytes for typed fields) and copy an
    outer constant into the body as an initializer; none of that changes the body."""
    encode = lambda items: tuple(x.SerializeToString() for x in items)  # noqa: E731
    initializers = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    reads = []
    for name in sorted(_free_names(graph)):
        value = initializers.get(name, outer_fixed.get(name))
        reads.append((name, *_value_key(value)) if value is not None else (name, "computed"))
    return encode(graph.input), encode(graph.output), tuple(sorted(map(_node_key, graph.node))), tuple(reads)


def _graphs(attribute: onnx.AttributeProto) -> list[onnx.GraphProto]:
    return [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)


def _node_key(node: onnx.NodeProto) -> tuple:
    """A node's encoding; a Constant's as its output names and value."""
    value = next((a.t for a in node.attribute if a.name == "value"), None) if node.op_type == "Constant" else None
    if value is None or len(node.attribute) != 1:
        return (b"", node.SerializeToString())
    return (b"Constant", tuple(node.output), *_value_key(numpy_helper.to_array(value)))


def _value_key(array: np.ndarray) -> tuple:
    return array.dtype.str, array.shape, array.tobytes()


def _graphs(attribute: onnx.AttributeProto) -> list[onnx.GraphProto]:
    return [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)


def _free_names(graph: onnx.GraphProto) -> set[str]:
    """Names ``graph``'s nodes (and nested bodies) read that no node or input of it defines: outer
    tensors and its own initializers."""
    defined = {i.name for i in graph.input}
    used: set[str] = set()
    for node in graph.node:
        used |= {name for name in node.input if name}
        for inner in _bodies(node):
            used |= _free_names(inner) - {t.name for t in inner.initializer}
        defined |= set(node.output)
    return used - defined


def _bodies(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [graph for attribute in node.attribute for graph in _graphs(attribute)]


def _fixed_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and Constant outputs of the main graph, by name."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            for attribute in node.attribute:
                if attribute.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attribute.t)
    return values


def _cut(model: onnx.ModelProto, removed: set[int], outputs: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` without the main-graph nodes at the ``removed`` indices, with ``outputs`` as its
    graph outputs."""
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    del cut.graph.node[:]
    cut.graph.node.extend(node for i, node in enumerate(model.graph.node) if i not in removed)
    declared = {o.name: o for o in model.graph.output}
    del cut.graph.output[:]
    cut.graph.output.extend(declared.get(name) or onnx.ValueInfoProto(name=name) for name in outputs)
    return cut
