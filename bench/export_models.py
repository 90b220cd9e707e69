"""The export sweep's models and how each is exported (runs in the torch venv; nothing heavy at import).

``python bench/export_models.py MODEL VARIANT PATH`` writes one export: the architecture with random
weights (nothing downloaded), its norm layers given random affine parameters and running statistics
calibrated on random images, exported in eval mode with TorchScript at an opset (``ts11``/``ts13``/
``ts17``, ``ts13nf`` without constant folding) or with dynamo. ``--print-versions`` prints the exporter
side's versions as JSON. The orchestrator is ``bench/export_sweep.py``.

Groups (``--models`` of the sweep takes group names and model names):

- ``classifiers``, ``segmentation``, ``timm`` (hard-swish networks), ``detection`` (the MobileNetV3
  detectors): the sweep's first families.
- ``detection_one_stage`` (RetinaNet, FCOS, SSD300) and ``detection_rcnn`` (Mask and Keypoint R-CNN): the
  ResNet-50-FPN/VGG detectors at a 320x320 image (SSD300 at its own 300), ``min_size``/``max_size`` 320.
- ``reparam``: timm's RepVGG-A0 and MobileOne-S0, built to be re-parameterized for inference.
- ``fp16``: ResNet-34 exported in half precision (``.half()`` weights and a half input, as a user with
  a CUDA habit writes it; calibrated in float32 first).
- ``popular``: families people serve that the first groups lack: Wide ResNet-50-2 (the largest upload
  in the issue), Inception v3 (299x299), Swin-T (shifted-window attention), DeiT-tiny and MobileViT-S
  (timm transformers, scaled-dot-product attention), YOLOv8n (ultralytics, when installed: SiLU, Split,
  the DFL head; one dense output, NMS left to the user).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

CLASSIFIERS = (
    "mobilenet_v3_large",
    "mobilenet_v3_small",
    "resnet18",
    "resnet50",
    "efficientnet_b0",
    "regnet_y_400mf",
    "shufflenet_v2_x1_0",
    "mnasnet0_5",
    "squeezenet1_0",
    "densenet121",
    "googlenet",
    "convnext_tiny",
    "vit_b_16",
)
DETECTORS = ("ssdlite320_mobilenet_v3_large", "fasterrcnn_mobilenet_v3_large_320_fpn")
ONE_STAGE_DETECTORS = ("retinanet_resnet50_fpn", "fcos_resnet50_fpn", "fcos_resnet50_fpn_lowthresh", "ssd300_vgg16")
RCNN_DETECTORS = ("maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn")
SEGMENTERS = ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large")
# timm networks with hard-swish/hard-sigmoid (MixNet: BatchNorm after a Concat of Convs).
TIMM_MODELS = (
    "mobilenetv3_large_100",
    "lcnet_050",
    "ghostnet_100",
    "mixnet_s",
    "tinynet_a",
    "fbnetv3_b",
    "hardcorenas_a",
)
REPARAM_MODELS = ("repvgg_a0", "mobileone_s0")
FP16_MODELS = ("resnet34_fp16",)
POPULAR_MODELS = ("wide_resnet50_2", "inception_v3", "swin_t", "deit_tiny_patch16_224", "mobilevit_s", "yolov8n")
GROUPS = {
    "classifiers": CLASSIFIERS,
    "detection": DETECTORS,
    "detection_one_stage": ONE_STAGE_DETECTORS,
    "detection_rcnn": RCNN_DETECTORS,
    "segmentation": SEGMENTERS,
    "timm": TIMM_MODELS,
    "reparam": REPARAM_MODELS,
    "fp16": FP16_MODELS,
    "popular": POPULAR_MODELS,
}
ALL_DETECTORS = frozenset((*DETECTORS, *ONE_STAGE_DETECTORS, *RCNN_DETECTORS))
TIMM_BUILT = frozenset((*TIMM_MODELS, *REPARAM_MODELS, "deit_tiny_patch16_224", "mobilevit_s"))
ULTRALYTICS_BUILT = {"yolov8n": "yolov8n.yaml"}
SMALL_DETECTOR = {"min_size": 320, "max_size": 320}
DETECTOR_KWARGS = {
    **{name: SMALL_DETECTOR for name in ("retinanet_resnet50_fpn", "fcos_resnet50_fpn", *RCNN_DETECTORS)},
    "fcos_resnet50_fpn_lowthresh": {**SMALL_DETECTOR, "score_thresh": 0.001},
}
"""The R-CNN-style transform resizes to ``min_size``; 320 keeps the ResNet-50-FPN detectors fast. FCOS with
random weights scores every box under its 0.05 threshold (0-4 detections, often none, the case a blank
image gives a trained one); ``_lowthresh`` (0.001) keeps 100, so its served answer has detections to match.
(The R-CNNs detect nothing with random weights at any threshold: their random proposals are cut away
before scoring.)"""
SIZES = {"ssd300_vgg16": 300, "inception_v3": 299, "mobilevit_s": 256, "yolov8n": 320}
"""Input height and width where not the task's default (below)."""
DETECTOR_SIZE = 320  # detectors: one fixed 3xSxS image (SSDLite-320's and the 320-FPN's own size)
SEGMENTER_SIZE = 320
CLASSIFIER_SIZE = 224


def family(name: str) -> str:
    """The group ``name`` belongs to (a key of GROUPS); ValueError for an unknown model."""
    for group, names in GROUPS.items():
        if name in names:
            return group
    raise ValueError(f"unknown model {name!r}; known: {', '.join(n for names in GROUPS.values() for n in names)}")


def task(name: str) -> str:
    """detection, segmentation or classification (every dense single-output net, YOLO's raw head included)."""
    if name in ALL_DETECTORS:
        return "detection"
    return "segmentation" if name in SEGMENTERS else "classification"


def input_size(name: str) -> int:
    default = {"detection": DETECTOR_SIZE, "segmentation": SEGMENTER_SIZE}.get(task(name), CLASSIFIER_SIZE)
    return SIZES.get(name, default)


@dataclasses.dataclass
class ExportSpec:
    """What ``torch.onnx.export`` gets for one model: example inputs, names and dynamic dims."""

    args: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    """TorchScript exporter's form; dynamo gets ``dynamic_shapes`` derived from the input entries."""


def export_one(name: str, variant: str, path: Path) -> None:
    """Export ``name`` with random weights in eval mode."""
    import torchvision_ops

    torchvision_ops.ensure()  # before torchvision is imported
    import torch

    torch.manual_seed(0)
    model = build_model(name).eval()
    _randomize_zero_weights(torch, model)
    _randomize_norms(torch, model)
    if task(name) != "detection":  # a detector in train mode wants targets; its norms stay as randomized
        _calibrate_norms(torch, model, input_size(name))
    if name in FP16_MODELS:
        model = model.half()
    spec = export_spec(name, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    # torch.no_grad() as most users export (the TorchScript exporter then keeps BatchNormalization),
    # except for ViT: under it nn.MultiheadAttention takes its fused fast path
    # (aten::_native_multi_head_attention), which the TorchScript exporter cannot write.
    with torch.no_grad() if not name.startswith("vit") else contextlib.nullcontext():
        if variant == "dynamo":
            _export_dynamo(torch, model, spec, path)
        else:
            torch.onnx.export(
                model,
                spec.args,
                str(path),
                dynamo=False,
                opset_version=int(variant[2:4]),
                do_constant_folding=not variant.endswith("nf"),
                input_names=spec.input_names,
                output_names=spec.output_names,
                dynamic_axes=spec.dynamic_axes,
            )


def _export_dynamo(torch, model, spec: ExportSpec, path: Path) -> None:
    """dynamo=True with the spec's input dims as ``Dim.AUTO``.

    Dim.AUTO, not a fixed Dim range: a range makes torch.export fail on convnext_tiny ("Invalid ranges [2:1]").
    """
    dims = [spec.dynamic_axes.get(name, {}) for name in spec.input_names]
    dynamic_shapes = tuple({axis: torch.export.Dim.AUTO for axis in axes} or None for axes in dims)
    torch.onnx.export(
        model,
        spec.args,
        str(path),
        dynamo=True,
        input_names=spec.input_names,
        output_names=spec.output_names,
        dynamic_shapes=dynamic_shapes if any(dims) else None,
    )


def build_model(name: str):
    """The architecture with random weights, nothing downloaded."""
    if name in TIMM_BUILT:
        import timm

        return timm.create_model(name, pretrained=False)
    if name in ULTRALYTICS_BUILT:
        return _yolo(ULTRALYTICS_BUILT[name])
    import torchvision

    if task(name) == "detection":
        return getattr(torchvision.models.detection, name.removesuffix("_lowthresh"))(
            weights=None, weights_backbone=None, **DETECTOR_KWARGS.get(name, {})
        )
    if task(name) == "segmentation":
        return getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)
    kwargs = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
    return getattr(torchvision.models, name.removesuffix("_fp16"))(weights=None, **kwargs)


def _yolo(config: str):
    """An ultralytics detection model from its packaged config, its head in export mode (one [N, 4+classes,
    anchors] tensor, as ``yolo export format=onnx`` writes it)."""
    from ultralytics.nn.tasks import DetectionModel

    model = DetectionModel(config, nc=80, verbose=False)
    model.model[-1].export = True
    return model


def export_spec(name: str, model) -> ExportSpec:
    """Inputs and dynamic dims as torchvision documents them per task.

    Detectors take a list of CHW images and return one dict per image; exported, as in torchvision's docs
    and ONNX tests, with one fixed-size image and the detection count dynamic. Their output order is the
    dict's key order, read from one eager run (SSD and R-CNN order boxes/scores/labels differently).
    Segmenters return {"out": N x classes x H x W}; classifiers a logits tensor; both with a dynamic batch.
    """
    import torch

    size = input_size(name)
    dtype = torch.float16 if name in FP16_MODELS else torch.float32
    if task(name) == "detection":
        image = torch.rand(3, size, size)
        with torch.no_grad():
            keys = list(model([image])[0].keys())
        return ExportSpec(([image],), ["images"], keys, {key: {0: "detections"} for key in keys})
    x = torch.randn(1, 3, size, size, dtype=dtype)
    output = "out" if task(name) == "segmentation" else "output"
    return ExportSpec((x,), ["input"], [output], {"input": {0: "batch"}, output: {0: "batch"}})


def _randomize_norms(torch, model) -> None:
    """Give every norm layer non-trivial statistics and affine parameters.

    Why: freshly built torchvision models have BN mean 0, var 1, gamma 1, beta 0 (an identity), so a
    wrong BN fold would verify, and several (mobilenets, efficientnet, mnasnet) then output ~1e-9, so
    any error hides under the verifier's atol. Random but sane stats keep activations O(1). Frozen
    BatchNorm (torchvision's, for trained backbones) has the same buffers and gets the same.
    """
    gen = torch.Generator().manual_seed(0)
    norms = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, norms) and not hasattr(module, "running_var"):
                continue
            if getattr(module, "running_mean", None) is not None:
                module.running_mean.normal_(0.0, 0.2, generator=gen)
                module.running_var.uniform_(0.5, 2.0, generator=gen)
            if getattr(module, "weight", None) is not None:
                module.weight.uniform_(0.8, 1.6, generator=gen)
                module.bias.normal_(0.0, 0.2, generator=gen)


def _randomize_zero_weights(torch, model) -> None:
    """Weights a builder sets to zero (torchvision's ViT head) get small random values: a zero head makes
    every output 0 whatever the input, and a comparison of zeros proves nothing."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and weight is not None and not weight.any():
                weight.normal_(0.0, 0.02, generator=gen)


def _calibrate_norms(torch, model, size: int) -> None:
    """Running statistics measured on random images, as training leaves them (the affine parameters keep
    their random values).

    Why: randomized statistics that do not match the activations let them grow layer by layer: MixNet-S
    reached 1.4e4 inside and 2.5e3 at its logits, where float32 rounding alone, amplified by cancellations,
    moved the output by more than the verification tolerance (ONNX Runtime's own BN folding: 1e-3 of its
    scale), so the sweep tested the model's conditioning rather than the rewrite.

    Not for detectors: calibrating SSDLite's backbone alone on such images got it refused (a TopK input off
    by 5e-4 of its scale on [0, 255] inputs, which the backbone never saw), so the detectors keep the
    randomized statistics under which every earlier sweep verified them."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for module in norms:
        module.reset_running_stats()
        module.momentum = None  # a cumulative average over the calibration batches
    gen = torch.Generator().manual_seed(1)
    model.train()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(8, 3, size, size, generator=gen))
    model.eval()


def torch_versions() -> dict:
    """The exporter side: torch, torchvision (and how its operators load), timm, onnxscript, ultralytics."""
    import torchvision_ops

    ops = torchvision_ops.ensure()
    import torch
    import torchvision

    versions = {"torch": torch.__version__, "torchvision": torchvision.__version__, "torchvision_ops": ops}
    for module in ("timm", "onnxscript", "ultralytics"):
        with contextlib.suppress(ImportError):
            versions[module] = __import__(module).__version__
    return versions


def main(argv: list[str]) -> int:
    if argv == ["--print-versions"]:
        print(json.dumps(torch_versions()))
        return 0
    if len(argv) != 3:
        print("usage: export_models.py MODEL VARIANT PATH | --print-versions", file=sys.stderr)
        return 2
    name, variant, path = argv
    family(name)
    export_one(name, variant, Path(path))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
