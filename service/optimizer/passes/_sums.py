"""Sums of several branches: a tree of ``Add`` nodes read as one n-ary sum, whose terms may be regrouped.

Why: a re-parameterizable block (RepVGG, MobileOne) sums its branches with a chain of binary Adds whose
order and nesting depend on the exporter and the model's code (``(conv_1x1 + conv_kxk) + bn``,
``((scale + k_0) + k_1) + bn``...). Addition is associative and commutative, so two terms of the same
tree can be combined wherever they sit in it.

A tree is rooted at an Add; an operand written by another Add belongs to the tree when only that
operand's Add reads it, once, and it is no graph output. Every other operand is a *term*. ``drop_term``
removes a term whose value another term has taken over: its Add then passes its other operand through.
The tree's output keeps its shape as long as a term of the dropped one's shape stays in the tree, which
both callers guarantee (the dropped term's value was folded into such a term).
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from service.optimizer.passes._match import (
    DEFAULT_DOMAINS,
    bypass,
    can_pass_through,
    is_graph_output,
    is_live,
    other_input,
    producer,
    single_consumer,
)


def is_add(node: gs.Node | None) -> bool:
    """A live binary Add of the standard domain."""
    return (
        node is not None
        and node.op == "Add"
        and node.domain in DEFAULT_DOMAINS
        and len(node.inputs) == 2
        and len(node.outputs) == 1
        and is_live(node)
    )


def summing_add(graph: gs.Graph, tensor: gs.Tensor) -> gs.Node | None:
    """The Add that is ``tensor``'s only reader and reads it once (``tensor`` no graph output), else None."""
    add = single_consumer(tensor)
    if not is_add(add) or is_graph_output(graph, tensor) or other_input(add, tensor) is None:
        return None
    return add


def is_sum_root(graph: gs.Graph, node: gs.Node) -> bool:
    """An Add that is not itself an inner node of a larger tree."""
    return is_add(node) and not is_add(summing_add(graph, node.outputs[0]))


def sum_terms(graph: gs.Graph, root: gs.Node) -> list[gs.Tensor]:
    """The terms of the tree rooted at ``root``, left to right."""
    terms: list[gs.Tensor] = []
    pending = list(reversed(root.inputs))
    while pending:
        tensor = pending.pop()
        inner = producer(tensor)
        if is_add(inner) and summing_add(graph, tensor) is not None:
            pending.extend(reversed(inner.inputs))
        else:
            terms.append(tensor)
    return terms


def private_term(graph: gs.Graph, tensor: gs.Tensor) -> gs.Node | None:
    """The node writing ``tensor`` when nothing but one Add of the tree reads it (once), else None."""
    node = producer(tensor)
    if node is None or summing_add(graph, tensor) is None or len(node.outputs) != 1:
        return None
    return node


def can_drop_term(graph: gs.Graph, term: gs.Tensor) -> bool:
    """True when ``drop_term`` can remove ``term`` (its Add's output keeps its name)."""
    add = summing_add(graph, term)
    return add is not None and can_pass_through(graph, other_input(add, term), add.outputs[0])


def drop_term(graph: gs.Graph, root: gs.Node, term: gs.Tensor) -> None:
    """Remove ``term`` from the tree rooted at ``root`` (check ``can_drop_term`` first).

    The Adds between the dropped term and the root forget their output shapes: a term that broadcast an
    inner sum up no longer does, and only the root's shape is known to stay.
    """
    add = summing_add(graph, term)
    add.inputs.pop(next(i for i, t in enumerate(add.inputs) if t is term))
    source = add.inputs[0]
    bypass(add, graph)
    _forget_inner_shapes(graph, root, source)


def _forget_inner_shapes(graph: gs.Graph, root: gs.Node, tensor: gs.Tensor) -> None:
    add = summing_add(graph, tensor)
    while add is not None and add is not root:
        add.outputs[0].shape = None
        add = summing_add(graph, add.outputs[0])
