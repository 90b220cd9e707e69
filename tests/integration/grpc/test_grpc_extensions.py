"""Triton's statistics and model-repository extensions through ``tritonclient.http`` AND ``tritonclient.grpc``
unchanged, the admin token on both protocols, and the extensions this server does not implement."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from grpc_kit import put_model, start
from inprocess import AUTH, OCTET, TOKEN
from threaded_server import ThreadedServer
from tritonclient.utils import InferenceServerException

from service.dataplane import DISABLED_MESSAGE

GRPC_AUTH = {"authorization": f"Bearer {TOKEN}"}


def clients(server: ThreadedServer) -> tuple[httpclient.InferenceServerClient, grpcclient.InferenceServerClient]:
    return (httpclient.InferenceServerClient(server.url.removeprefix("http://")),
            grpcclient.InferenceServerClient(server.grpc_target))


def tensor(module: object, batch: int = 1, shape: tuple[int, ...] = (3, 8, 8)) -> object:
    x = np.random.default_rng(batch).normal(size=(batch, *shape)).astype(np.float32)
    t = module.InferInput("input", list(x.shape), "FP32")  # type: ignore[attr-defined]
    t.set_data_from_numpy(x)
    return t


def as_ints(value: object) -> object:
    """protobuf's JSON writes 64-bit integers as strings and leaves out zero fields: undo the first."""
    if isinstance(value, dict):
        return {k: as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_ints(v) for v in value]
    return int(value) if isinstance(value, str) and value.isdigit() else value


def grpc_statistics(g: grpcclient.InferenceServerClient, *args: str) -> dict:
    stats = g.get_inference_statistics(*args)
    return {"model_stats": [{
        "name": s.name, "version": s.version, "last_inference": s.last_inference, "inference_count": s.inference_count,
        "execution_count": s.execution_count,
        "inference_stats": {f: {"count": getattr(s.inference_stats, f).count, "ns": getattr(s.inference_stats, f).ns}
                            for f in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
                                      "cache_hit", "cache_miss")},
        "batch_stats": [{"batch_size": b.batch_size,
                         **{f: {"count": getattr(b, f).count, "ns": getattr(b, f).ns}
                            for f in ("compute_input", "compute_infer", "compute_output")}} for b in s.batch_stats],
        "memory_usage": [],
    } for s in stats.model_stats]}


# ------------------------------------------------------------------ statistics
def test_statistics_count_both_protocols_in_tritons_shape(fresh: ThreadedServer, tiny_bytes: bytes) -> None:
    put_model(fresh.url, "tiny", tiny_bytes)
    h, g = clients(fresh)
    before = time.time() * 1000
    for batch in (1, 2, 1):
        g.infer("tiny", [tensor(grpcclient, batch)])
    for batch in (1, 3):
        h.infer("tiny", [tensor(httpclient, batch)])
    with pytest.raises(InferenceServerException):
        g.infer("tiny", [tensor(grpcclient, 1, (3, 4, 4))])  # reaches the model, fails its signature
    rest = h.get_inference_statistics("tiny")
    (stats,) = rest["model_stats"]
    assert stats["name"] == "tiny" and stats["version"] == "1"
    assert stats["inference_count"] == 8  # samples of successful requests
    assert stats["execution_count"] == 5  # one engine call each: they came one at a time
    infer = stats["inference_stats"]
    assert infer["success"]["count"] == 5 and infer["fail"]["count"] == 1
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert infer[part]["count"] == 5, part
    assert infer["compute_infer"]["ns"] > 0 and infer["success"]["ns"] >= infer["compute_infer"]["ns"]
    assert {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]} == {1: 3, 2: 1, 3: 1}
    assert before <= stats["last_inference"] <= time.time() * 1000
    assert grpc_statistics(g, "tiny") == rest  # the same figures through either client
    assert grpc_statistics(g, "tiny", "1") == h.get_inference_statistics("tiny", "1") == rest
    assert as_ints(g.get_inference_statistics(as_json=True))["model_stats"][0]["inference_count"] == 8
    assert h.get_inference_statistics()["model_stats"] == rest["model_stats"]


def test_statistics_of_an_unknown_model(live: ThreadedServer) -> None:
    h, g = clients(live)
    with pytest.raises(InferenceServerException) as rest:
        h.get_inference_statistics("ghost")
    with pytest.raises(InferenceServerException) as rpc:
        g.get_inference_statistics("ghost")
    assert rest.value.status() == "404" and rpc.value.status() == "StatusCode.NOT_FOUND"
    assert rest.value.message() == rpc.value.message() == "model 'ghost' not found"


# ------------------------------------------------------------------ repository
def _index(h: httpclient.InferenceServerClient, g: grpcclient.InferenceServerClient) -> list[dict]:
    rest = h.get_model_repository_index()
    rpc = [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason}
           for m in g.get_model_repository_index().models]
    assert rpc == rest
    return rest


def test_unload_drains_keeps_the_files_and_load_serves_again(fresh: ThreadedServer, tiny_bytes: bytes) -> None:
    put_model(fresh.url, "tiny", tiny_bytes, config='{"max_delay_ms": 300}')
    h, g = clients(fresh)
    assert _index(h, g) == [{"name": "tiny", "version": "1", "state": "READY", "reason": ""}]
    optimizations = fresh.dataplane.manager.optimizations

    async def infer_while_unloading() -> object:
        client = grpcaio.InferenceServerClient(fresh.grpc_target)
        try:
            waiting = asyncio.ensure_future(client.infer("tiny", [tensor(grpcclient)]))
            await asyncio.sleep(0.1)  # queued, inside its 300 ms batching window
            await client.unload_model("tiny", headers=GRPC_AUTH)
            return await waiting
        finally:
            await client.close()

    assert asyncio.run(infer_while_unloading()).as_numpy("logits").shape == (1, 3)  # drained, not dropped
    assert _index(h, g) == [{"name": "tiny", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
    assert not g.is_model_ready("tiny") and not h.is_model_ready("tiny")
    with pytest.raises(InferenceServerException) as rpc:
        g.infer("tiny", [tensor(grpcclient)])
    with pytest.raises(InferenceServerException) as rest:
        h.infer("tiny", [tensor(httpclient)])
    assert rpc.value.status() == "StatusCode.UNAVAILABLE" and rest.value.status() == "503"
    unloaded = "model 'tiny' is unloaded: load it first (repository extension)"
    assert rpc.value.message() == rest.value.message() == unloaded
    model_dir = Path(fresh.settings.model_dir) / "tiny"
    assert (model_dir / "1" / "original.onnx").is_file() and (model_dir / ".unloaded").is_file()
    r = httpx.post(f"{fresh.url}/v1/models/tiny", content=tiny_bytes, headers={**AUTH, "content-type": OCTET})
    assert r.status_code == 409 and "unloaded" in r.json()["error"]
    h.unload_model("tiny", headers=AUTH)  # again: nothing to do
    h.load_model("tiny", headers=AUTH)
    assert g.is_model_ready("tiny") and not (model_dir / ".unloaded").exists()
    assert g.infer("tiny", [tensor(grpcclient)]).as_numpy("logits").shape == (1, 3)
    assert fresh.dataplane.manager.optimizations == optimizations  # served from the stored optimized files
    g.load_model("tiny", headers=GRPC_AUTH)  # loaded already: stays as it is


def test_an_unloaded_model_stays_unloaded_after_a_restart(tmp_path: Path, tiny_bytes: bytes) -> None:
    first = start(tmp_path)
    try:
        put_model(first.url, "tiny", tiny_bytes)
        clients(first)[1].unload_model("tiny", headers=GRPC_AUTH)
    finally:
        first.stop()
    second = start(tmp_path)
    try:
        h, g = clients(second)
        assert _index(h, g) == [{"name": "tiny", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
        g.load_model("tiny", headers=GRPC_AUTH)
        assert h.is_model_ready("tiny")
    finally:
        second.stop()


def test_load_of_an_unknown_model_and_config_overrides(live: ThreadedServer) -> None:
    h, g = clients(live)
    with pytest.raises(InferenceServerException) as rest:
        h.load_model("ghost", headers=AUTH)
    with pytest.raises(InferenceServerException) as rpc:
        g.load_model("ghost", headers=GRPC_AUTH)
    assert rest.value.status() == "404" and rpc.value.status() == "StatusCode.NOT_FOUND"
    assert rest.value.message() == rpc.value.message() == "model 'ghost' not found"
    with pytest.raises(InferenceServerException) as rest:
        h.load_model("tiny", headers=AUTH, config='{"max_batch_size": 2}')
    with pytest.raises(InferenceServerException) as rpc:
        g.load_model("tiny", headers=GRPC_AUTH, config='{"max_batch_size": 2}')
    assert rest.value.status() == "400" and rpc.value.status() == "StatusCode.UNIMPLEMENTED"
    assert rest.value.message() == rpc.value.message()
    assert "not supported by this server" in rpc.value.message()
    with pytest.raises(InferenceServerException) as rpc:
        g.unload_model("ghost", headers=GRPC_AUTH)
    assert rpc.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize(
    ("headers", "status", "code", "text"),
    [
        (None, "401", "UNAUTHENTICATED", "missing bearer token: send 'Authorization: Bearer <admin token>'"),
        ({"authorization": "Bearer wrong-token-but-long-enough"}, "401", "UNAUTHENTICATED", "wrong bearer token"),
        ({"authorization": f"Basic {TOKEN}"}, "401", "UNAUTHENTICATED", "the Authorization header must be"),
    ],
)
def test_load_and_unload_need_the_admin_token(live: ThreadedServer, headers, status, code, text) -> None:
    h, g = clients(live)
    for call in ("load_model", "unload_model"):
        with pytest.raises(InferenceServerException) as rest:
            getattr(h, call)("tiny", headers=headers)
        with pytest.raises(InferenceServerException) as rpc:
            getattr(g, call)("tiny", headers=headers)
        assert rest.value.status() == status and rpc.value.status() == f"StatusCode.{code}"
        assert rest.value.message() == rpc.value.message() and text in rpc.value.message()
    assert g.is_model_ready("tiny")


def test_without_an_admin_token_management_is_forbidden(tmp_path: Path) -> None:
    server = start(tmp_path, admin_token=None)
    try:
        h, g = clients(server)
        with pytest.raises(InferenceServerException) as rest:
            h.unload_model("tiny", headers=AUTH)
        with pytest.raises(InferenceServerException) as rpc:
            g.unload_model("tiny", headers=GRPC_AUTH)
        assert rest.value.status() == "403" and rpc.value.status() == "StatusCode.PERMISSION_DENIED"
        assert rest.value.message() == rpc.value.message() == DISABLED_MESSAGE
    finally:
        server.stop()


# ------------------------------------------------------------------ not supported, metrics
@pytest.mark.parametrize(
    ("call", "args", "text"),
    [
        ("get_trace_settings", (), "the trace extension"),
        ("update_trace_settings", ("tiny", {"trace_level": ["TIMESTAMPS"]}), "the trace extension"),
        ("get_log_settings", (), "the logging extension"),
        ("update_log_settings", ({"log_info": True},), "the logging extension"),
    ],
)
def test_unsupported_extensions_say_so(live: ThreadedServer, call: str, args: tuple, text: str) -> None:
    h, g = clients(live)
    with pytest.raises(InferenceServerException) as rest:
        getattr(h, call)(*args)
    with pytest.raises(InferenceServerException) as rpc:
        getattr(g, call)(*args)
    assert rest.value.status() == "400" and rpc.value.status() == "StatusCode.UNIMPLEMENTED"
    assert rest.value.message() == rpc.value.message() == f"{text} is not supported by this server"


def test_the_request_metrics_carry_the_protocol(fresh: ThreadedServer, tiny_bytes: bytes) -> None:
    put_model(fresh.url, "tiny", tiny_bytes)
    h, g = clients(fresh)
    g.infer("tiny", [tensor(grpcclient)])
    g.infer("tiny", [tensor(grpcclient)])
    h.infer("tiny", [tensor(httpclient)])
    with pytest.raises(InferenceServerException):
        g.infer("ghost", [tensor(grpcclient)])
    text = httpx.get(f"{fresh.url}/metrics").text
    assert 'service_requests_total{endpoint="v2_infer",model="tiny",outcome="success",protocol="grpc"} 2.0' in text
    assert 'service_requests_total{endpoint="v2_infer",model="tiny",outcome="success",protocol="rest"} 1.0' in text
    assert 'service_requests_total{endpoint="v2_infer",model="",outcome="not_found",protocol="grpc"} 1.0' in text
    assert "ghost" not in text


def test_statistics_start_from_zero_after_an_unload_and_load(fresh: ThreadedServer, tiny_bytes: bytes) -> None:
    """Triton keeps a version's statistics in its loaded model object, so an unload ends them and a load starts
    from zero; docs/grpc.md says so, in the sentence checked here."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "grpc.md").read_text(encoding="utf-8")
    assert "an unload ends them and a load starts them from zero" in page
    put_model(fresh.url, "tiny", tiny_bytes)
    h, g = clients(fresh)
    for batch in (1, 2):
        g.infer("tiny", [tensor(grpcclient, batch)])
    assert h.get_inference_statistics("tiny")["model_stats"][0]["inference_count"] == 3
    g.unload_model("tiny", headers=GRPC_AUTH)
    # as Triton: an unloaded model has no statistics; asked for by name, it is not ready
    assert "tiny" not in [s["name"] for s in h.get_inference_statistics()["model_stats"]]
    assert "tiny" not in [s.name for s in g.get_inference_statistics().model_stats]
    for call in (lambda: h.get_inference_statistics("tiny"), lambda: g.get_inference_statistics("tiny", "1")):
        with pytest.raises(InferenceServerException, match="unloaded"):
            call()
    h.load_model("tiny", headers=AUTH)
    (stats,) = h.get_inference_statistics("tiny")["model_stats"]
    assert (stats["inference_count"], stats["execution_count"], stats["last_inference"]) == (0, 0, 0)
    assert stats["inference_stats"]["success"] == {"count": 0, "ns": 0} and stats["batch_stats"] == []
    h.infer("tiny", [tensor(httpclient, 1)])
    assert grpc_statistics(g, "tiny")["model_stats"][0]["inference_count"] == 1
