"""bench/charts.py on the real result files: three valid PNGs, and what each chart draws is what the JSON holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import charts  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _row(rows: list[dict], **match) -> dict:
    (row,) = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return row


def test_main_writes_three_small_valid_pngs(tmp_path: Path) -> None:
    assert charts.main(["--out", str(tmp_path)]) == 0
    for name in ("engine-vs-rivals.png", "service-throughput.png", "cpu-engines.png"):
        path = tmp_path / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        assert path.stat().st_size < 150_000, name
        height, width, _ = imread(path).shape
        assert width >= 800 and height >= 400, (name, width, height)


def test_engine_bars_are_the_json_medians() -> None:
    data = _json(charts.SOURCES["engine"])
    published = json.loads((ROOT / "bench" / "published_figures.json").read_text())
    fig = charts.engine_figure(data, published)
    engines = [e for e, _ in charts.ENGINE_BARS]
    for ax, (model, batch) in zip(fig.axes, [(m, b) for m, _ in charts.ENGINE_MODELS for b in (1, 64)], strict=True):
        want = [_row(data["rows"], model=model, batch=batch, engine=e)["ms"] for e in engines]
        if (model, batch) == ("resnet50", 1):
            want.append(0.267)  # TensorRT's published ResNet-50 fp16 batch 1
        heights = [patch.get_height() for patch in ax.patches]
        assert heights == pytest.approx(want, rel=1e-12), (model, batch)
        assert str(batch) in ax.get_title()
    assert "engine-2026-12-01-h200-bias-sink-auto.json" in fig._suptitle.get_text()
    assert "H200" in fig._suptitle.get_text()


def test_service_lines_are_the_json_throughputs() -> None:
    gpu, cpu = _json(charts.SOURCES["service_gpu"]), _json(charts.SOURCES["service_cpu"])
    fig = charts.service_figure(gpu, cpu)
    panels = ((fig.axes[0], gpu, charts.SERVICE_GPU_LINES), (fig.axes[1], cpu, charts.SERVICE_CPU_LINES))
    for ax, data, lines in panels:
        drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
        for server, series, label in lines:
            xs, ys = drawn[label]
            assert xs == [1, 8, 32, 64]
            want = [_row(data["rows"], server=server, series=series, concurrency=c)["throughput"] for c in xs]
            assert ys == pytest.approx(want, rel=1e-12), label
        engine_line = next(v for k, v in drawn.items() if k.startswith("engine alone"))
        assert engine_line[1][0] == pytest.approx(max(data["engine"]["throughput"].values()))
    # the headline point: 6 workers at 64 clients
    assert charts.service_series(gpu, charts.SERVICE_GPU_LINES, "x")["ours, 6 workers + engine process"][-1][1] == (
        pytest.approx(7172.33, abs=0.01))


def test_cpu_engine_bars_and_whiskers_are_the_json_rows() -> None:
    data = _json(charts.SOURCES["cpu_engines"])
    fig = charts.cpu_engines_figure(data)
    keys = [(m, b) for m, _ in charts.CPU_MODELS for b in charts.CPU_BATCHES]
    for ax, (model, batch) in zip(fig.axes, keys, strict=True):
        rows = [_row(data["rows"], model=model, batch=batch, engine=e) for e, _ in charts.CPU_ENGINES]
        assert [p.get_width() for p in ax.patches] == pytest.approx([r["median_ms"] for r in rows], rel=1e-12)
        bars = charts.cpu_engine_series(data)[(model, batch)]
        assert [(b.low, b.high) for b in bars] == [(r["p10_ms"], r["p90_ms"]) for r in rows]


def test_a_missing_row_is_named() -> None:
    data = _json(charts.SOURCES["engine"])
    data["rows"] = [r for r in data["rows"] if not (r["engine"] == "ours_auto" and r["model"] == "resnet50")]
    published = json.loads((ROOT / "bench" / "published_figures.json").read_text())
    with pytest.raises(charts.ChartDataError, match="engine=ours_auto"):
        charts.engine_series(data, published)


def test_an_unreadable_result_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(charts.ChartDataError, match=r"broken\.json"):
        charts.load("broken.json", tmp_path)
