"""Sweep: export public architectures with PyTorch, optimize each with our CLI and serve it with our server.

Why: outsiders feed ``python -m service optimize IN OUT`` or ``POST /v1/models/{name}`` whatever
``torch.onnx.export`` writes, with either exporter and any common opset. For every model the optimizer
must write a valid, equivalent model or refuse with a clear error (never a traceback), fuse every
hard-swish/hard-sigmoid and fold every BatchNormalization that has an exact fold; the upload must accept
what the CLI accepts, in about the CLI's time; and the server must answer what the original computes,
every row of it.

Models (``bench/export_models.py``, ``--models``: names or groups): torchvision's classifiers, detectors
and segmenters, timm's hard-swish, re-parameterizable and transformer networks, an fp16 ResNet-34 and
YOLOv8n, all with random weights and calibrated norm statistics; TorchScript at opsets 11/13/17 (13 also
without constant folding) and dynamo (``--variants``).

Two interpreters: the exporter runs in a venv with torch/torchvision/timm (``--torch-python``, default
the one running this script); the optimizer runs exactly as an outsider would, through the CLI of the
project's venv (``--service-python``) on this checkout's ``service``, one subprocess per model with a
timeout. A torchvision whose compiled operators do not load beside the CPU torch gets them from
``bench/torchvision_ops.py`` (recorded as ``versions.torchvision_ops``).

Serving (on unless ``--no-serve``; ``bench/export_serve.py``): one ``python -m service serve`` of this
checkout for the run (loopback, free port, scratch store, CPU). Each export is uploaded (wall time beside
the CLI's time for the same file, the two taking turns at going first), queried through tritonclient on
the verifier's input kinds, and the answers compared with ONNX Runtime on the original export
(``bench/served_equal.py``: shapes equal, values in order within a scale-relative tolerance, detections
as sets); then deleted.

    .venv/bin/python bench/export_sweep.py --torch-python TORCH_VENV/bin/python \\
        --models detection_one_stage --variants ts17

A row is a FAILURE (printed under it) when the optimizer refuses or crashes on an export PyTorch could
write, leaves a BatchNormalization or a decomposed hard-swish (Clip/Div), when the upload refuses it or
when the served answer differs from the original's.

Writes ``bench/results/export-sweep-<date>-<label>.json`` (label: ``--label``, else the ``--models``
argument) after every row, and prints a table.
"""

from __future__ import annotations

import argparse
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

from bench import common, export_models  # noqa: E402
from bench.export_models import DETECTORS, GROUPS, TIMM_MODELS, family  # noqa: E402,F401  (the catalog)
from bench.export_serve import Server, _one_file  # noqa: E402

RESULTS = ROOT / "bench" / "results"
EXPORTER = ROOT / "bench" / "export_models.py"
HARD_SWISH_MODELS = frozenset(
    ("mobilenet_v3_large", "mobilenet_v3_small", *export_models.SEGMENTERS, *export_models.TIMM_MODELS)
)
"""The networks whose every Clip/Div is part of a hard-swish or hard-sigmoid (detectors also clip boxes)."""
BN_NOT_FOLDABLE = {
    "densenet121": "each BN follows a Concat of the block input and earlier layers (not all convs) and reaches "
    "the next conv through a ReLU: no exact fold exists (ONNX Runtime keeps them too)",
}
VARIANTS = ("ts11", "ts13", "ts17", "dynamo")
# Extra variant "ts13nf": opset 13 without the exporter's constant folding, so BatchNormalization stays in
# the graph (the folding exporter and dynamo fold it themselves) and our BN fold meets real graphs.
WATCHED_OPS = ("Clip", "Div", "HardSwish", "HardSigmoid", "BatchNormalization")
NO_FUSED_CONV = ("mobilenet_v3_large", "mobilenet_v3_small")


def _export(args: argparse.Namespace, name: str, variant: str, path: Path) -> str | None:
    """Export in a subprocess of the torch venv; None when it worked, else why not (the error's tail)."""
    if path.exists() and not args.reexport:
        return None
    cmd = [args.torch_python, str(EXPORTER), name, variant, str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"export timed out after {args.timeout} s"
    if proc.returncode != 0:
        path.unlink(missing_ok=True)
        return scrub_paths((proc.stderr or proc.stdout).strip())[-800:]
    return None


def _self_contained(src: Path) -> tuple[Path, bool]:
    """The export as one file, and whether its weights had to be brought in: the CLI refuses external data
    as the upload does (same check, same message), so a dynamo export is given to it inlined, as a user
    following that message would (``export_serve._one_file``)."""
    data, inlined = _one_file(src)
    if not inlined:
        return src, False
    whole = src.with_suffix(".whole.onnx")
    whole.write_bytes(data)
    return whole, True


def _optimize(args: argparse.Namespace, src: Path, fused_conv: bool) -> dict:
    """Run the CLI exactly as an outsider would (this checkout's ``service``) and classify the outcome."""
    out = src.with_suffix(".opt.onnx" if fused_conv else ".opt-nofc.onnx")
    given, inlined = _self_contained(src)
    cmd = [args.service_python, "-m", "service", "optimize", str(given), str(out), "--json"]
    if not fused_conv:
        cmd.append("--no-fused-conv")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": round(time.perf_counter() - started, 1)}
    row: dict = {"seconds": round(time.perf_counter() - started, 1), **({"cli_inlined": True} if inlined else {})}
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
    """Why a row counts as a failure of ours (empty: it does not); an export PyTorch cannot write is not ours."""
    if row["status"] == "export-failed":
        return []
    found = [] if row["status"] == "ok" else [row["status"]]
    left = row.get("left") or {}
    if left.get("BatchNormalization") and row.get("model") not in BN_NOT_FOLDABLE:
        found.append(f"{left['BatchNormalization']} BatchNormalization left")
    # Clip or Div left in a hard-swish network: a hard-swish/hard-sigmoid left decomposed (elsewhere they
    # are the model's own: shape arithmetic, LayerNorm, attention scaling, box clipping)
    if (left.get("Clip") or left.get("Div")) and row.get("model") in HARD_SWISH_MODELS:
        found.append(f"Clip {left['Clip']} / Div {left['Div']} left")
    return found + served_failures(row)


def served_failures(row: dict) -> list[str]:
    """The serving stage's failures: a refused upload, a served answer unlike the original's, BN served."""
    status = row.get("upload_status")
    if status is None:
        return []
    if status != 201:
        return [f"upload {status}"]
    found = ["served answer differs"] if row.get("served_verdict", "differs") == "differs" else []
    if row.get("served_bn_left") and row.get("model") not in BN_NOT_FOLDABLE:
        found.append(f"{row['served_bn_left']} BatchNormalization served")
    return found


def _detections(row: dict) -> str:
    """``boxes 0-12`` per set-compared output: the fewest and most detections over the verification runs."""
    rows = row.get("verify_unordered_rows") or {}
    text = " ".join(f"{name} {min(n)}-{max(n)}" for name, n in rows.items() if n)
    return f"{text} (ties: {row['verify_fed_selections']} selections fed)" if row.get("verify_fed_selections") else text


def served_detections(row: dict) -> str:
    """``boxes 100/100/100`` per set-compared output: the detections of each served request; with ties, the
    unmatched ones per request, served and by ONNX Runtime's own optimizer on the original."""
    text = " ".join(f"{name} {'/'.join(map(str, n))}" for name, n in (row.get("served_rows") or {}).items())
    if any(row.get("served_unmatched") or ()):
        unmatched = "/".join(map(str, row["served_unmatched"]))
        text += f" (unmatched {unmatched}; ORT's own {'/'.join(map(str, row['ort_own_unmatched']))})"
    return text


def _table(rows: list[dict]) -> str:
    head = (
        f"{'model':<34} {'variant':<7} {'fc':<3} {'status':<8} {'nodes':>11} {'opset':>6} "
        f"{'Clip/Div/HSw/HSig/BN':>21} {'rel':>8} {'cli s':>6} {'upload':>6} {'up s':>6} {'tune':>5} {'up/cli':>6} "
        f"{'served':>6} {'rel':>8}  detections (verified; served)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(_table_line(r))
        lines.extend("    " + text[:240] for text in _notes(r))
    return "\n".join(lines)


def _notes(r: dict) -> list[str]:
    """The lines printed under a row: its error, the upload's refusal, what was served wrong, what failed."""
    notes = []
    if r["status"] != "ok":
        notes.append(((r.get("error") or "").strip().splitlines() or [""])[-1])
    if r.get("upload_error") or r.get("served_error"):
        notes.append(f"upload: {r.get('upload_error') or r.get('served_error')}")
    notes.extend(f"served: {p}" for p in (r.get("served_problems") or [])[:3])
    notes.extend(f"original fails: {p}" for p in (r.get("original_fails") or [])[:2])
    if failures(r):
        notes.append("FAILURE: " + "; ".join(failures(r)))
    return notes


def _table_line(r: dict) -> str:
    left = r.get("left") or {}
    counts = "/".join(str(left.get(op, "-")) for op in WATCHED_OPS)
    nodes = f"{r['nodes_before']}->{r['nodes_after']}" if "nodes_after" in r else ""
    served = {"differs": "DIFF"}.get(r.get("served_verdict"), r.get("served_verdict") or "")
    detections = "; ".join(filter(None, (_detections(r), served_detections(r))))
    return (
        f"{r['model']:<34} {r['variant']:<7} {'y' if r['fused_conv'] else 'n':<3} {r['status']:<8} "
        f"{nodes:>11} {r.get('opset', ''):>6} {counts:>21} {_number(r.get('max_rel_diff')):>8} "
        f"{r.get('seconds', ''):>6} {r.get('upload_status', ''):>6} {r.get('upload_s', ''):>6} "
        f"{r.get('served_tune_s', ''):>5} "
        f"{_number(r.get('upload_cli_ratio'), '.2f'):>6} {served:>6} {_number(r.get('served_max_rel')):>8}  "
        f"{detections}"
    )


def _number(value: float | None, form: str = ".2g") -> str:
    return "" if value is None else format(value, form)


_SERVICE_VERSIONS = (
    "import json; from bench import common; "
    "print(json.dumps(common.package_versions(('onnx', 'onnxruntime', 'onnx_graphsurgeon', 'tritonclient'))))"
)
"""The optimizer side's versions, asked of its own interpreter through ``bench.common``."""


def _versions(args: argparse.Namespace) -> dict:
    """Both sides' versions, each asked of its own interpreter."""
    torch_side = subprocess.run(
        [args.torch_python, str(EXPORTER), "--print-versions"], capture_output=True, text=True, check=True
    ).stdout
    service_side = subprocess.run(
        [args.service_python, "-c", _SERVICE_VERSIONS], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    # the last line: ultralytics prints its own warnings to stdout on import
    return {**json.loads(torch_side.strip().splitlines()[-1]), **json.loads(service_side)}


def _write(out: Path, header: dict, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**header, "rows": rows}, indent=2) + "\n")


def _model_names(spec: str) -> list[str]:
    """``--models``: model names and group names (``GROUPS``), comma-separated."""
    names: list[str] = []
    for item in filter(None, spec.split(",")):
        for name in GROUPS.get(item, (item,)):
            family(name)  # unknown names fail before anything runs
            names.append(name)
    return names


class _Sweep:
    """One run: the settings, the server (None with ``--no-serve``) and the exports done so far."""

    def __init__(self, args: argparse.Namespace, server: Server | None) -> None:
        self.args, self.server = args, server
        self.count = 0

    def model(self, name: str, variant: str) -> list[dict]:
        """Export one model one way, optimize it (twice, FusedConv on and off, for NO_FUSED_CONV) and serve it."""
        src = Path(self.args.workdir) / f"{name}.{variant}.onnx"
        base = {"model": name, "family": family(name), "variant": variant}
        started = time.perf_counter()
        error = _export(self.args, name, variant, src)
        if error:
            seconds = round(time.perf_counter() - started, 1)
            return [{**base, "fused_conv": True, "status": "export-failed", "error": error, "seconds": seconds}]
        rows = []
        for fused in (True, False) if name in NO_FUSED_CONV else (True,):
            row = {**base, "fused_conv": fused}
            if fused and self.server is not None:  # the server emits FusedConv: the same file, turn about first
                self.count += 1
                steps = (lambda: _optimize(self.args, src, True), lambda: self.serve(name, variant, src))
                for step in steps if self.count % 2 else reversed(steps):
                    row.update(step())
                if row.get("upload_s") and row.get("seconds"):
                    row["upload_cli_ratio"] = round(row["upload_s"] / row["seconds"], 2)
                row["served_first"] = self.count % 2 == 0
            else:
                row.update(_optimize(self.args, src, fused))
            rows.append(row)
        return rows

    def serve(self, name: str, variant: str, src: Path) -> dict:
        """Upload, query and compare through the server (started again if an earlier model ended it)."""
        assert self.server is not None
        if not self.server.alive():
            self.server.start()
        served = self.server.check(f"{name}.{variant}", src, self.args.optimizer_timeout + 600)
        return {k: scrub_paths(v) if isinstance(v, str) else v for k, v in served.items()}


def _label(args: argparse.Namespace) -> str:
    return args.label or args.models.replace(",", "+")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", default="classifiers", help="models and groups, comma-separated: " + ", ".join(GROUPS)
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "export-sweep"))
    parser.add_argument("--torch-python", default=sys.executable, help="the torch venv's python (default: this one)")
    parser.add_argument("--service-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per export and per optimizer run")
    parser.add_argument("--serve", action=argparse.BooleanOptionalAction, default=True,
                        help="upload each export to a real server, query it, compare (default on)")
    parser.add_argument("--optimizer-timeout", type=float, default=1800.0, help="the server's optimizer timeout (s)")
    parser.add_argument("--reexport", action="store_true")
    parser.add_argument("--label", default=None, help="the result file's suffix (default: the --models argument)")
    parser.add_argument("--output", help="result JSON (default bench/results/export-sweep-<date>-<label>.json)")
    args = parser.parse_args(argv)
    names = _model_names(args.models)
    date = common.today()
    out = Path(args.output) if args.output else RESULTS / f"export-sweep-{date}-{_label(args)}.json"
    store = Path(args.workdir) / "served-store"
    server = Server(args.service_python, store, args.optimizer_timeout) if args.serve else None
    header = {
        **common.header(packages=()),
        "versions": _versions(args),
        "models": args.models,
        "variants": args.variants.split(","),
        "timeout_s": args.timeout,
        "serve": server.settings if server else None,
        "load_average_start": os.getloadavg(),
    }
    sweep = _Sweep(args, server)
    rows: list[dict] = []
    print(_table([]), flush=True)
    try:
        if server:
            server.start()
        for name in names:
            for variant in args.variants.split(","):
                for row in sweep.model(name, variant):
                    rows.append(row)
                    print(_table([row]).split("\n", 2)[2], flush=True)
                    _write(out, {**header, "load_average_end": os.getloadavg()}, rows)  # a killed sweep keeps its rows
    finally:
        if server:
            server.stop()
    print(_table(rows))
    _write(out, {**header, "load_average_end": os.getloadavg()}, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
