"""Tiny ONNX graphs for the optimizer's pass tests, built with onnx.helper the way exporters write them.

Tests get the helpers through the ``kit`` fixture (no test package needed), e.g.::

    model = kit.model([kit.node("Conv", ["x", "w"], ["y"])], [kit.inp("x", [1, 3, 8, 8])], [kit.out("y")],
                      [kit.init("w", weights)])
    count, optimized = kit.apply(model, fuse_bn_into_conv)
    kit.verify(model, optimized)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.optimizer.verify import VerificationResult, verify_equivalent

FLOAT = TensorProto.FLOAT


class GraphKit:
    """Builders and checks shared by the pass tests."""

    rng = np.random.default_rng(1234)

    @staticmethod
    def inp(name: str, shape: Sequence[int | str | None], dtype: int = FLOAT) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, dtype, shape)

    @staticmethod
    def out(name: str, shape: Sequence[int | str | None], dtype: int = FLOAT) -> onnx.ValueInfoProto:
        """A graph output (ONNX's checker wants a shape; symbolic dims are fine)."""
        return helper.make_tensor_value_info(name, dtype, shape)

    @staticmethod
    def init(name: str, values) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(values), name)

    @staticmethod
    def node(
        op: str, inputs: Sequence[str], outputs: Sequence[str], domain: str | None = None, **attrs
    ) -> onnx.NodeProto:
        return helper.make_node(
            op, list(inputs), list(outputs), name=f"{op}_{outputs[0]}", domain=domain, **attrs
        )

    @staticmethod
    def const_node(name: str, values) -> onnx.NodeProto:
        """A ``Constant`` node writing ``values`` (what the TorchScript exporter emits)."""
        return helper.make_node(
            "Constant",
            [],
            [name],
            name=f"Constant_{name}",
            value=numpy_helper.from_array(np.asarray(values), name),
        )

    def weights(self, *shape: int, scale: float = 0.5) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def positive(self, *shape: int) -> np.ndarray:
        return self.rng.uniform(0.5, 1.5, shape).astype(np.float32)

    @staticmethod
    def model(
        nodes: Sequence[onnx.NodeProto],
        inputs: Sequence[onnx.ValueInfoProto],
        outputs: Sequence[onnx.ValueInfoProto],
        initializers: Sequence[onnx.TensorProto] = (),
        opset: int = 13,
        value_info: Sequence[onnx.ValueInfoProto] = (),
        domains: dict[str, int] | None = None,
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            list(nodes), "test", list(inputs), list(outputs), list(initializers), value_info=list(value_info)
        )
        opsets = [helper.make_opsetid("", opset)]
        opsets += [helper.make_opsetid(domain, version) for domain, version in (domains or {}).items()]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model

    @staticmethod
    def apply(model: onnx.ModelProto, fn: Callable[[gs.Graph], int]) -> tuple[int, onnx.ModelProto]:
        """Run one pass the way the pipeline does (cleanup + toposort after rewrites); check the result."""
        graph = gs.import_onnx(model)
        count = fn(graph)
        if count:
            graph.cleanup(remove_unused_graph_inputs=False).toposort()
        optimized = gs.export_onnx(graph, do_type_check=True)
        optimized.ir_version = model.ir_version
        onnx.checker.check_model(optimized, full_check=True)
        return count, optimized

    @staticmethod
    def ops(model: onnx.ModelProto) -> list[str]:
        return [node.op_type for node in model.graph.node]

    @staticmethod
    def op_counts(model: onnx.ModelProto) -> Counter:
        return Counter(node.op_type for node in model.graph.node)

    @staticmethod
    def verify(reference: onnx.ModelProto, candidate: onnx.ModelProto, **kwargs) -> VerificationResult:
        return verify_equivalent(reference, candidate, **kwargs)


@pytest.fixture
def kit() -> GraphKit:
    return GraphKit()
