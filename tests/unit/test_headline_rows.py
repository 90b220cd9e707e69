"""The headline figures (README.md's table and docs/benchmarks.md's "Headline figures") say what they compared:
a comparison with Triton names the Triton that ran (its Python backend serving our engine: its ONNX Runtime
backend cannot be installed on the GPU host), a batch-64 figure measured before the fused-op library existed says
so, and each page gives a batch-64 figure of a run with the library built, as the image ships."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEFORE_LIBRARY = "engine-2026-12-01-h200-bias-sink-auto.json"
WITH_LIBRARY = "engine-2026-12-06-h100-per-bucket.json"


def _headline_rows() -> list[tuple[str, str]]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("<!-- headline figures", 1)[1].split("\n\n", 1)[0]
    bench = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").split("## Headline figures", 1)[1]
    rows = [("README.md", line) for line in table.splitlines() if line.startswith("| ")]
    rows += [("docs/benchmarks.md", line) for line in bench.split("\n\n")[2].splitlines() if line.startswith("| ")]
    assert len(rows) > 10, rows
    return rows


def test_every_comparison_with_triton_names_its_python_backend() -> None:
    compared = [(page, row) for page, row in _headline_rows() if "Triton" in row]
    assert len(compared) >= 3
    for page, row in compared:
        assert "Python backend" in row, (page, row)


def test_the_batch_64_auto_figure_says_it_predates_the_fused_op_library() -> None:
    for page, row in _headline_rows():
        if "batch 64" in row.lower() and "auto" in row and BEFORE_LIBRARY in row:
            assert "before the fused-op library" in row, (page, row)
    for page in ("README.md", "docs/benchmarks.md"):
        assert any(WITH_LIBRARY in row and "batch 64" in row.lower() for p, row in _headline_rows() if p == page)
