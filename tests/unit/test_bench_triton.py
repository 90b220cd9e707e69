"""bench/service.py's Triton side: the model repository (config.pbtxt parsed by Triton's own protobuf schema),
the private backend folder, model.py's batching against a stand-in ``triton_python_backend_utils``, Triton's
metrics, the rounds merged into rows, the server groups and the ours/Triton table."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import service, triton_repository  # noqa: E402

INPUTS = [{"name": "input", "datatype": "UINT8", "shape": [-1, 3, 224, 224]}]
OUTPUTS = [{"name": "output", "datatype": "FP32", "shape": [-1, 1000]},
           {"name": "names", "datatype": "BYTES", "shape": [-1, 5]}]


def _parsed(text: str) -> Any:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


# ---------------------------------------------------------------------------------------------- repository
def test_the_config_is_a_python_model_with_our_batching_and_the_served_signature() -> None:
    text = triton_repository.model_config("m", INPUTS, OUTPUTS, max_batch_size=64, max_queue_delay_us=2500,
                                          parameters={"model_dir": "/store", "python_path": "/a:/b"})
    config = _parsed(text)
    assert (config.name, config.backend, config.max_batch_size) == ("m", "python", 64)
    assert config.dynamic_batching.max_queue_delay_microseconds == 2500
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("input", model_config_pb2.TYPE_UINT8, [3, 224, 224])]  # the batch dim is Triton's
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [
        ("output", model_config_pb2.TYPE_FP32, [1000]), ("names", model_config_pb2.TYPE_STRING, [5])]
    assert [(g.count, g.kind) for g in config.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_CPU)]
    assert {k: v.string_value for k, v in config.parameters.items()} == {"model_dir": "/store", "python_path": "/a:/b"}


def test_a_tensor_without_a_batch_dimension_is_refused() -> None:
    with pytest.raises(ValueError, match="'count' has no batch dimension"):
        triton_repository.model_config("m", INPUTS, [{"name": "count", "datatype": "INT64", "shape": [1]}],
                                       max_batch_size=64, max_queue_delay_us=0, parameters={})


def test_the_repository_holds_the_config_and_model_py(tmp_path: Path) -> None:
    folder = triton_repository.write_repository(tmp_path / "repo", "m", INPUTS, OUTPUTS[:1], max_batch_size=8,
                                                max_queue_delay_us=0, parameters={"device": "cpu"})
    assert folder == tmp_path / "repo" / "m"
    assert _parsed((folder / "config.pbtxt").read_text()).max_batch_size == 8
    assert (folder / "1" / "model.py").read_bytes() == triton_repository.MODEL_SOURCE.read_bytes()


def _fake_install(root: Path, versions: Sequence[str]) -> triton_repository.TritonInstall:
    tree = root / "pytriton" / "tritonserver"
    (tree / "bin").mkdir(parents=True)
    (tree / "bin" / "tritonserver").write_text("binary")
    (tree / "backends" / "python").mkdir(parents=True)
    (tree / "backends" / "python" / "libtriton_python.so").write_text("backend")
    (tree / "backends" / "python" / "triton_python_backend_utils.py").write_text("utils")
    for version in versions:
        (tree / "python_backend_stubs" / version).mkdir(parents=True)
        (tree / "python_backend_stubs" / version / "triton_python_backend_stub").write_text(f"stub {version}")
    return triton_repository.TritonInstall(tree)


def test_the_backend_folder_puts_this_pythons_stub_beside_the_backend(tmp_path: Path) -> None:
    install = _fake_install(tmp_path / "wheel", ["3.11", "3.12"])
    dest = triton_repository.backend_directory(install, tmp_path / "backends", (3, 12))
    python = dest / "python"
    assert (python / "triton_python_backend_stub").read_text() == "stub 3.12"
    assert (python / "libtriton_python.so").read_text() == "backend"
    assert (python / "triton_python_backend_utils.py").exists()
    assert install.libraries == tmp_path / "wheel" / "nvidia_pytriton.libs"
    with pytest.raises(FileNotFoundError, match=r"no Python backend stub for Python 3\.7"):
        triton_repository.backend_directory(install, tmp_path / "other", (3, 7))


def test_the_install_is_found_only_with_the_binary_and_this_pythons_stub(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install = _fake_install(tmp_path, [f"{sys.version_info[0]}.{sys.version_info[1]}"])
    spec = types.SimpleNamespace(submodule_search_locations=[str(install.root.parent)])
    monkeypatch.setattr(triton_repository.importlib.util, "find_spec", lambda name: spec)
    assert triton_repository.TritonInstall.find() == install
    install.binary.unlink()
    assert triton_repository.TritonInstall.find() is None
    monkeypatch.setattr(triton_repository.importlib.util, "find_spec", lambda name: None)
    assert triton_repository.TritonInstall.find() is None


def test_the_stub_environment_and_import_path(tmp_path: Path) -> None:
    install = _fake_install(tmp_path, [])
    env = triton_repository.triton_env(install, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/cuda"})
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)  # its python3 gives the stub its prefix
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(install.libraries)
    assert env["LD_LIBRARY_PATH"].endswith(":/cuda")
    path = triton_repository.python_path(tmp_path).split(":")
    assert path[0] == str(tmp_path)
    assert len(path) == len(set(path))


# ---------------------------------------------------------------------------------------------- model.py
class _Tensor:
    """A stand-in for pb_utils.Tensor: DLPack both ways, like the stub's."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    @classmethod
    def from_dlpack(cls, name: str, value: Any) -> _Tensor:
        return cls(name, np.from_dlpack(value))

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.array.__dlpack_device__()

    def as_numpy(self) -> np.ndarray:  # model.py must not use it: the wheel's stub reads numpy 2 wrongly
        raise AssertionError("as_numpy() called")


class _Response:
    def __init__(self, output_tensors: Sequence[_Tensor], error: Any = None) -> None:
        self.output_tensors, self.error = list(output_tensors), error


class _Error:
    def __init__(self, message: str) -> None:
        self.message = message


@pytest.fixture
def model_py(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    fake = types.ModuleType("triton_python_backend_utils")
    fake.Tensor = _Tensor
    fake.InferenceResponse = _Response
    fake.TritonError = _Error
    fake.get_input_tensor_by_name = lambda request, name: request[name]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "bench.triton_model", raising=False)
    yield importlib.import_module("bench.triton_model")
    sys.modules.pop("bench.triton_model", None)


def _requests(rows: Sequence[int]) -> list[dict[str, _Tensor]]:
    rng = np.random.default_rng(0)
    return [{"x": _Tensor("x", rng.standard_normal((n, 2, 3)).astype(np.float32))} for n in rows]


def test_a_batch_of_requests_runs_as_one_call_and_each_gets_its_rows(model_py: types.ModuleType) -> None:
    calls: list[list[Mapping[str, np.ndarray]]] = []

    def run_parts(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        calls.append(list(parts))
        x = np.concatenate([p["x"] for p in parts])
        return {"sum": x.sum(axis=(1, 2)), "double": x * 2}

    requests = _requests([1, 3, 2])
    responses = model_py.batched_responses(run_parts, requests, ["x"], ["double", "sum"])
    assert len(calls) == 1 and [part["x"].shape[0] for part in calls[0]] == [1, 3, 2]
    for request, response in zip(requests, responses, strict=True):
        x = request["x"].array
        assert response.error is None
        assert [t.name for t in response.output_tensors] == ["double", "sum"]
        np.testing.assert_array_equal(response.output_tensors[0].array, x * 2)
        np.testing.assert_allclose(response.output_tensors[1].array, x.sum(axis=(1, 2)), rtol=1e-6)


def test_a_failed_batch_answers_every_request_with_the_error(model_py: types.ModuleType) -> None:
    def run_parts(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        raise RuntimeError("engine is closed")

    responses = model_py.batched_responses(run_parts, _requests([1, 2]), ["x"], ["sum"])
    assert [(r.output_tensors, r.error.message) for r in responses] == [([], "RuntimeError: engine is closed")] * 2
    missing = model_py.batched_responses(run_parts, _requests([1]), ["y"], ["sum"])
    assert "KeyError" in missing[0].error.message


def test_only_numpys_capsule_report_is_dropped(model_py: types.ModuleType) -> None:
    seen: list[Any] = []
    hook = model_py.quiet_capsule_errors(seen.append)
    capsule = types.SimpleNamespace(exc_value=ValueError("PyCapsule_GetPointer called with incorrect name"))
    other = types.SimpleNamespace(exc_value=ValueError("something else"))
    hook(capsule)
    hook(other)
    assert seen == [other]


def test_the_benchmarks_import_path_comes_first_in_its_order(model_py: types.ModuleType) -> None:
    assert model_py.import_path(["/root", "/site", "/root"], ["/stub-site", "/site", "/model"]) == [
        "/root", "/site", "/stub-site", "/model"]
    config = {"parameters": {"device": {"string_value": "cpu"}}}
    assert model_py.parameters(config) == {"device": "cpu"}


# ---------------------------------------------------------------------------------------------- metrics
TRITON_METRICS = """\
# HELP nv_inference_count Number of inferences performed
nv_inference_request_success{model="mobilenet_v3_large",version="1"} 40
nv_inference_request_success{model="other",version="1"} 7
nv_inference_count{model="mobilenet_v3_large",version="1"} 40
nv_inference_exec_count{model="mobilenet_v3_large",version="1"} 10
nv_inference_count{model="other",version="1"} 99
nv_inference_request_duration_us{model="mobilenet_v3_large",version="1"} 200000
nv_inference_queue_duration_us{model="mobilenet_v3_large",version="1"} 40000
nv_inference_compute_input_duration_us{model="mobilenet_v3_large",version="1"} 4000
nv_inference_compute_infer_duration_us{model="mobilenet_v3_large",version="1"} 120000
nv_inference_compute_output_duration_us{model="mobilenet_v3_large",version="1"} 8000
"""


def test_triton_counters_and_stage_times_of_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    assert triton_repository.batch_counts(TRITON_METRICS, "mobilenet_v3_large") == (40.0, 10.0)
    assert triton_repository.batch_counts(TRITON_METRICS, "absent") is None
    seen: list[str] = []

    def get(url: str, timeout: float) -> httpx.Response:
        seen.append(url)
        return httpx.Response(200, text=TRITON_METRICS)

    monkeypatch.setattr(service.httpx, "get", get)
    server = service.Server("triton", ["x"], {}, "/", Path("log"), port=1, metrics_port=2, metrics_dialect="triton")
    counters = service.server_counters(server)
    assert counters is not None and (counters.samples, counters.calls) == (40.0, 10.0)
    assert seen == ["http://127.0.0.1:2/metrics"]  # Triton's metrics port, not its HTTP port
    means = service.timing_means_ms(service.timing_delta(
        {part: [0.0, 0.0] for part in triton_repository.TIMING_PARTS}, service.server_timing_of(server)))
    assert means == pytest.approx({"request": 5.0, "queue": 1.0, "compute_input": 0.1, "compute_infer": 3.0,
                                   "compute_output": 0.2})
    none = service.Server("naive", ["x"], {}, "/", Path("log"), port=1, metrics_dialect="none")
    assert service.server_counters(none) is None and service.server_timing_of(none) is None


# ---------------------------------------------------------------------------------------------- rows
def _measured(requests: int, latency_ms: float, samples: float, calls: float, cores: float) -> service.Measured:
    point = service.PointResult(requests, 0, 2.0, [latency_ms] * requests)
    counters = service.BatchCounters(samples, calls, {1.0: calls / 2, 4.0: calls})
    cpu = {"server_cores": cores, "server_processes": 2, "engine_process_cores": None}
    return service.Measured(point, counters, cpu, {"request": [requests * latency_ms / 1e3, requests]})


def test_rounds_are_pooled_into_one_row() -> None:
    payload = service.binary_payload("m", "input", "output", np.zeros((1, 3), np.float32), 4)
    eng = service.EngineTable("cpu", {"buckets": [1, 4]}, {1: 1.0, 4: 2.0}, {1: 1.0, 4: 2.0}, None)
    row = service.merged_row("triton", payload, 8, [_measured(100, 1.0, 100, 40, 0.5),
                                                   _measured(300, 3.0, 300, 80, 1.5)], eng)
    assert row["throughput"] == pytest.approx(400 / 4.0)  # all requests over all measured seconds
    assert row["round_throughputs"] == [50.0, 150.0]
    assert row["p50_ms"] == pytest.approx(3.0)  # latencies pooled: 300 of the 400 took 3 ms
    assert row["mean_batch"] == pytest.approx(400 / 120)
    assert row["cpu"]["server_cores"] == pytest.approx(1.0) and row["cpu"]["server_processes"] == 2
    assert row["server_mean_ms"] == {"request": pytest.approx((100 * 1.0 + 300 * 3.0) / 400)}
    summed = service.BatchCounters(1, 1, {1.0: 1.0}).plus(service.BatchCounters(2, 1, {4.0: 1.0}))
    assert (summed.samples, summed.calls, summed.cumulative) == (3, 2, {1.0: 1.0, 4.0: 1.0})


def test_triton_and_our_servers_run_together_where_triton_is_listed() -> None:
    assert service.server_groups(["client_ceiling", "service", "naive", "triton", "service_workers"]) == [
        ["client_ceiling"], ["service", "triton", "service_workers"], ["naive"]]
    assert service.server_groups(["service", "service_workers"]) == [["service"], ["service_workers"]]


def _row(server: str, series: str, concurrency: int, throughput: float, p50: float) -> dict[str, Any]:
    return {"server": server, "series": series, "concurrency": concurrency, "throughput": throughput,
            "p50_ms": p50, "p99_ms": p50 * 2, "mean_batch": 1.0}


def test_the_table_puts_each_of_our_rows_beside_tritons() -> None:
    rows = [_row("triton", "binary", 8, 100.0, 10.0), _row("service", "binary", 8, 150.0, 5.0),
            _row("service_workers", "binary", 8, 50.0, 20.0), _row("service", "binary", 64, 300.0, 40.0),
            _row("naive", "json", 8, 10.0, 90.0), _row("triton", "grpc_sync", 1, 200.0, 4.0),
            _row("service", "grpc_sync", 1, 100.0, 8.0)]
    table = service.triton_ratios(rows)
    assert [(e["server"], e["series"], e["concurrency"]) for e in table] == [
        ("service", "binary", 8), ("service", "grpc_sync", 1), ("service_workers", "binary", 8)]
    first = table[0]
    assert (first["ours_throughput"], first["triton_throughput"], first["throughput_ratio"]) == (150.0, 100.0, 1.5)
    assert (first["p50_ms_ratio"], first["p99_ms_ratio"]) == (0.5, 0.5)
    assert table[1]["throughput_ratio"] == 0.5 and table[2]["p50_ms_ratio"] == 2.0
    assert service.triton_ratios([r for r in rows if r["server"] != "triton"]) == []
