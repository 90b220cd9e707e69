"""The graph builder the zoo models are written with, and the calibration of their BatchNormalization
statistics (one ONNX Runtime run on a seeded random batch, so every BN output is standardised)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MIN_OPSET = 9
MAX_OPSET = 17
DEFAULT_OPSET = 11
NATIVE_MIN_OPSET = 14
MAX_IR_VERSION = 8  # ONNX Runtime 1.31 reads up to 13; 8 covers opset 17 and keeps old readers happy
INPUT_NAME = "input"
OUTPUT_NAME = "output"
BATCH_DIM = "batch"
IMAGE_SIZE = 224
NUM_CLASSES = 1000
CALIBRATION_BATCH = 2
_STAT_MANTISSA_BITS = 12  # running stats are rounded so float noise in calibration does not leak out


# --------------------------------------------------------------------------------------------------
# Graph builder
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _BatchNormRecord:
    """Where a BatchNormalization reads its input and running stats, for the calibration pass."""

    node_index: int
    x: str
    mean_param: str
    var_param: str


class GraphBuilder:
    """Accumulates nodes, initializers and Constant nodes, named the way the TorchScript exporter did.

    Intermediate tensors get numeric names (``"17"``), nodes ``<Op>_<n>``, weights their torchvision
    ``state_dict`` names. Weights stay numpy arrays until ``to_model`` so that calibration can rewrite
    the BatchNormalization statistics in place.
    """

    def __init__(self, opset: int, rng: np.random.Generator, *, native_activations: bool = False) -> None:
        self.opset = opset
        self.rng = rng
        self.native_activations = native_activations
        self.nodes: list[onnx.NodeProto] = []
        self.params: dict[str, np.ndarray] = {}
        self.batch_norms: list[_BatchNormRecord] = []
        self._next_tensor = 0
        self._fresh_seen: set[tuple[str, tuple[int, ...]]] = set()

    def tensor(self) -> str:
        """A fresh intermediate tensor name."""
        name = str(self._next_tensor)
        self._next_tensor += 1
        return name

    def node(self, op: str, inputs: Sequence[str], *, output: str | None = None, **attrs: object) -> str:
        """Append one single-output node; return its output name."""
        out = output or self.tensor()
        name = f"{op}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out

    def constant(self, value: float) -> str:
        """A 0-d float ``Constant`` node: the tracer emitted one per use of a Python scalar."""
        tensor = numpy_helper.from_array(np.array(value, dtype=np.float32), name="")
        return self.node("Constant", [], value=tensor)

    def param(self, name: str, value: np.ndarray, *, fresh_init: str | None = None) -> str:
        """Add a weight; return the tensor name its consumer reads.

        Imitates the exporter's initializer deduplication: it kept one copy of byte-identical
        parameters and fed every later user through an ``Identity`` node. In a freshly initialised
        torchvision model (the real export docs/benchmarks.md counts) BN weights/running_var are ``ones(C)`` and BN
        biases/running_mean and MobileNetV3's conv/linear biases are ``zeros(C)``, so most of them
        were duplicates. Our values are random, so ``fresh_init`` ("ones"/"zeros") names the value
        torchvision would have initialised the tensor to, and we emit the ``Identity`` exactly where
        that export had one (168 in mobilenet_v3_large, as in the real 549-node export); the Identity
        reads this tensor's own initializer, so the function is unchanged.
        """
        if name in self.params:
            raise ValueError(f"duplicate parameter name {name!r}")
        self.params[name] = np.ascontiguousarray(value, dtype=np.float32)
        if fresh_init is None:
            return name
        key = (fresh_init, tuple(value.shape))
        if key not in self._fresh_seen:
            self._fresh_seen.add(key)
            return name
        return self.node("Identity", [name])

    def record_batch_norm(self, x: str, mean_param: str, var_param: str) -> None:
        """Remember the BatchNormalization just appended, for ``calibrate``."""
        self.batch_norms.append(_BatchNormRecord(len(self.nodes) - 1, x, mean_param, var_param))

    def to_model(self, *, graph_name: str, calibration: bool = False) -> onnx.ModelProto:
        """Assemble the ModelProto. ``calibration=True`` makes every BN normalise with the batch's own
        statistics and exposes them as outputs ``<running stat>.calibrated`` (see ``calibrate``)."""
        nodes = _calibration_nodes(self) if calibration else list(self.nodes)
        outputs = [_image_output()]
        if calibration:
            for bn in self.batch_norms:
                outputs += [_stat_output(_calibrated(bn.mean_param)), _stat_output(_calibrated(bn.var_param))]
        initializers = [numpy_helper.from_array(v, name=k) for k, v in self.params.items()]
        graph = helper.make_graph(nodes, graph_name, [_image_input()], outputs, initializer=initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", self.opset)],
            producer_name="service.zoo",
            producer_version="1",
            doc_string="Seeded-weight imitation of a 2019 TorchScript export of a torchvision model.",
        )
        model.ir_version = ir_version_for(self.opset)
        return model


def ir_version_for(opset: int) -> int:
    """The smallest IR version onnx.checker accepts for ``opset``, never above MAX_IR_VERSION."""
    return min(helper.find_min_ir_version_for([helper.make_opsetid("", opset)]), MAX_IR_VERSION)


def _image_input() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(
        INPUT_NAME, TensorProto.FLOAT, [BATCH_DIM, 3, IMAGE_SIZE, IMAGE_SIZE]
    )


def _image_output() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, [BATCH_DIM, NUM_CLASSES])


def _stat_output(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs the intermediate tensors ``names`` (for probing
    activations in tests and when debugging a pass)."""
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    known = {o.name for o in probed.graph.output}
    probed.graph.output.extend(
        helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n not in known
    )
    return probed


# --------------------------------------------------------------------------------------------------
# Calibration of the BatchNormalization running statistics
# --------------------------------------------------------------------------------------------------


def _calibration_nodes(g: GraphBuilder) -> list[onnx.NodeProto]:
    """The node list with each BN fed by its input's per-channel batch mean/variance (ReduceMean)."""
    by_index = {bn.node_index: bn for bn in g.batch_norms}
    nodes: list[onnx.NodeProto] = []
    axes = [0, 2, 3]
    for i, node in enumerate(g.nodes):
        bn = by_index.get(i)
        if bn is None:
            nodes.append(node)
            continue
        mean, var = _calibrated(bn.mean_param), _calibrated(bn.var_param)
        keep_mean, diff, square = f"{mean}.keep", f"{bn.x}.centred", f"{bn.x}.square"
        nodes += [
            helper.make_node("ReduceMean", [bn.x], [mean], axes=axes, keepdims=0),
            helper.make_node("ReduceMean", [bn.x], [keep_mean], axes=axes, keepdims=1),
            helper.make_node("Sub", [bn.x, keep_mean], [diff]),
            helper.make_node("Mul", [diff, diff], [square]),
            helper.make_node("ReduceMean", [square], [var], axes=axes, keepdims=0),
        ]
        calibrated = onnx.NodeProto()
        calibrated.CopyFrom(node)
        calibrated.input[3], calibrated.input[4] = mean, var
        nodes.append(calibrated)
    return nodes


def _calibrated(param: str) -> str:
    """The calibration graph's tensor holding the measured value of running-stat ``param``."""
    return f"{param}.calibrated"


def _round_mantissa(values: np.ndarray, bits: int = _STAT_MANTISSA_BITS) -> np.ndarray:
    """Round to ``bits`` mantissa bits so last-bit float noise in calibration does not change the file."""
    mantissa, exponent = np.frexp(values.astype(np.float64))
    rounded = np.ldexp(np.round(mantissa * (1 << bits)) / (1 << bits), exponent)
    return rounded.astype(np.float32)


def calibrate(g: GraphBuilder, seed: int, graph_name: str) -> None:
    """Set every BN's running mean/var to the statistics of its input on a seeded random batch.

    One ONNX Runtime run of the calibration graph (each BN normalising with its batch statistics)
    gives the statistics of every BN consistently through the depth, so the final graph's BN outputs
    are standardised on inputs like the calibration batch (``N(0, 1)`` pixels, as normalised images).
    """
    import onnxruntime as ort

    model = g.to_model(graph_name=graph_name, calibration=True)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng([seed, 0xCA1])
    x = rng.standard_normal((CALIBRATION_BATCH, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    params = [p for bn in g.batch_norms for p in (bn.mean_param, bn.var_param)]
    values = session.run([_calibrated(p) for p in params], {INPUT_NAME: x})
    for param, value in zip(params, values, strict=True):
        g.params[param] = _round_mantissa(value)


