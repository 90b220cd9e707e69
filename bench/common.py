"""Shared benchmark helpers: the run's environment, result files and tables.

Every benchmark writes ``bench/results/<name>-<date>.json`` with the same header
(``device``, ``date``, ``commit``, ``versions``) so results from different runs and machines can be
compared, and prints a plain table last (a GPU machine's reply carries only the end of the output).
Nothing here imports torch or onnxruntime: versions come from modules already imported or from
package metadata.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_PACKAGES = ("numpy", "onnx", "onnxruntime", "onnx_graphsurgeon", "torch", "torchvision")
# Distribution names to try when a module is not imported yet (first one installed wins).
_DISTRIBUTIONS = {
    "onnxruntime": ("onnxruntime-gpu", "onnxruntime"),
    "onnx_graphsurgeon": ("onnx-graphsurgeon", "onnx_graphsurgeon"),
}


def today() -> str:
    """UTC date as YYYY-MM-DD (the result file's suffix)."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")


def git_commit(repo: Path | None = None) -> str:
    """HEAD's commit hash, with ``-dirty`` when tracked files differ; ``unknown`` outside git.

    ``GIT_COMMIT`` in the environment wins: a run from an exported snapshot (the GPU machine) names the
    commit it was exported from, since git there would find an unrelated checkout around it."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    cwd = repo or Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GIT_COMMIT", "unknown")
    return f"{head}-dirty" if dirty else head


def package_version(name: str) -> str | None:
    """Version of a package: from the imported module when it is loaded, else from package metadata.

    The imported module wins because a machine can hold two distributions of one module (the GPU
    machine has a CPU ``onnxruntime`` and an ``onnxruntime-gpu`` earlier on the path).
    """
    module = sys.modules.get(name)
    version = getattr(module, "__version__", None) if module is not None else None
    if version:
        return str(version)
    for dist in _DISTRIBUTIONS.get(name, (name,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def package_versions(names: Iterable[str] = DEFAULT_PACKAGES) -> dict[str, str]:
    """``{name: version}`` for the installed ones, plus python."""
    versions = {"python": platform.python_version()}
    for name in names:
        version = package_version(name)
        if version:
            versions[name] = version
    return versions


def cpu_name() -> str:
    """The host CPU's model name (Linux), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name(device_id: int = 0) -> str | None:
    """The GPU's name from torch (when imported) or nvidia-smi; None without a GPU."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return str(torch.cuda.get_device_name(device_id))
        except Exception:  # a broken CUDA setup must not break result writing
            pass
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={device_id}", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        return out or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_description(device_id: int = 0) -> str:
    """``"NVIDIA H200 (GPU 0), <cpu>, N cores"`` or ``"CPU only: <cpu>, N cores"``."""
    host = f"{cpu_name()}, {os.cpu_count()} cores"
    gpu = gpu_name(device_id)
    return f"{gpu} (GPU {device_id}), {host}" if gpu else f"CPU only: {host}"


def fused_ops_library(setting: str) -> str | None:
    """The fused-op library file a ``--fused-ops-library`` value names, by the server's own rule
    (``SERVICE_FUSED_OPS_LIBRARY``: auto, off or a path)."""
    from service.settings import ServiceSettings

    return ServiceSettings(fused_ops_library=setting, demo_model=False).fused_ops_library_file


def header(*, packages: Iterable[str] = DEFAULT_PACKAGES, device_id: int = 0) -> dict[str, Any]:
    """The fields every result file starts with."""
    return {
        "device": device_description(device_id),
        "date": today(),
        "commit": git_commit(),
        "versions": package_versions(packages),
    }


def _json_default(value: Any) -> Any:
    """Make numpy scalars/arrays, paths and sets JSON-able."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def write_result(
    name: str,
    payload: Mapping[str, Any],
    *,
    results_dir: Path | None = None,
    head: Mapping[str, Any] | None = None,
    path: Path | None = None,
) -> Path:
    """Write ``<results_dir>/<name>-<date>.json`` = header + payload; returns the path.

    ``head`` overrides the header (e.g. one computed before a long run); ``path`` overrides the file name.
    """
    document = dict(head if head is not None else header())
    document.update(payload)
    if path is None:
        directory = results_dir or RESULTS_DIR
        path = directory / f"{name}-{document.get('date') or today()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, default=_json_default, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def median(values: Sequence[float]) -> float:
    """Median; NaN for an empty sequence."""
    return float(statistics.median(values)) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) by linear interpolation; NaN for an empty sequence."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (pos - low))


def _cell(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    *,
    titles: Mapping[str, str] | None = None,
    digits: int = 3,
) -> str:
    """A Markdown table of ``rows`` (dicts) over ``columns``; missing values print as ``-``."""
    titles = titles or {}
    head = [titles.get(c, c) for c in columns]
    body = [[_cell(row.get(c), digits) for c in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out.extend(line(r) for r in body)
    return "\n".join(out)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *, title: str | None = None,
                titles: Mapping[str, str] | None = None, digits: int = 3) -> None:
    """Print ``format_table`` with an optional title line, flushed."""
    if title:
        print(f"\n{title}")
    print(format_table(rows, columns, titles=titles, digits=digits), flush=True)


def capture_cuda_graph(model: Any, x: Any) -> tuple[Any, Any, Any]:
    """Manual torch.cuda.CUDAGraph capture of ``model(x)`` (warm-up on a side stream first, as PyTorch's
    docs do). Returns ``(graph, static_x, static_y)``: ``graph.replay()`` reads ``static_x`` and writes
    ``static_y``, so keep all three alive while replaying. torch is imported here, not at module level."""
    import torch

    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    return graph, static_x, static_y
