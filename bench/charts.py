"""The key comparisons as charts, drawn from the result files in bench/results/ (and bench/published_figures.json).

    python bench/charts.py [--out DIR]        # default docs/img/; needs matplotlib (extra "charts")

- ``engine-vs-rivals.png``: our engine against PyTorch (eager, manual CUDA graph, torch.compile) and ONNX
  Runtime's defaults, per model at batch 1 and 64 (the batches bench/engine.py times), all from one run;
  TensorRT's published ResNet-50 batch-1 figure (another GPU, fp16) as a hatched bar for context;
- ``service-throughput.png``: images/s by concurrent clients, ours against what the same run measured beside it
  (the GPU run: one process, the workers, the engine's own best rate; the CPU run: the naive server, no
  batching, JSON);
- ``cpu-engines.png``: the CPU engines (ONNX Runtime, OpenVINO standalone and as ORT's EP, what the server
  serves) per model and batch, medians with p10-p90 whiskers.

Every value drawn is read from those files (``*_series`` return exactly what is drawn); a row a chart needs that
the file lacks stops the run with a ``ChartDataError`` naming the file and the row. Each chart's title names
the device and the result file. The files are listed in ``SOURCES``: re-pointing a chart at a newer run is a
one-line change there.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PUBLISHED = ROOT / "bench" / "published_figures.json"
DEFAULT_OUT = ROOT / "docs" / "img"
DPI = 100

SOURCES = {
    "engine": "engine-2026-12-01-h200-bias-sink-auto.json",
    "service_gpu": "service-2026-12-01-cuda-httptools-gather.json",
    "service_cpu": "service-2026-11-30-cpu.json",
    "cpu_engines": "cpu-engines-2026-12-01-xeon-2cores.json",
}
# The workers count is not in the service JSON; the commit that added the run (e539c46) names it.
GPU_WORKERS = 6

ENGINE_MODELS = (("mnv3_2019", "MobileNetV3-Large (2019-style export)"), ("resnet50", "ResNet-50"))
ENGINE_BATCHES = (1, 64)
ENGINE_BARS = (
    ("torch_eager", "PyTorch eager"),
    ("torch_cudagraph", "PyTorch + CUDA graph"),
    ("torch_compile", "torch.compile"),
    ("ort_default", "ORT default"),
    ("ours_fp32", "ours fp32"),
    ("ours_auto", "ours auto"),
)
TENSORRT_FIGURE = "tensorrt_resnet50_fp16_b1"
# (server, series, label): the rows bench/service.py writes; a label starting "ours" is drawn as ours.
SERVICE_GPU_LINES = (
    ("service", "binary", "ours, one process"),
    ("service_workers", "binary", f"ours, {GPU_WORKERS} workers + engine process"),
)
SERVICE_CPU_LINES = (
    ("service", "binary", "ours, binary"),
    ("service_nobatch", "binary", "ours, no batching, binary"),
    ("service", "json", "ours, JSON"),
    ("naive", "json", "naive server (FastAPI + ORT, JSON)"),
)
CPU_MODELS = (("mobilenet_v3_large", "MobileNetV3-Large"), ("resnet50", "ResNet-50"))
CPU_BATCHES = (1, 8)
CPU_ENGINES = (
    ("ort_original", "ORT CPU, original graph"),
    ("ort_optimized", "ORT CPU, our graph"),
    ("ov_f32", "OpenVINO f32"),
    ("ov_f32_ours", "OpenVINO f32, our graph"),
    ("ovep_f32", "OpenVINO EP f32"),
    ("served", "served (fp32)"),
    ("ov_bf16", "OpenVINO bf16"),
    ("ovep_bf16", "OpenVINO EP bf16"),
    ("served_bf16", "served bf16"),
)
OURS_COLOR, RIVAL_COLOR, PUBLISHED_COLOR = "#d95f02", "#7f7f7f", "#1b9e77"


class ChartDataError(ValueError):
    """A result file lacks a value a chart needs (the message names the file and the row)."""


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    low: float | None = None  # p10 (CPU engines' whiskers)
    high: float | None = None  # p90
    published: bool = False  # a figure published by others, not measured here


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    """One result file as JSON; a missing or unreadable file is a ChartDataError naming it."""
    path = results / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ChartDataError(f"cannot read result file {name}: {exc}") from exc


def _row(rows: list[dict[str, Any]], source: str, **match: Any) -> dict[str, Any]:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        what = ", ".join(f"{k}={v}" for k, v in match.items())
        raise ChartDataError(f"{source}: expected one row with {what}, found {len(found)}")
    return found[0]


def _published(figures: dict[str, Any], figure_id: str) -> dict[str, Any]:
    found = [f for f in figures.get("figures", []) if f.get("id") == figure_id]
    if len(found) != 1:
        raise ChartDataError(f"{PUBLISHED.name}: expected one figure with id={figure_id}, found {len(found)}")
    return found[0]


def engine_series(data: dict[str, Any], published: dict[str, Any]) -> dict[tuple[str, int], list[Bar]]:
    """Median ms per (model, batch): the bars of ENGINE_BARS in order, TensorRT's published figure last where
    its model and batch match."""
    trt = _published(published, TENSORRT_FIGURE)
    series: dict[tuple[str, int], list[Bar]] = {}
    for model, _ in ENGINE_MODELS:
        for batch in ENGINE_BATCHES:
            bars = [
                Bar(label, _row(data["rows"], SOURCES["engine"], model=model, batch=batch, engine=engine)["ms"])
                for engine, label in ENGINE_BARS
            ]
            if (trt["model"], trt["batch"]) == (model, batch):
                bars.append(Bar(f"TensorRT fp16, {trt['device']} (published)", trt["latency_ms"], published=True))
            series[(model, batch)] = bars
    return series


def service_series(data: dict[str, Any], lines: tuple[tuple[str, str, str], ...], source: str) -> dict[str, list]:
    """Images/s by concurrency for each (server, series) of ``lines``, at every concurrency the run measured."""
    clients = data["settings"]["concurrency"]
    return {
        label: [(c, _row(data["rows"], source, server=server, series=series, concurrency=c)["throughput"])
                for c in clients]
        for server, series, label in lines
    }


def engine_peak(data: dict[str, Any]) -> tuple[int, float]:
    """The engine's own best images/s in the same run (bucket, img/s): the ceiling the service is held to."""
    throughput = data.get("engine", {}).get("throughput")
    if not throughput:
        raise ChartDataError("service result has no engine throughput")
    bucket = max(throughput, key=throughput.get)
    return int(bucket), float(throughput[bucket])


def cpu_engine_series(data: dict[str, Any]) -> dict[tuple[str, int], list[Bar]]:
    """Median ms with p10/p90 per (model, batch), the engines of CPU_ENGINES in order; an engine the run left out
    (listed in the file's ``unavailable``) is skipped, any other missing row is an error."""
    unavailable = data.get("unavailable", {})
    series: dict[tuple[str, int], list[Bar]] = {}
    for model, _ in CPU_MODELS:
        for batch in CPU_BATCHES:
            bars = []
            for engine, label in CPU_ENGINES:
                if engine in unavailable:
                    continue
                row = _row(data["rows"], SOURCES["cpu_engines"], model=model, batch=batch, engine=engine)
                bars.append(Bar(label, row["median_ms"], row["p10_ms"], row["p90_ms"]))
            series[(model, batch)] = bars
    return series


def _caption(fig: Figure, what: str, data: dict[str, Any], source: str, detail: str = "") -> None:
    fig.suptitle(f"{what}\n{data['device']}{detail}, {data['date']}\nbench/results/{source}", fontsize=10)


def engine_figure(data: dict[str, Any], published: dict[str, Any]) -> Figure:
    """Bars of median latency (ms), one panel per model and batch."""
    series = engine_series(data, published)
    fig = Figure(figsize=(10, 7))
    axes = fig.subplots(len(ENGINE_MODELS), len(ENGINE_BATCHES))
    for row, (model, name) in enumerate(ENGINE_MODELS):
        for col, batch in enumerate(ENGINE_BATCHES):
            _bar_panel(axes[row][col], series[(model, batch)], f"{name}, batch {batch}")
    _caption(fig, "Engine latency, median ms (lower is better)", data, SOURCES["engine"])
    fig.tight_layout()
    return fig


def _color(bar: Bar) -> str:
    if bar.published:
        return PUBLISHED_COLOR
    return OURS_COLOR if bar.label.startswith(("ours", "served")) else RIVAL_COLOR


def _bar_panel(ax, bars: list[Bar], title: str) -> None:
    drawn = ax.bar(range(len(bars)), [b.value for b in bars], color=[_color(b) for b in bars],
                   edgecolor="black", linewidth=0.4)
    for patch, bar in zip(drawn, bars, strict=True):
        if bar.published:
            patch.set_hatch("//")
    ax.bar_label(drawn, labels=[f"{b.value:.3g}" for b in bars], fontsize=7)
    ax.set_xticks(range(len(bars)), [b.label for b in bars], rotation=30, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("ms", fontsize=8)
    ax.margins(y=0.25)


def service_figure(gpu: dict[str, Any], cpu: dict[str, Any]) -> Figure:
    """Images/s by clients: the GPU run (left) and the CPU run with the naive baseline (right)."""
    fig = Figure(figsize=(11, 4.8))
    left, right = fig.subplots(1, 2)
    panels = ((left, gpu, SERVICE_GPU_LINES, "service_gpu"), (right, cpu, SERVICE_CPU_LINES, "service_cpu"))
    for ax, data, lines, key in panels:
        _line_panel(ax, service_series(data, lines, SOURCES[key]), engine_peak(data))
        ax.set_title(f"{data['device']}, {data['date']}\nbench/results/{SOURCES[key]}", fontsize=8)
    fig.suptitle("Service throughput by concurrent clients (demo MobileNetV3-Large, one image per request)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _line_panel(ax, series: dict[str, list], peak: tuple[int, float]) -> None:
    for label, points in series.items():
        xs, ys = zip(*points, strict=True)
        style = {"linestyle": "-"} if label.startswith("ours") else {"linestyle": ":", "color": RIVAL_COLOR}
        ax.plot(xs, ys, marker="o", label=label, **style)
    bucket, rate = peak
    ax.axhline(rate, linestyle="--", color=RIVAL_COLOR, label=f"engine alone, batch {bucket} (same run)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("images/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def cpu_engines_figure(data: dict[str, Any]) -> Figure:
    """Horizontal bars of median ms with p10-p90 whiskers, one panel per model and batch."""
    series = cpu_engine_series(data)
    fig = Figure(figsize=(11, 7))
    axes = fig.subplots(len(CPU_MODELS), len(CPU_BATCHES))
    for row, (model, name) in enumerate(CPU_MODELS):
        for col, batch in enumerate(CPU_BATCHES):
            _hbar_panel(axes[row][col], series[(model, batch)], f"{name}, batch {batch}")
    pinned = f": {len(data['cores'])} pinned cores, {data['threads']} threads"
    _caption(fig, "CPU engines, median ms (lower is better; whiskers p10-p90)", data, SOURCES["cpu_engines"],
             pinned)
    fig.tight_layout()
    return fig


def _hbar_panel(ax, bars: list[Bar], title: str) -> None:
    values = [b.value for b in bars]
    errors = [[b.value - b.low for b in bars], [b.high - b.value for b in bars]]
    drawn = ax.barh(range(len(bars)), values, xerr=errors, color=[_color(b) for b in bars],
                    error_kw={"elinewidth": 0.6, "capsize": 2})
    ax.bar_label(drawn, labels=[f"{v:.3g}" for v in values], fontsize=7, padding=3)
    ax.set_yticks(range(len(bars)), [b.label for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("ms", fontsize=8)
    ax.margins(x=0.2)


def draw_all(out: Path, results: Path = RESULTS, published: Path = PUBLISHED) -> list[Path]:
    """Write the three PNGs into ``out`` (created if missing); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    published_figures = json.loads(published.read_text())
    figures = {
        "engine-vs-rivals.png": engine_figure(load(SOURCES["engine"], results), published_figures),
        "service-throughput.png": service_figure(load(SOURCES["service_gpu"], results),
                                                 load(SOURCES["service_cpu"], results)),
        "cpu-engines.png": cpu_engines_figure(load(SOURCES["cpu_engines"], results)),
    }
    paths = []
    for name, fig in figures.items():
        path = out / name
        fig.savefig(path, dpi=DPI, metadata={"Software": None})  # no version stamp: a redraw changes nothing
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNGs (default docs/img)")
    args = parser.parse_args(argv)
    try:
        paths = draw_all(args.out)
    except ChartDataError as exc:
        print(f"charts: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"{path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
