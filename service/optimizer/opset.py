"""Raising a model's default-domain opset so that the hard-swish fusion can write ``HardSwish``.

``HardSwish`` exists from opset 14. TorchScript exports at opset 9-13 are common, so without an upgrade
every hard-swish could only become ``x * HardSigmoid(x)`` (two nodes instead of one). The upgrade goes
through ONNX's version converter, which has adapters for the ops CNNs use. It is attempted only when
the graph holds something a hard-swish/hard-sigmoid fusion could use, and any failure (an op without
an adapter, a converted model the checker refuses) keeps the original model: the upgrade is an
opportunity, never a requirement. The optimizer verifies the final model numerically against the
original, so a converter that changed semantics would still be caught.
"""

from __future__ import annotations

import logging

import onnx
from onnx import version_converter

log = logging.getLogger(__name__)

HARDSWISH_OPSET = 14
"""The first opset of the default domain that has ``HardSwish``."""

MAX_IR_VERSION = 10
"""ONNX Runtime 1.2x-1.3x reads IR versions up to 10-13: never write a newer one than needed."""

# Every hard-sigmoid/hard-swish form holds one of these: relu6 and clamp(0, 1) are a Clip or a Min
# (Min(Max(.)), Relu -> Min), PyTorch's own hardswish below opset 14 is HardSigmoid + Mul.
_CANDIDATE_OPS = frozenset({"Clip", "Min", "HardSigmoid"})
_DEFAULT_DOMAINS = ("", "ai.onnx")


def default_opset(model: onnx.ModelProto) -> int:
    """The version of the default (``ai.onnx``) domain the model imports; 0 when it imports none."""
    for opset in model.opset_import:
        if opset.domain in _DEFAULT_DOMAINS:
            return int(opset.version)
    return 0


def has_hard_activation_candidate(model: onnx.ModelProto) -> bool:
    """True when some main-graph node could belong to a hard-sigmoid or hard-swish pattern."""
    return any(
        node.op_type in _CANDIDATE_OPS and node.domain in _DEFAULT_DOMAINS for node in model.graph.node
    )


def upgrade_opset(model: onnx.ModelProto, target: int = HARDSWISH_OPSET) -> onnx.ModelProto:
    """Return ``model`` converted to default-domain opset ``target``, or ``model`` itself when that is
    unnecessary (already there, nothing to fuse) or fails. Never modifies ``model``."""
    current = default_opset(model)
    if current == 0 or current >= target or not has_hard_activation_candidate(model):
        return model
    try:
        converted = version_converter.convert_version(model, target)
        converted.ir_version = _ir_version_for(converted, floor=model.ir_version)
        onnx.checker.check_model(converted)
    except Exception as exc:  # the converter raises bare RuntimeErrors and more: keep the original
        log.info("opset %d -> %d not possible, model kept as is: %s", current, target, _first_line(exc))
        return model
    if default_opset(converted) != target or len(converted.graph.output) != len(model.graph.output):
        log.info("opset converter returned an unexpected model, keeping the original")
        return model
    return converted


def _ir_version_for(model: onnx.ModelProto, floor: int) -> int:
    """At least what the opsets require and what the model had, at most MAX_IR_VERSION (when allowed)."""
    required = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    return max(required, min(max(floor, required), MAX_IR_VERSION))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
