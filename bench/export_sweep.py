"""Sweep: export public torchvision architectures with PyTorch and run our optimizer CLI on each.

Why: outsiders feed ``python -m service optimize IN OUT`` whatever ``torch.onnx.export`` writes, with
either exporter and any common opset. For every model the optimizer must write a valid, equivalent
model or refuse with a clear error (never a traceback), and fuse every hard-swish/hard-sigmoid.

Models: torchvision's classifiers, its MobileNetV3 detectors (SSDLite, Faster R-CNN) and segmenters
(LRASPP, DeepLabV3), and timm's hard-swish networks (``--models``: names or groups), all with random
weights and randomized norm statistics; TorchScript at opsets 11/13/17 and dynamo (``--variants``).

Two interpreters: the exporter runs in a venv with torch/torchvision/timm (``--torch-python``, default
the one running this script), the optimizer runs exactly as an outsider would, through the CLI of the
project's venv (``--service-python``) on this checkout's ``service``, one subprocess per model with a
timeout. A torchvision whose compiled operators do not load beside the CPU torch gets them from
``bench/torchvision_ops.py`` (recorded as ``versions.torchvision_ops``).

    TORCH_VENV/bin/python bench/export_sweep.py --models detection,timm --variants ts17,dynamo \\
        --service-python .venv/bin/python --output bench/results/export-sweep-<date>-<label>.json

A row is a FAILURE (printed under it) when the optimizer refuses or crashes on an export PyTorch could
write, or leaves a BatchNormalization or a decomposed hard-swish (Clip/Div).

Writes ``bench/results/export-sweep-<date>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

RESULTS = ROOT / "bench" / "results"
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
HARD_SWISH_MODELS = frozenset(("mobilenet_v3_large", "mobilenet_v3_small", *SEGMENTERS, *TIMM_MODELS))
"""The networks whose every Clip/Div is part of a hard-swish or hard-sigmoid (detectors also clip boxes)."""
BN_NOT_FOLDABLE = {
    "densenet121": "each BN follows a Concat of the block input and earlier layers (not all convs) and reaches "
    "the next conv through a ReLU: no exact fold exists (ONNX Runtime keeps them too)",
}
GROUPS = {"classifiers": CLASSIFIERS, "detection": DETECTORS, "segmentation": SEGMENTERS, "timm": TIMM_MODELS}
VARIANTS = ("ts11", "ts13", "ts17", "dynamo")
# Extra variant "ts13nf": opset 13 without the exporter's constant folding, so BatchNormalization stays in
# the graph (the folding exporter and dynamo fold it themselves) and our BN fold meets real graphs.
WATCHED_OPS = ("Clip", "Div", "HardSwish", "HardSigmoid", "BatchNormalization")
NO_FUSED_CONV = ("mobilenet_v3_large", "mobilenet_v3_small")
DETECTOR_SIZE = 320  # detectors: one fixed 3x320x320 image (SSDLite-320's and the 320-FPN's own size)
SEGMENTER_SIZE = 320
CLASSIFIER_SIZE = 224


def family(name: str) -> str:
    """The group ``name`` belongs to (a key of GROUPS); ValueError for an unknown model."""
    for group, names in GROUPS.items():
        if name in names:
            return group
    raise ValueError(f"unknown model {name!r}; known: {', '.join(n for names in GROUPS.values() for n in names)}")


@dataclasses.dataclass
class ExportSpec:
    """What ``torch.onnx.export`` gets for one model: example inputs, names and dynamic dims."""

    args: tuple
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    """TorchScript exporter's form; dynamo gets ``dynamic_shapes`` derived from the input entries."""


def export_one(name: str, variant: str, path: Path) -> None:
    """Export ``name`` with random weights in eval mode (runs in the torch venv)."""
    import torchvision_ops

    torchvision_ops.ensure()  # before torchvision is imported
    import torch

    torch.manual_seed(0)
    model = build_model(name).eval()
    _randomize_norms(torch, model)
    if family(name) != "detection":  # a detector in train mode wants targets; its norms stay as randomized
        _calibrate_norms(torch, model, SEGMENTER_SIZE if family(name) == "segmentation" else CLASSIFIER_SIZE)
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
    group = family(name)
    if group == "timm":
        import timm

        return timm.create_model(name, pretrained=False)
    import torchvision

    if group == "detection":
        return getattr(torchvision.models.detection, name)(weights=None, weights_backbone=None)
    if group == "segmentation":
        return getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)
    kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    return getattr(torchvision.models, name)(weights=None, **kwargs)


def export_spec(name: str, model) -> ExportSpec:
    """Inputs and dynamic dims as torchvision documents them per task.

    Detectors take a list of CHW images and return one dict per image; exported, as in torchvision's docs
    and ONNX tests, with one fixed-size image and the detection count dynamic. Their output order is the
    dict's key order, read from one eager run (SSD and R-CNN order boxes/scores/labels differently).
    Segmenters return {"out": N x classes x H x W}; classifiers a logits tensor; both with a dynamic batch.
    """
    import torch

    group = family(name)
    if group == "detection":
        image = torch.rand(3, DETECTOR_SIZE, DETECTOR_SIZE)
        with torch.no_grad():
            keys = list(model([image])[0].keys())
        return ExportSpec(([image],), ["images"], keys, {key: {0: "detections"} for key in keys})
    size = SEGMENTER_SIZE if group == "segmentation" else CLASSIFIER_SIZE
    x = torch.randn(1, 3, size, size)
    output = "out" if group == "segmentation" else "output"
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


def _calibrate_norms(torch, model, size: int) -> None:
    """Running statistics measured on random images, as training leaves them (the affine parameters keep
    their random values).

    Why: randomized statistics that do not match the activations let them grow layer by layer: MixNet-S
    reached 1.4e4 inside and 2.5e3 at its logits, where float32 rounding alone, amplified by cancellations,
    moved the output by more than the verification tolerance (ONNX Runtime's own BN folding: 1e-3 of its
    scale), so the sweep tested the model's conditioning rather than the rewrite."""
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


def _export(args: argparse.Namespace, name: str, variant: str, path: Path) -> str | None:
    """Export in a subprocess of the torch venv; None when it worked, else why not (the error's tail)."""
    if path.exists() and not args.reexport:
        return None
    cmd = [args.torch_python, __file__, "--export-one", name, variant, str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"export timed out after {args.timeout} s"
    if proc.returncode != 0:
        path.unlink(missing_ok=True)
        return scrub_paths((proc.stderr or proc.stdout).strip())[-800:]
    return None


def _optimize(args: argparse.Namespace, src: Path, fused_conv: bool) -> dict:
    """Run the CLI exactly as an outsider would (this checkout's ``service``) and classify the outcome."""
    out = src.with_suffix(".opt.onnx" if fused_conv else ".opt-nofc.onnx")
    cmd = [args.service_python, "-m", "service", "optimize", str(src), str(out), "--json"]
    if not fused_conv:
        cmd.append("--no-fused-conv")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": round(time.perf_counter() - started, 1)}
    row: dict = {"seconds": round(time.perf_counter() - started, 1)}
    if "Traceback" in proc.stderr:
        row.update(status="crash", error=scrub_paths(proc.stderr.strip())[-1500:])
    elif proc.returncode != 0:
        row.update(status="refused", error=scrub_paths(proc.stderr.strip())[-500:])
    else:
        row.update(status="ok", **_report_fields(json.loads(proc.stdout)))
    return row


def _report_fields(report: dict) -> dict:
    """What a row keeps of the CLI's JSON report: sizes, leftovers and the verification."""
    ops = report["ops_after"]
    return {
        "nodes_before": report["nodes_before"],
        "nodes_after": report["nodes_after"],
        "opset": f"{report['opset_before']}->{report['opset_after']}",
        "left": {op: ops.get(op, 0) for op in WATCHED_OPS},
        "verified": report["verified"],
        "max_abs_diff": report["max_abs_diff"],
        "max_rel_diff": report["max_rel_diff"],
        "verify_batch_sizes": report.get("verify_batch_sizes"),
        "verify_input_kinds": report.get("verify_input_kinds"),
        # input kinds the original model fails on (Keypoint R-CNN on [0, 255]): kind -> its first error
        "verify_skipped_kinds": report.get("verify_skipped_kinds") or {},
        "verify_precision": report.get("verify_precision"),
        "verify_tolerance": [report.get("verify_rtol"), report.get("verify_atol")],
        # outputs compared as sets of detections: their detection count in every verification run
        "verify_unordered_rows": report.get("verify_unordered_rows") or {},
        "verify_selection_inputs": report.get("verify_selection_inputs") or [],
        # detections differed as sets (ties) and verified cut at this many selections, fed the original's
        "verify_fed_selections": len(report.get("verify_fed_selections") or []),
    }


_SITE_PACKAGES = re.compile(r"/\S*?/(site|dist)-packages/")


def scrub_paths(text: str) -> str:
    """``text`` with this machine's paths taken out (results are shared): site-packages prefixes, the
    checkout and the temp folder."""
    text = _SITE_PACKAGES.sub(r"\1-packages/", text)
    return text.replace(str(ROOT), ".").replace(tempfile.gettempdir(), "TMP")


def failures(row: dict) -> list[str]:
    """Why an optimizer run counts as a failure of ours (empty: it does not); an export PyTorch cannot
    write is not ours."""
    if row["status"] == "export-failed":
        return []
    if row["status"] != "ok":
        return [row["status"]]
    left = row["left"]
    found = []
    if left["BatchNormalization"] and row.get("model") not in BN_NOT_FOLDABLE:
        found.append(f"{left['BatchNormalization']} BatchNormalization left")
    # Clip or Div left in a hard-swish network: a hard-swish/hard-sigmoid left decomposed (elsewhere they
    # are the model's own: shape arithmetic, LayerNorm, attention scaling, box clipping)
    if (left["Clip"] or left["Div"]) and row.get("model") in HARD_SWISH_MODELS:
        found.append(f"Clip {left['Clip']} / Div {left['Div']} left")
    return found


def _detections(row: dict) -> str:
    """``boxes 0-12`` per set-compared output: the fewest and most detections over the verification runs."""
    rows = row.get("verify_unordered_rows") or {}
    text = " ".join(f"{name} {min(n)}-{max(n)}" for name, n in rows.items() if n)
    return f"{text} (ties: {row['verify_fed_selections']} selections fed)" if row.get("verify_fed_selections") else text


def _table(rows: list[dict]) -> str:
    head = (
        f"{'model':<38} {'variant':<7} {'fc':<3} {'status':<13} {'nodes':>11} {'opset':>6} "
        f"{'Clip/Div/HSw/HSig/BN':>21} {'max|d|':>9} {'rel':>8} {'s':>6}  detections"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(_table_line(r))
        if r["status"] not in ("ok",):
            lines.append("    " + ((r.get("error") or "").strip().splitlines() or [""])[-1][:200])
        elif failures(r):
            lines.append("    FAILURE: " + "; ".join(failures(r)))
    return "\n".join(lines)


def _table_line(r: dict) -> str:
    left = r.get("left") or {}
    counts = "/".join(str(left.get(op, "-")) for op in WATCHED_OPS)
    nodes = f"{r['nodes_before']}->{r['nodes_after']}" if "nodes_after" in r else ""
    diff = f"{r['max_abs_diff']:.2g}" if r.get("max_abs_diff") is not None else ""
    rel = f"{r['max_rel_diff']:.2g}" if r.get("max_rel_diff") is not None else ""
    return (
        f"{r['model']:<38} {r['variant']:<7} {'y' if r['fused_conv'] else 'n':<3} {r['status']:<13} "
        f"{nodes:>11} {r.get('opset', ''):>6} {counts:>21} {diff:>9} {rel:>8} {r.get('seconds', ''):>6}  "
        f"{_detections(r)}"
    )


def torch_versions() -> dict:
    """The exporter side (runs in the torch venv): torch, torchvision (and how its operators load), timm."""
    import torchvision_ops

    ops = torchvision_ops.ensure()
    import torch
    import torchvision

    versions = {"torch": torch.__version__, "torchvision": torchvision.__version__, "torchvision_ops": ops}
    with contextlib.suppress(ImportError):
        import timm

        versions["timm"] = timm.__version__
    with contextlib.suppress(ImportError):
        import onnxscript

        versions["onnxscript"] = onnxscript.__version__
    return versions


_SERVICE_VERSIONS = (
    "import json; from bench import common; "
    "print(json.dumps(common.package_versions(('onnx', 'onnxruntime', 'onnx_graphsurgeon'))))"
)
"""The optimizer side's versions, asked of its own interpreter through ``bench.common``."""


def _versions(args: argparse.Namespace) -> dict:
    """Both sides' versions, each asked of its own interpreter."""
    torch_side = subprocess.run(
        [args.torch_python, __file__, "--print-versions"], capture_output=True, text=True, check=True
    ).stdout
    service_side = subprocess.run(
        [args.service_python, "-c", _SERVICE_VERSIONS], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return {**json.loads(torch_side), **json.loads(service_side)}


def _write(out: Path, header: dict, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**header, "rows": rows}, indent=2) + "\n")


def _model_names(spec: str) -> list[str]:
    """``--models``: model names and group names (classifiers, detection, segmentation, timm), comma-separated."""
    names: list[str] = []
    for item in filter(None, spec.split(",")):
        for name in GROUPS.get(item, (item,)):
            family(name)  # unknown names fail before anything runs
            names.append(name)
    return names


def _sweep_model(args: argparse.Namespace, name: str, variant: str) -> list[dict]:
    """Export one model one way and optimize it (twice, FusedConv on and off, for NO_FUSED_CONV)."""
    src = Path(args.workdir) / f"{name}.{variant}.onnx"
    base = {"model": name, "family": family(name), "variant": variant}
    started = time.perf_counter()
    error = _export(args, name, variant, src)
    if error:
        return [
            {
                **base,
                "fused_conv": True,
                "status": "export-failed",
                "error": error,
                "seconds": round(time.perf_counter() - started, 1),
            }
        ]
    return [
        {**base, "fused_conv": fused, **_optimize(args, src, fused)}
        for fused in ((True, False) if name in NO_FUSED_CONV else (True,))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export-one", nargs=3, metavar=("MODEL", "VARIANT", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--print-versions", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--models",
        default="classifiers",
        help="models and groups, comma-separated: " + ", ".join(GROUPS) + " (default classifiers)",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "export-sweep"))
    parser.add_argument("--torch-python", default=sys.executable, help="the torch venv's python (default: this one)")
    parser.add_argument("--service-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per export and per optimizer run")
    parser.add_argument("--reexport", action="store_true")
    parser.add_argument("--output", default=None, help="result JSON (default bench/results/export-sweep-<date>.json)")
    args = parser.parse_args(argv)
    if args.export_one:
        name, variant, path = args.export_one
        export_one(name, variant, Path(path))
        return 0
    if args.print_versions:
        print(json.dumps(torch_versions()))
        return 0
    names = _model_names(args.models)
    date = common.today()
    out = Path(args.output) if args.output else RESULTS / f"export-sweep-{date}.json"
    header = {
        **common.header(packages=()),
        "versions": _versions(args),
        "variants": args.variants.split(","),
        "timeout_s": args.timeout,
    }
    rows: list[dict] = []
    print(_table([]), flush=True)
    for name in names:
        for variant in args.variants.split(","):
            for row in _sweep_model(args, name, variant):
                rows.append(row)
                print(_table([row]).split("\n", 2)[2], flush=True)
                _write(out, header, rows)  # after every row: a killed sweep still leaves its results
    print(_table(rows))
    _write(out, header, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
