"""What the API says about a model is true of this server: a CPU host's record claims nothing that only CUDA
has, every pass of the report shows the graph it ran on or why it was skipped, and a refused upload leaves a
line in the log at info with the model name and the text the client got."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from api_kit import AUTH, OCTET, make_settings, serve_app, upload
from onnx import TensorProto, helper, numpy_helper

from service.optimizer.pipeline import FUSED_CONV_OFF
from service.runtime.device import cuda_status

pytestmark = pytest.mark.anyio

CUDA_ONLY = {"cuda_graph", "cuda_graph_fallback", "prefer_nhwc", "fuse_conv_bias", "cudnn_conv_algo_search",
             "device_id", "gpu", "KIND_GPU"}


def keys_and_values(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from keys_and_values(item)
    elif isinstance(value, list):
        for item in value:
            yield from keys_and_values(item)
    elif isinstance(value, str):
        yield value


async def documents(client: httpx.AsyncClient, name: str) -> dict[str, Any]:
    """Everything the HTTP API says about one model."""
    paths = (f"/v1/models/{name}", f"/v2/models/{name}", f"/v2/models/{name}/config")
    answers = {path: await client.get(path) for path in paths}
    assert all(r.status_code == 200 for r in answers.values()), {p: r.text for p, r in answers.items()}
    return {path: r.json() for path, r in answers.items()}


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("auto", marks=pytest.mark.skipif(cuda_status()[0], reason="this host has a usable GPU"))],
)
async def test_a_cpu_record_claims_nothing_of_cuda(tmp_path: Path, tiny_bytes: bytes, device: str) -> None:
    async with serve_app(make_settings(tmp_path, device=device)) as client:
        await upload(client, "tiny", tiny_bytes)
        said = await documents(client, "tiny")
    record = said["/v1/models/tiny"]["versions"][0]
    assert record["engine"]["device"] == "cpu" and record["provider"] == "CPUExecutionProvider"
    claimed = CUDA_ONLY & set(keys_and_values(said))
    assert not claimed, claimed


async def test_every_pass_shows_its_graph_or_why_it_was_skipped(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    fused = (await upload(fresh, "fused", tiny_bytes))["report"]["passes"]
    plain = (await upload(fresh, "plain", tiny_bytes, config={"fused_conv": False}))["report"]["passes"]
    for passes in (fused, plain):
        ran = [p for p in passes if p["skipped"] is None]
        assert ran and all(p["nodes_before"] >= 4 and p["nodes_after"] >= 4 for p in ran), ran  # tiny: 5 nodes
        assert all(p["nodes_before"] - p["nodes_after"] <= p["rewrites"] for p in ran), ran
    assert next(p for p in fused if p["name"] == "fuse_conv_relu_into_fusedconv")["rewrites"] == 1
    skipped = {p["name"]: p for p in plain if p["skipped"] is not None}
    assert set(skipped) == {"fuse_conv_relu_into_fusedconv", "fuse_conv_add_relu_into_fusedconv"}
    assert all(p["skipped"] == FUSED_CONV_OFF and p["nodes_before"] is None for p in skipped.values())


def cancelling_model() -> bytes:
    """(conv + 1e6) - 1e6: folding both constants into the bias changes the answer far beyond the tolerance
    (tests/integration/test_registry.py says why), so verification refuses the upload."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((2, 2, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([0.5, -0.5], np.float32), "b"),
        numpy_helper.from_array(np.full((2, 1, 1), 1e6, np.float32), "big"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "big"], ["a"]),
        helper.make_node("Sub", ["a", "big"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "cancel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


async def test_each_refused_upload_is_logged_at_info_with_the_name_and_the_reason(
    fresh: httpx.AsyncClient, tiny_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="service")
    await upload(fresh, "gone", tiny_bytes)
    assert (await fresh.post("/v2/repository/models/gone/unload", headers=AUTH)).status_code == 200
    raw = {**AUTH, "content-type": OCTET}
    attempts = {  # model name -> (status, the request)
        "garbage": (400, dict(content=b"\x08\x07garbage-not-onnx" * 10, headers=raw)),
        "huge": (413, dict(content=b"\0" * (2 * 1024 * 1024 + 1), headers=raw)),  # max_upload_mb is 2 here
        "badconfig": (400, dict(content=tiny_bytes, headers=raw, params={"config": "{not json"})),
        "cancel": (422, dict(content=cancelling_model(), headers=raw)),
        "gone": (409, dict(content=tiny_bytes, headers=raw)),
        "text": (415, dict(content=tiny_bytes, headers={**AUTH, "content-type": "text/plain"})),
    }
    for name, (status, request) in attempts.items():
        r = await fresh.post(f"/v1/models/{name}", **request)
        assert r.status_code == status, (name, r.text)
        wanted = f"upload of model {name!r} refused ({status}): {r.json()['error']}"
        lines = [rec for rec in caplog.records if rec.getMessage() == wanted]
        assert [rec.levelno for rec in lines] == [logging.INFO], (wanted, caplog.text[-2000:])
    r = await fresh.post("/v1/models/nobody", content=tiny_bytes, headers={"content-type": OCTET})
    assert r.status_code == 401
    assert f"POST /v1/models/nobody refused (401): {r.json()['error']}" in caplog.messages
