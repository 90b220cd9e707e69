"""What verification compares: the graph outputs, plus the tensors that feed each NonMaxSuppression/TopK.

The inputs of a selection op (NMS boxes and scores, TopK's data) are verified element by element
because the selection's result is compared only as a set, and may be empty: with untrained weights a
detector's NMS often selects nothing, and then only its inputs show whether the rewrite is right. They
are added as extra outputs of the *serialized verification copies* only (an encoded list of extra graph
outputs appended to the model's encoding: protobuf merges repeated fields of concatenated messages), so
neither model object is changed and no copy of the weights is made.

The optimized model may read a selection's inputs under other names (a removed Cast or Identity before
it), so selections are paired by the name of their first output (which no pass renames), and the rest in
graph order when both models have as many of that op. A selection input that is a graph input, a constant
or already a graph output is not added.
"""

from __future__ import annotations

import dataclasses

import onnx

from service.optimizer.unordered import Selection, Unordered, has_selection, selections, unordered_tensors


@dataclasses.dataclass(frozen=True)
class Target:
    label: str
    """How messages name it: ``output 'boxes'`` or ``'b' (the boxes input of NonMaxSuppression 'nms')``."""
    key: str
    """The name the result reports it under: the output name, or the original's tensor name."""
    reference: str
    candidate: str
    unordered: Unordered | None
    """Set when the order of its detections is not part of the function (see ``service.optimizer.unordered``)."""
    is_output: bool = True
    """A graph output of the original (else a selection input added for verification)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    targets: tuple[Target, ...]
    reference_bytes: bytes
    candidate_bytes: bytes
    has_selection: bool
    sources: dict[int, str] = dataclasses.field(default_factory=dict)
    """How messages name the selection node with each index in ``Unordered.sources``: ``TopK 'topk_1'``."""

    @property
    def outputs(self) -> list[str]:
        return [t.reference for t in self.targets if t.is_output]


def plan(reference: onnx.ModelProto, candidate: onnx.ModelProto) -> Plan:
    outputs = [o.name for o in reference.graph.output]
    if not has_selection(reference):
        targets = tuple(Target(f"output '{n}'", n, n, n, None) for n in outputs)
        return Plan(targets, reference.SerializeToString(), candidate.SerializeToString(), False)
    taint = unordered_tensors(reference)
    targets = [Target(f"output '{n}'", n, n, n, taint.get(n)) for n in outputs]
    ref_fixed, cand_fixed = _not_computed(reference), _not_computed(candidate)
    seen = set(outputs)
    for ref_sel, cand_sel in _pairs(selections(reference), selections(candidate)):
        for (role, ref_name), (_, cand_name) in zip(ref_sel.inputs, cand_sel.inputs, strict=False):
            if ref_name in seen or ref_name in ref_fixed or cand_name in cand_fixed:
                continue
            seen.add(ref_name)
            label = f"'{ref_name}' (the {role} input of {ref_sel.op} '{ref_sel.name or ref_sel.output}')"
            targets.append(Target(label, ref_name, ref_name, cand_name, taint.get(ref_name), is_output=False))
    extras = targets[len(outputs) :]
    nodes = reference.graph.node
    sources = {i: f"{nodes[i].op_type} '{nodes[i].name or nodes[i].output[0]}'" for t in targets if t.unordered
               for i in t.unordered.sources}  # fmt: skip
    return Plan(
        tuple(targets),
        with_outputs(reference, [t.reference for t in extras]),
        with_outputs(candidate, [t.candidate for t in extras]),
        True,
        sources,
    )


def _pairs(reference: list[Selection], candidate: list[Selection]) -> list[tuple[Selection, Selection]]:
    by_output = {s.output: s for s in candidate if s.output}
    pairs, left_ref = [], []
    for sel in reference:
        match = by_output.pop(sel.output, None) if sel.output else None
        if match is not None and match.op == sel.op:
            pairs.append((sel, match))
        else:
            left_ref.append(sel)
    left_cand = [s for s in candidate if s.output in by_output or not s.output]
    for op in {s.op for s in left_ref}:
        ref_op = [s for s in left_ref if s.op == op]
        cand_op = [s for s in left_cand if s.op == op]
        if len(ref_op) == len(cand_op):
            pairs.extend(zip(ref_op, cand_op, strict=True))
    return pairs


def _not_computed(model: onnx.ModelProto) -> set[str]:
    """Names whose value no node of the main graph computes, or that are compared anyway: graph inputs,
    initializers, Constant outputs and graph outputs."""
    graph = model.graph
    names = {t.name for t in graph.initializer} | {i.name for i in graph.input} | {o.name for o in graph.output}
    names |= {n.output[0] for n in graph.node if n.op_type == "Constant" and n.output}
    return names


def with_outputs(model: onnx.ModelProto, names: list[str]) -> bytes:
    """``model``'s encoding with ``names`` appended as extra (untyped) graph outputs."""
    data = model.SerializeToString()
    if not names:
        return data
    extra = onnx.ModelProto(graph=onnx.GraphProto(output=[onnx.ValueInfoProto(name=n) for n in names]))
    return data + extra.SerializeToString()
