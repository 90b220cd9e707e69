"""Output dims in the metadata: what ONNX shape inference derives, not what the exporter declared.

A segmenter's head is often exported with every output dim dynamic ([-1, -1, -1, -1]); the upload's sandbox
fills in the dims that the graph fixes (classes, upsampled height and width), and /v2 metadata and config
show them. Dims that the graph does not fix (here: a dynamic input size) stay dynamic.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from api_kit import make_settings, serve_app, upload
from onnx import TensorProto, helper, numpy_helper

pytestmark = pytest.mark.anyio

CLASSES = 21


def segmenter(size: int | None) -> bytes:
    """Conv 3->21 (1x1) + Relu + Resize x2 (nearest): a segmentation head. Input ``[N, 3, size, size]``
    (``size`` None: dynamic height and width); the output declared with symbolic dims only."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((CLASSES, 3, 1, 1)).astype(np.float32), "w")
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    spatial: list[int | str] = [size, size] if size is not None else ["height", "width"]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["input", "w"], ["logits"]),
            helper.make_node("Relu", ["logits"], ["scores"]),
            helper.make_node("Resize", ["scores", "", "scales"], ["out"], mode="nearest"),
        ],
        "segmenter",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, *spatial])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", "C", "H", "W"])],
        [weight, scales],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory):
    # the dynamic-size model is verified at 224x224 inputs (448x448 outputs): more than the default 1 GiB
    settings = make_settings(tmp_path_factory.mktemp("dims"), optimizer_memory_mb=2048)
    async with serve_app(settings) as client:
        await upload(client, "seg", segmenter(16))
        await upload(client, "anysize", segmenter(None))
        yield client


async def test_declared_dynamic_output_dims_become_concrete(served: httpx.AsyncClient) -> None:
    body = (await served.get("/v2/models/seg")).json()
    assert body["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 16, 16]}]
    assert body["outputs"] == [{"name": "out", "datatype": "FP32", "shape": [-1, CLASSES, 32, 32]}]
    config = (await served.get("/v2/models/seg/config")).json()
    assert [o["dims"] for o in config["output"]] == [[CLASSES, 32, 32]]


async def test_dims_the_graph_does_not_fix_stay_dynamic(served: httpx.AsyncClient) -> None:
    body = (await served.get("/v2/models/anysize/versions/1")).json()
    assert body["outputs"] == [{"name": "out", "datatype": "FP32", "shape": [-1, CLASSES, -1, -1]}]


async def test_inferred_dims_are_what_the_model_returns(served: httpx.AsyncClient) -> None:
    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)
    request = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    r = await served.post("/v2/models/seg/infer", json=request)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"] == [2, CLASSES, 32, 32]

