"""Real PyTorch exports through the full optimizer: every hard-swish / hard-sigmoid spelling is fused.

A small MobileNetV3-style network (conv + BN + activation, depthwise convs, squeeze-excite, residuals)
uses a different hand-written activation in every place, plus PyTorch's own ``nn.Hardswish`` and
``nn.Hardsigmoid``. It is exported with the TorchScript exporter at opsets 9-17 (with and without
BatchNormalization kept) and with the dynamo exporter, then run through ``optimize`` (which checks
and verifies the result numerically against the export). Skipped where torch is not installed.
"""

from __future__ import annotations

import io
import warnings
from collections import Counter

import onnx
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from service.optimizer import OptimizerConfig, optimize  # noqa: E402

# --- activations, written the ways people write them ----------------------------------------------


def hswish_relu6_div(x):
    return x * F.relu6(x + 3) / 6


def hswish_hardtanh_div(x):
    return x * F.hardtanh(x + 3, 0.0, 6.0) / 6


def hswish_clamp_div(x):
    return x * (x + 3).clamp(0, 6) / 6


def hswish_relu6_mul(x):
    return x * F.relu6(x + 3) * (1 / 6)


def hswish_scale_on_x(x):
    return x / 6 * F.relu6(x + 3)


def hsigmoid_relu6_div(x):
    return F.relu6(x + 3) / 6


def hswish_times_hsigmoid(x):
    return x * hsigmoid_relu6_div(x)


def hsigmoid_clamp(x):
    return (x / 6 + 0.5).clamp(0, 1)


def hswish_times_clamp(x):
    return x * hsigmoid_clamp(x)


class Act(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


HSWISH = {
    "relu6_div": lambda: Act(hswish_relu6_div),
    "hardtanh_div": lambda: Act(hswish_hardtanh_div),
    "clamp_div": lambda: Act(hswish_clamp_div),
    "relu6_mul": lambda: Act(hswish_relu6_mul),
    "scale_on_x": lambda: Act(hswish_scale_on_x),
    "times_hsigmoid": lambda: Act(hswish_times_hsigmoid),
    "times_clamp": lambda: Act(hswish_times_clamp),
    "native": nn.Hardswish,
}
HSIGMOID = {
    "relu6_div": lambda: Act(hsigmoid_relu6_div),
    "clamp": lambda: Act(hsigmoid_clamp),
    "native": nn.Hardsigmoid,
}


# --- the network ------------------------------------------------------------------------------------


def conv_bn(cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)
    )


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, gate: str) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, channels // 2, 1)
        self.expand = nn.Conv2d(channels // 2, channels, 1)
        self.gate = HSIGMOID[gate]()

    def forward(self, x):
        return x * self.gate(self.expand(F.relu(self.reduce(self.pool(x)))))


class Block(nn.Module):
    """Inverted residual: expand 1x1 -> act -> depthwise 3x3 -> act -> SE -> project 1x1 (+ x)."""

    def __init__(
        self, cin: int, hidden: int, cout: int, stride: int, acts: tuple[str, str], gate: str | None
    ):
        super().__init__()
        self.expand = nn.Sequential(conv_bn(cin, hidden), HSWISH[acts[0]]())
        self.depthwise = nn.Sequential(conv_bn(hidden, hidden, 3, stride, groups=hidden), HSWISH[acts[1]]())
        self.se = SqueezeExcite(hidden, gate) if gate else nn.Identity()
        self.project = conv_bn(hidden, cout)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


# (cin, hidden, cout, stride, (expand act, depthwise act), SE gate)
BLOCKS = [
    (8, 16, 8, 1, ("relu6_div", "hardtanh_div"), "relu6_div"),
    (8, 24, 12, 2, ("clamp_div", "relu6_mul"), "clamp"),
    (12, 24, 12, 1, ("times_hsigmoid", "times_clamp"), "native"),
    (12, 32, 16, 2, ("native", "relu6_div"), None),
    (16, 32, 16, 1, ("hardtanh_div", "scale_on_x"), "relu6_div"),
]


class BasicBlock(nn.Module):
    """ResNet's block: relu(bn(conv(relu(bn(conv(x))))) + x), for the FusedConv passes (Relu and Z + Relu)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.first = conv_bn(channels, channels, 3)
        self.second = conv_bn(channels, channels, 3)

    def forward(self, x):
        return F.relu(self.second(F.relu(self.first(x))) + x)


class TinyMobileNetV3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 8, 3, 2), HSWISH["relu6_div"]())
        self.blocks = nn.Sequential(*(Block(*spec) for spec in BLOCKS), BasicBlock(16))
        self.head = nn.Sequential(conv_bn(16, 32), HSWISH["times_hsigmoid"]())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(32, 24), nn.Hardswish(), nn.Linear(24, 10))

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.head(self.blocks(self.stem(x)))), 1))


HARDSWISH_USED = ["relu6_div", *(act for spec in BLOCKS for act in spec[4]), "times_hsigmoid", "native"]
HARDSIGMOID_USED = [spec[5] for spec in BLOCKS if spec[5]]
N_HARDSWISH = len(HARDSWISH_USED)  # stem, two per block, head, classifier
N_HARDSIGMOID = len(HARDSIGMOID_USED)
# Conv + Relu in every SE block and the basic block's first conv; Conv + Add + Relu in the basic block.
N_FUSEDCONV = sum(1 for spec in BLOCKS if spec[5]) + 2
# Each hand-written activation exports exactly one Clip (relu6, hardtanh and clamp all become Clip).
N_HANDWRITTEN = sum(1 for name in HARDSWISH_USED + HARDSIGMOID_USED if name != "native")
DECOMPOSED = ("Clip", "Div", "Min", "Max", "BatchNormalization")


@pytest.fixture(scope="module")
def network():
    torch.manual_seed(0)
    model = TinyMobileNetV3().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):  # activations of a few units: the clamp corners at -3/3 are hit
                module.weight.mul_(3.0)
            if isinstance(module, nn.BatchNorm2d):  # statistics away from the identity: folding them shows
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model


def _export_torchscript(network, opset: int, keep_bn: bool) -> onnx.ModelProto:
    buffer = io.BytesIO()
    training = torch.onnx.TrainingMode.PRESERVE if keep_bn else torch.onnx.TrainingMode.EVAL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            network,
            (torch.randn(1, 3, 32, 32),),
            buffer,
            dynamo=False,
            opset_version=opset,
            training=training,
            do_constant_folding=True,
            input_names=["image"],
            output_names=["logits"],
            dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
        )
    return onnx.load_from_string(buffer.getvalue())


def _check(original: onnx.ModelProto) -> Counter:
    assert Counter(node.op_type for node in original.graph.node)["Clip"] == N_HANDWRITTEN  # really decomposed
    optimized, report = optimize(original, OptimizerConfig(verify_batch_sizes=(1, 3)))
    onnx.checker.check_model(optimized, full_check=True)
    assert report.verified
    ops = Counter(node.op_type for node in optimized.graph.node)
    leftovers = {op: ops[op] for op in DECOMPOSED if ops[op]}
    assert not leftovers, f"not fused: {leftovers}\n{report.summary()}"
    assert ops["HardSwish"] == N_HARDSWISH, report.summary()
    assert ops["HardSigmoid"] == N_HARDSIGMOID, report.summary()
    assert ops["FusedConv"] == N_FUSEDCONV, report.summary()
    assert ops["Relu"] == 0, report.summary()
    residual = [n for n in optimized.graph.node if n.op_type == "FusedConv" and len(n.input) == 4]
    assert len(residual) == 1, report.summary()
    return ops


@pytest.mark.parametrize(("opset", "keep_bn"), [(9, False), (11, True), (13, False), (14, True), (17, True)])
def test_torchscript_export_is_fully_fused(network, opset, keep_bn):
    original = _export_torchscript(network, opset, keep_bn)
    ops_before = Counter(node.op_type for node in original.graph.node)
    assert (ops_before["BatchNormalization"] > 0) == keep_bn
    _check(original)


def test_dynamo_export_is_fully_fused(network):
    pytest.importorskip("onnxscript")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                network,
                (torch.randn(2, 3, 32, 32),),
                dynamo=True,
                opset_version=18,
                input_names=["image"],
                output_names=["logits"],
                dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=64)}},
                verbose=False,
            )
    except Exception as exc:  # the dynamo exporter itself is not what we test
        pytest.skip(f"dynamo export failed: {type(exc).__name__}: {exc}")
    _check(program.model_proto)
