"""The pass registry and the fixed-point driver.

A pass is ``fn(graph: gs.Graph) -> int`` returning how many rewrites it made. Passes never call
``cleanup()`` or ``toposort()``: the pipeline does, after every pass that rewrote something. The whole
list is repeated until an iteration makes no rewrite (or ``max_iterations`` is reached).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import onnx_graphsurgeon as gs

from service.optimizer.passes.constants_to_initializers import constants_to_initializers
from service.optimizer.passes.eliminate_identity import eliminate_identity
from service.optimizer.passes.eliminate_noop_cast import eliminate_noop_cast
from service.optimizer.passes.eliminate_noop_reshape import eliminate_noop_reshape
from service.optimizer.passes.fold_constants import fold_constants
from service.optimizer.passes.fuse_bn_into_concat_convs import fuse_bn_into_concat_convs
from service.optimizer.passes.fuse_bn_into_conv import fuse_bn_into_conv
from service.optimizer.passes.fuse_bn_into_gemm import fuse_bn_into_gemm
from service.optimizer.passes.fuse_bn_into_next_conv import fuse_bn_into_next_conv
from service.optimizer.passes.fuse_conv_add_relu_into_fusedconv import fuse_conv_add_relu_into_fusedconv
from service.optimizer.passes.fuse_conv_relu_into_fusedconv import fuse_conv_relu_into_fusedconv
from service.optimizer.passes.fuse_dwconv_act_into_fused_op import fuse_dwconv_act_into_fused_op
from service.optimizer.passes.fuse_elementwise_into_conv import fuse_elementwise_into_conv
from service.optimizer.passes.fuse_hardsigmoid import fuse_hardsigmoid
from service.optimizer.passes.fuse_hardswish import fuse_hardswish
from service.optimizer.passes.fuse_identity_bn_into_conv import fuse_identity_bn_into_conv
from service.optimizer.passes.fuse_matmul_add_into_gemm import fuse_matmul_add_into_gemm
from service.optimizer.passes.fuse_mul_hardsigmoid_into_hardswish import fuse_mul_hardsigmoid_into_hardswish
from service.optimizer.passes.fuse_parallel_convs_into_conv import fuse_parallel_convs_into_conv
from service.optimizer.passes.fuse_se_block_into_fused_op import fuse_se_block_into_fused_op
from service.optimizer.passes.sink_conv_bias import sink_conv_bias

if TYPE_CHECKING:
    from service.optimizer.report import PassStat

Pass = Callable[[gs.Graph], int]


class PipelineConfig(Protocol):
    """What the pipeline reads of ``service.optimizer.OptimizerConfig``."""

    @property
    def fused_conv(self) -> bool: ...

    @property
    def max_iterations(self) -> int: ...


def _always(_config: PipelineConfig) -> bool:
    return True


def _fused_conv_enabled(config: PipelineConfig) -> bool:
    return config.fused_conv


FUSED_CONV_OFF = "fused_conv is off (no com.microsoft.FusedConv)"


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """``disabled``: why the pass does not run when ``enabled`` says no (the report shows it)."""

    name: str
    run: Pass
    enabled: Callable[[PipelineConfig], bool] = _always
    disabled: str = ""


def _spec(fn: Pass, enabled: Callable[[PipelineConfig], bool] = _always, disabled: str = "") -> PassSpec:
    return PassSpec(fn.__name__, fn, enabled, disabled)


# Explicit order: clean up first, then fold normalisation into convolutions: a BN goes into the conv (or
# the Concat of convs) that writes it, else into a Gemm, and only then into the conv that reads it (that
# fold needs an unpadded reader, the backward ones need nothing, so a BN between two convs always goes
# backwards). Then the re-parameterizable blocks (RepVGG, MobileOne): their branch BNs are in their convs
# by now, so an identity-branch BN goes into a conv it is summed with, then the summed convs into one
# (identity first: the merge then finds convs only); both before any other pass takes the branches' Add
# (FusedConv would make one branch the residual of another). Then the activation fusions, then constants
# into convolutions (after the activations: it would otherwise fold the ``+ 3`` / ``/ 6`` of a hard-sigmoid
# that follows a conv into the conv and leave an unmatchable Clip), then conv biases that only other convs
# read move into those (after every fold into a conv's bias), and FusedConv last (it consumes the Relu/Add
# that the earlier passes leave).
DEFAULT_PIPELINE: tuple[PassSpec, ...] = (
    _spec(constants_to_initializers),
    _spec(eliminate_identity),
    _spec(eliminate_noop_cast),
    _spec(eliminate_noop_reshape),
    _spec(fold_constants),
    _spec(fuse_bn_into_conv),
    _spec(fuse_bn_into_concat_convs),
    _spec(fuse_bn_into_gemm),
    _spec(fuse_bn_into_next_conv),
    _spec(fuse_identity_bn_into_conv),
    _spec(fuse_parallel_convs_into_conv),
    _spec(fuse_matmul_add_into_gemm),
    _spec(fuse_hardsigmoid),
    _spec(fuse_hardswish),
    _spec(fuse_mul_hardsigmoid_into_hardswish),
    _spec(fuse_elementwise_into_conv),
    _spec(sink_conv_bias),
    _spec(fuse_conv_add_relu_into_fusedconv, _fused_conv_enabled, FUSED_CONV_OFF),
    _spec(fuse_conv_relu_into_fusedconv, _fused_conv_enabled, FUSED_CONV_OFF),
)

# The ai.onnxcnn custom operators (kernels/): only for a session that registers that library on the CUDA
# provider, so never part of DEFAULT_PIPELINE; service.optimizer.fused_ops.apply_fused_ops runs them on a
# graph the default pipeline already optimized (they match the HardSwish/HardSigmoid it writes, and
# FusedConv(Relu) where it made those). SE blocks first: their input is a depthwise conv's output, which
# the second pass then fuses with that conv either way.
FUSED_OPS_PIPELINE: tuple[PassSpec, ...] = (
    _spec(fuse_se_block_into_fused_op),
    _spec(fuse_dwconv_act_into_fused_op),
)


def run_once(graph: gs.Graph, name: str, run: Pass) -> PassStat:
    """Run one rewrite a single time, with the pipeline's cleanup and toposort after it.

    For a rewrite that is not a fixed-point pass (it changes the graph's signature, so running it again
    would apply it twice): the input normalisation fold."""
    from service.optimizer.report import PassStat

    before = len(graph.nodes)
    rewrites = run(graph)
    if rewrites:
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return PassStat(name, rewrites, before, len(graph.nodes))


def run_pipeline(
    graph: gs.Graph,
    config: PipelineConfig,
    passes: Sequence[PassSpec] = DEFAULT_PIPELINE,
) -> tuple[int, list[PassStat]]:
    """Run ``passes`` to a fixed point. Returns (iterations, per-pass stats summed over iterations, in
    ``passes`` order; a disabled pass's stat says why it was skipped)."""
    from service.optimizer.report import PassStat

    active = [p for p in passes if p.enabled(config)]
    stats = {p.name: PassStat(p.name) if p in active else PassStat(p.name, skipped=p.disabled or "disabled")
             for p in passes}
    iterations = 0
    while iterations < config.max_iterations:
        iterations += 1
        changed = 0
        for spec in active:
            stat, before = stats[spec.name], len(graph.nodes)
            rewrites = spec.run(graph)
            if rewrites:
                graph.cleanup(remove_unused_graph_inputs=False).toposort()
            if stat.nodes_before is None or (rewrites and not stat.rewrites):  # its first run, its first rewrite
                stat.nodes_before = before
            if rewrites or stat.nodes_after is None:
                stat.nodes_after = len(graph.nodes)
            stat.rewrites += rewrites
            changed += rewrites
        if not changed:
            break
    return iterations, list(stats.values())
