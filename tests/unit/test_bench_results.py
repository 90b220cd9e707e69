"""Every result file that the docs, the benchmarks, the code or the deployment files name is in bench/results/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
# a dated result file name: <name>-YYYY-MM-DD[-label].json|log
NAME = re.compile(r"\b[a-z0-9]+(?:-[a-z0-9]+)*-20\d\d-\d\d-\d\d(?:-[a-z0-9]+)*\.(?:json|log)\b")
SCOPE = ("README.md", "loadtests/*.md", "docs/**/*.md", "bench/*.md", "bench/*.py", "bench/*.sh", "service/**/*.py",
         "kernels/**/*.md", "kernels/**/*.py", "docker/**/*.yaml", "docker/**/*.yml")


def cited_names() -> dict[str, set[str]]:
    """Result file name -> the files (relative to the repository) that name it."""
    cited: dict[str, set[str]] = {}
    for pattern in SCOPE:
        for path in ROOT.glob(pattern):
            for name in NAME.findall(path.read_text(errors="replace")):
                cited.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return cited


def test_the_scan_finds_the_citations_it_should() -> None:
    cited = cited_names()
    assert "engine-2026-12-01-h200-bias-sink-auto.json" in cited  # docs/benchmarks.md and bench/charts.py
    assert "docs/benchmarks.md" in cited["engine-2026-12-01-h200-bias-sink-auto.json"]
    assert len(cited) >= 40


def test_every_cited_result_file_exists() -> None:
    missing = {name: sorted(where) for name, where in cited_names().items() if not (RESULTS / name).is_file()}
    assert not missing, f"cited but not in bench/results/: {missing}"
