"""Sweep: export public torchvision architectures with PyTorch and run our optimizer CLI on each.

Why: outsiders feed ``python -m service optimize IN OUT`` whatever ``torch.onnx.export`` writes, with
either exporter and any common opset. For every model the optimizer must write a valid, equivalent
model or refuse with a clear error (never a traceback), and fuse every hard-swish/hard-sigmoid.

Two interpreters: the exporter runs in a venv with torch/torchvision (``--torch-python``, default
/tmp/tv/bin/python), the optimizer runs exactly as an outsider would, through the CLI of the project's
venv (``--service-python``), one subprocess per model with a timeout.

    /tmp/tv/bin/python bench/export_sweep.py --models mobilenet_v3_small --variants ts17,dynamo

Writes ``bench/results/export-sweep-<date>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ALL_MODELS = (
    "mobilenet_v3_large", "mobilenet_v3_small", "resnet18", "resnet50", "efficientnet_b0",
    "regnet_y_400mf", "shufflenet_v2_x1_0", "mnasnet0_5", "squeezenet1_0", "densenet121",
    "googlenet", "convnext_tiny", "vit_b_16",
)
VARIANTS = ("ts11", "ts13", "ts17", "dynamo")
# Extra variant "ts13nf": opset 13 without the exporter's constant folding, so BatchNormalization stays in
# the graph (the folding exporter and dynamo fold it themselves) and our BN fold meets real graphs.
WATCHED_OPS = ("Clip", "Div", "HardSwish", "HardSigmoid", "BatchNormalization")
NO_FUSED_CONV = ("mobilenet_v3_large", "mobilenet_v3_small")


def export_one(name: str, variant: str, path: Path) -> None:
    """Export ``name`` with random weights in eval mode, batch axis dynamic (runs in the torch venv)."""
    import torch
    import torchvision

    torch.manual_seed(0)
    kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
    _randomize_norms(torch, model)
    x = torch.randn(1, 3, 224, 224)
    path.parent.mkdir(parents=True, exist_ok=True)
    # torch.no_grad() as most users export (the TorchScript exporter then keeps BatchNormalization),
    # except for ViT: under it nn.MultiheadAttention takes its fused fast path
    # (aten::_native_multi_head_attention), which the TorchScript exporter cannot write.
    with torch.no_grad() if not name.startswith("vit") else contextlib.nullcontext():
        if variant == "dynamo":
            # Dim.AUTO: a fixed Dim range makes torch.export fail on convnext_tiny ("Invalid ranges [2:1]").
            torch.onnx.export(
                model, (x,), str(path), dynamo=True, input_names=["input"], output_names=["output"],
                dynamic_shapes=({0: torch.export.Dim.AUTO},),
            )
        else:
            torch.onnx.export(
                model, (x,), str(path), dynamo=False, opset_version=int(variant[2:4]),
                do_constant_folding=not variant.endswith("nf"),
                input_names=["input"], output_names=["output"],
                dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
            )


def _randomize_norms(torch, model) -> None:
    """Give every norm layer non-trivial statistics and affine parameters.

    Why: freshly built torchvision models have BN mean 0, var 1, gamma 1, beta 0 (an identity), so a
    wrong BN fold would verify, and several (mobilenets, efficientnet, mnasnet) then output ~1e-9, so
    any error hides under the verifier's atol. Random but sane stats keep activations O(1).
    """
    gen = torch.Generator().manual_seed(0)
    norms = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, norms):
                continue
            if getattr(module, "running_mean", None) is not None:
                module.running_mean.normal_(0.0, 0.2, generator=gen)
                module.running_var.uniform_(0.5, 2.0, generator=gen)
            if getattr(module, "weight", None) is not None:
                module.weight.uniform_(0.8, 1.6, generator=gen)
                module.bias.normal_(0.0, 0.2, generator=gen)


def _export(args: argparse.Namespace, name: str, variant: str, path: Path) -> str | None:
    """Export in a subprocess of the torch venv; None when it worked, else the error's tail."""
    if path.exists() and not args.reexport:
        return None
    cmd = [args.torch_python, __file__, "--export-one", name, variant, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    if proc.returncode != 0:
        return (proc.stderr or proc.stdout).strip()[-800:]
    return None


def _optimize(args: argparse.Namespace, src: Path, fused_conv: bool) -> dict:
    """Run the CLI exactly as an outsider would and classify the outcome."""
    out = src.with_suffix(".opt.onnx" if fused_conv else ".opt-nofc.onnx")
    cmd = [args.service_python, "-m", "service", "optimize", str(src), str(out), "--json"]
    if not fused_conv:
        cmd.append("--no-fused-conv")
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": round(time.perf_counter() - started, 1)}
    row: dict = {"seconds": round(time.perf_counter() - started, 1)}
    if "Traceback" in proc.stderr:
        row.update(status="crash", error=proc.stderr.strip()[-1500:])
    elif proc.returncode != 0:
        row.update(status="refused", error=proc.stderr.strip()[-500:])
    else:
        report = json.loads(proc.stdout)
        ops = report["ops_after"]
        row.update(
            status="ok", nodes_before=report["nodes_before"], nodes_after=report["nodes_after"],
            opset=f"{report['opset_before']}->{report['opset_after']}",
            max_abs_diff=report["max_abs_diff"], max_rel_diff=report["max_rel_diff"],
            left={op: ops.get(op, 0) for op in WATCHED_OPS},
        )
    return row


def _table(rows: list[dict]) -> str:
    head = f"{'model':<20} {'variant':<7} {'fc':<3} {'status':<8} {'nodes':>11} {'opset':>6} " \
           f"{'Clip/Div/HSw/HSig/BN':>21} {'max|d|':>9} {'rel':>8} {'s':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        left = r.get("left") or {}
        counts = "/".join(str(left.get(op, "-")) for op in WATCHED_OPS)
        nodes = f"{r['nodes_before']}->{r['nodes_after']}" if "nodes_after" in r else ""
        diff = f"{r['max_abs_diff']:.2g}" if r.get("max_abs_diff") is not None else ""
        rel = f"{r['max_rel_diff']:.2g}" if r.get("max_rel_diff") is not None else ""
        lines.append(
            f"{r['model']:<20} {r['variant']:<7} {'y' if r['fused_conv'] else 'n':<3} {r['status']:<8} "
            f"{nodes:>11} {r.get('opset', ''):>6} {counts:>21} {diff:>9} {rel:>8} {r.get('seconds', ''):>6}"
        )
        if r["status"] != "ok":
            lines.append("    " + (r.get("error") or "").strip().splitlines()[-1][:200])
    return "\n".join(lines)


def _versions(torch_python: str) -> dict:
    code = "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
    torch_v, tv_v = subprocess.run([torch_python, "-c", code], capture_output=True, text=True).stdout.split()
    import importlib.metadata as md

    def _v(*names: str) -> str | None:
        for n in names:
            try:
                return md.version(n)
            except md.PackageNotFoundError:
                continue
        return None

    return {"torch": torch_v, "torchvision": tv_v, "python": sys.version.split()[0],
            "onnx": _v("onnx"), "onnxruntime": _v("onnxruntime-gpu", "onnxruntime"),
            "onnx_graphsurgeon": _v("onnx-graphsurgeon")}


def _write(out: Path, date: str, versions: dict, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": date, "versions": versions, "rows": rows}, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--export-one", nargs=3, metavar=("MODEL", "VARIANT", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(ALL_MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workdir", default="/tmp/sweep")
    parser.add_argument("--torch-python", default="/tmp/tv/bin/python")
    parser.add_argument("--service-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--reexport", action="store_true")
    parser.add_argument(
        "--output", default=None, help="result JSON (default bench/results/export-sweep-<date>.json)"
    )
    args = parser.parse_args(argv)
    if args.export_one:
        name, variant, path = args.export_one
        export_one(name, variant, Path(path))
        return 0
    date = _dt.date.today().isoformat()
    out = Path(args.output) if args.output else RESULTS / f"export-sweep-{date}.json"
    rows: list[dict] = []
    versions = _versions(args.torch_python)
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            src = Path(args.workdir) / f"{name}.{variant}.onnx"
            error = _export(args, name, variant, src)
            if error:
                rows.append({"model": name, "variant": variant, "fused_conv": True, "status": "export-failed",
                             "error": error})
                print(_table(rows[-1:]).splitlines()[-2:][0], flush=True)
                continue
            for fused in (True, False) if name in NO_FUSED_CONV else (True,):
                row = {"model": name, "variant": variant, "fused_conv": fused, **_optimize(args, src, fused)}
                rows.append(row)
                print(_table([row]).splitlines()[2], flush=True)
                _write(out, date, versions, rows)  # after every row: a killed sweep still leaves its results
    print(_table(rows))
    _write(out, date, versions, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
