"""Triton Inference Server beside ours (bench/service.py's ``triton`` server): binary, model repository, metrics.

The server is Triton's own C++ ``tritonserver`` as the ``nvidia-pytriton`` wheel ships it (the optional ``bench``
extra; ``pytriton/tritonserver/bin/tritonserver``), not the PyTriton proxy. The model is a Python-backend
model (bench/triton_model.py, copied as ``model.py``) that loads the SAME stored, optimized ONNX variant with the
SAME engine code our server uses (``load_served_engine``: provider, IO binding, CUDA graphs, buckets, the tuner's
stored choice), so that the two servers differ only in what sits in front of the engine: HTTP/gRPC front end,
dynamic batcher, and (Triton's) the stub process the Python backend talks to through shared memory.

- ``TritonInstall.find()``: the wheel's server tree, or None where the wheel is not installed.
- ``backend_directory``: a private copy of the Python backend with the stub for this Python beside it (the
  backend looks for ``triton_python_backend_stub`` next to ``libtriton_python.so``; the wheel keeps the stubs
  per Python version elsewhere), so the installed wheel is never modified.
- ``model_config`` / ``write_repository``: ``config.pbtxt`` with ``max_batch_size`` and
  ``dynamic_batching { max_queue_delay_microseconds }`` equal to our batcher's, the served signature, and the
  parameters model.py needs to find the stored model.
- ``triton_command`` / ``triton_env`` / ``python_path``: the command line (HTTP, gRPC and metrics ports on
  loopback), the environment the stub's embedded Python needs, and the import path model.py takes on.
- ``batch_counts`` / ``timing_totals``: Triton's Prometheus counters (inferences and executions per model,
  cumulative microseconds per stage) as bench/service.py reads ours.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MODEL_SOURCE = Path(__file__).resolve().parent / "triton_model.py"
"""What becomes ``<repository>/<model>/1/model.py``."""
SHM_BYTES = 16 << 20
"""The Python backend's shared-memory region per model instance (and each growth step): a batch of 64 demo images
is 9.6 MB in and 256 KB out; the backend's 1 MB default would grow in 1 MB steps. 16 MiB fits Docker's 64 MB
/dev/shm."""
_CONFIG_TYPES = {"BYTES": "TYPE_STRING"}
"""KServe V2 datatypes whose config.pbtxt name is not ``TYPE_<datatype>``."""


@dataclasses.dataclass(frozen=True)
class TritonInstall:
    """The ``tritonserver`` tree inside an installed ``nvidia-pytriton`` wheel."""

    root: Path

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def libraries(self) -> Path:
        """The wheel's bundled shared libraries (libcudart, ...): the binary finds them through its RPATH, a stub
        copied elsewhere through LD_LIBRARY_PATH."""
        return self.root.parent.parent / "nvidia_pytriton.libs"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    def stub(self, version: tuple[int, int] = sys.version_info[:2]) -> Path:
        """The Python backend's stub built for this Python (the wheel carries 3.8 to 3.13)."""
        return self.root / "python_backend_stubs" / f"{version[0]}.{version[1]}" / "triton_python_backend_stub"

    @classmethod
    def find(cls) -> TritonInstall | None:
        """The installed wheel's tree (found without importing ``pytriton``, whose own dependencies the binary
        does not need), or None where it is missing or lacks the binary or the stub for this Python."""
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            return None
        install = cls(Path(next(iter(spec.submodule_search_locations))) / "tritonserver")
        if not (install.binary.is_file() and install.stub().is_file() and install.python_backend.is_dir()):
            return None
        return install


def backend_directory(install: TritonInstall, dest: Path, version: tuple[int, int] = sys.version_info[:2]) -> Path:
    """``dest/python``: the wheel's Python backend (library and ``triton_python_backend_utils.py``) with the stub
    for ``version`` beside it; returns ``dest`` (tritonserver's ``--backend-directory``)."""
    python = dest / "python"
    python.mkdir(parents=True, exist_ok=True)
    for item in install.python_backend.iterdir():
        if item.is_file():
            shutil.copy2(item, python / item.name)
    stub = install.stub(version)
    if not stub.is_file():
        raise FileNotFoundError(f"the nvidia-pytriton wheel has no Python backend stub for Python "
                                f"{version[0]}.{version[1]}")
    shutil.copy2(stub, python / stub.name)
    return dest


def config_type(datatype: str) -> str:
    """A KServe V2 datatype (``UINT8``, ``FP32``, ``BYTES``) as config.pbtxt names it."""
    return _CONFIG_TYPES.get(datatype, f"TYPE_{datatype}")


def _tensors(kind: str, specs: Sequence[Mapping[str, Any]]) -> list[str]:
    """``input [...]`` / ``output [...]`` entries: per-sample dims (the batch dim is Triton's, by max_batch_size)."""
    entries = []
    for spec in specs:
        dims = ", ".join(str(int(d)) for d in spec["shape"][1:])
        entries.append(f'  {{\n    name: "{spec["name"]}"\n    data_type: {config_type(spec["datatype"])}\n'
                       f"    dims: [ {dims} ]\n  }}")
    return [f"{kind} [", ",\n".join(entries), "]"]


def model_config(
    name: str,
    inputs: Sequence[Mapping[str, Any]],
    outputs: Sequence[Mapping[str, Any]],
    *,
    max_batch_size: int,
    max_queue_delay_us: int,
    parameters: Mapping[str, str],
) -> str:
    """config.pbtxt of a Python-backend model with Triton's dynamic batcher, one instance (our server runs one
    engine call at a time per model and process), inputs and outputs as KServe V2 metadata lists them
    (``{"name", "datatype", "shape"}``, the shape with its batch dim first). The instance is KIND_CPU on a GPU
    too: Triton hands the stub host tensors and our engine copies them to the device itself, as in our server."""
    for spec in (*inputs, *outputs):
        if not spec["shape"] or int(spec["shape"][0]) != -1:
            raise ValueError(f"tensor {spec['name']!r} has no batch dimension: Triton's batcher cannot batch it")
    lines = [
        f'name: "{name}"',
        'backend: "python"',
        f"max_batch_size: {int(max_batch_size)}",
        "dynamic_batching {",
        f"  max_queue_delay_microseconds: {int(max_queue_delay_us)}",
        "}",
        *_tensors("input", inputs),
        *_tensors("output", outputs),
        "instance_group [ { count: 1, kind: KIND_CPU } ]",
    ]
    for key, value in parameters.items():
        lines.append(f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


def write_repository(
    repository: Path,
    name: str,
    inputs: Sequence[Mapping[str, Any]],
    outputs: Sequence[Mapping[str, Any]],
    *,
    max_batch_size: int,
    max_queue_delay_us: int,
    parameters: Mapping[str, str],
) -> Path:
    """``repository/name/{config.pbtxt, 1/model.py}``; returns the model's folder. ``parameters`` reach model.py
    through the model config (model_dir, model_name, device, python_path)."""
    folder = repository / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    text = model_config(name, inputs, outputs, max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us,
                        parameters=parameters)
    (folder / "config.pbtxt").write_text(text)
    shutil.copy2(MODEL_SOURCE, folder / "1" / "model.py")
    return folder


def triton_command(install: TritonInstall, repository: Path, backends: Path, *, grpc_port: int,
                   metrics_port: int) -> list[str]:
    """tritonserver on loopback (the HTTP port comes last, ``--http-port N``, from bench/service.py's Server),
    quiet, the model config as written (no auto-complete), and the Python backend's shared memory."""
    return [
        str(install.binary),
        f"--model-repository={repository}",
        f"--backend-directory={backends}",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--disable-auto-complete-config",
        "--exit-on-error=true",
        "--log-verbose=0",
        f"--backend-config=python,shm-default-byte-size={SHM_BYTES}",
        f"--backend-config=python,shm-growth-byte-size={SHM_BYTES}",
    ]


def triton_env(install: TritonInstall, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of tritonserver and so of its stub: this interpreter's folder first on PATH (the stub
    embeds the matching libpython and takes its prefix, a venv's site-packages included, from the ``python3``
    it finds there), and on LD_LIBRARY_PATH the wheel's libraries (the copied stub's RPATH no longer reaches
    them) and this Python's library folder (a Python built outside the system keeps libpython there)."""
    env = dict(base)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), base.get("PATH")) if p)
    libraries = [str(install.libraries), sysconfig.get_config_var("LIBDIR"), base.get("LD_LIBRARY_PATH")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libraries if p)
    return env


def python_path(project_root: Path) -> str:
    """What model.py puts in front of the stub's import path: this project's root, then this interpreter's path
    (PYTHONPATH entries such as the GPU machine's package folder included), as one os.pathsep-joined string."""
    paths = [str(project_root), *(p for p in sys.path if p and Path(p).is_dir())]
    return os.pathsep.join(dict.fromkeys(paths))


_METRIC = re.compile(r"^(nv_inference_[a-z_]+)\{([^}]*)\}\s+([0-9.eE+-]+)\s*$")
TIMING_PARTS = {
    "request": "nv_inference_request_duration_us",
    "queue": "nv_inference_queue_duration_us",
    "compute_input": "nv_inference_compute_input_duration_us",
    "compute_infer": "nv_inference_compute_infer_duration_us",
    "compute_output": "nv_inference_compute_output_duration_us",
}
"""Triton's cumulative microseconds per successful request: from arrival to answer; waiting in the batcher;
copying inputs to the backend (for the Python backend: into the stub's shared memory); the model's execute()
(our engine, inside the stub, with the stub round trip); taking the outputs back."""


def _counters(text: str, model: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match and f'model="{model}"' in match.group(2):
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(3))
    return values


def batch_counts(text: str, model: str) -> tuple[float, float] | None:
    """(inferences, executions) of ``model`` so far from Triton's /metrics: samples and batches its backend ran;
    None where absent."""
    values = _counters(text, model)
    if "nv_inference_count" not in values or "nv_inference_exec_count" not in values:
        return None
    return values["nv_inference_count"], values["nv_inference_exec_count"]


def timing_totals(text: str, model: str) -> dict[str, list[float]]:
    """[seconds, requests] so far per part (``TIMING_PARTS``), as bench/service.py's ``server_timing`` gives ours."""
    values = _counters(text, model)
    count = values.get("nv_inference_request_success", 0.0)
    return {part: [values.get(metric, 0.0) / 1e6, count] for part, metric in TIMING_PARTS.items()}
