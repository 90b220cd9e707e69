"""The real thing: ``python -m service serve`` as a subprocess on a free loopback port.

upload -> /predict -> the official tritonclient (binary and JSON tensors) -> SIGTERM (clean exit, the
in-flight request completes) -> restart on the same model dir -> identical answers; and one start with
the bundled demo model, checked against ONNX Runtime on the zoo graph.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from builders import tiny_cnn
from live_server import AUTH, GRACE_S, running

pytestmark = pytest.mark.e2e


def ort_reference(model: bytes | onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {sess.get_inputs()[0].name: x}), strict=True))


def triton_infer(port: int, x: np.ndarray, binary_in: bool = True) -> dict[str, np.ndarray]:
    import tritonclient.http as triton

    with triton.InferenceServerClient(url=f"127.0.0.1:{port}") as client:
        assert client.is_server_live() and client.is_server_ready()
        assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
        assert client.is_model_ready("tiny")
        meta = client.get_model_metadata("tiny")
        assert meta["inputs"][0]["shape"] == [-1, 3, 8, 8] and meta["platform"] == "onnxruntime_onnx"
        assert client.get_model_config("tiny")["max_batch_size"] >= 1
        tensor = triton.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary_in)
        outputs = [
            triton.InferRequestedOutput("logits", binary_data=True),
            triton.InferRequestedOutput("features", binary_data=False),
        ]
        result = client.infer("tiny", [tensor], outputs=outputs, request_id="e2e-1")
        assert result.get_response()["id"] == "e2e-1"
        by_version = client.infer("tiny", [tensor], model_version="1")  # all outputs, binary by default
        np.testing.assert_array_equal(by_version.as_numpy("logits"), result.as_numpy("logits"))
        return {"logits": result.as_numpy("logits"), "features": result.as_numpy("features")}


def predict(url: str, x: np.ndarray) -> dict[str, np.ndarray]:
    r = httpx.post(f"{url}/predict", json={"model": "tiny", "inputs": {"input": x.tolist()}}, timeout=30)
    assert r.status_code == 200, r.text
    return {k: np.asarray(v, np.float32) for k, v in r.json()["outputs"].items()}


def test_upload_predict_triton_sigterm_restart(tmp_path: Path) -> None:
    model, x = tiny_cnn(seed=3), np.random.default_rng(7).normal(size=(3, 3, 8, 8)).astype(np.float32)
    want = ort_reference(model, x)
    models = tmp_path / "models"
    with running(models, tmp_path / "first") as server:
        r = httpx.post(
            f"{server.url}/v1/models/tiny",
            content=model,
            params={"config": '{"max_delay_ms": 400}'},
            headers={**AUTH, "content-type": "application/octet-stream"},
            timeout=60,
        )
        assert r.status_code == 201, r.text
        assert r.json()["version"] == 1 and r.json()["state"] == "READY"
        unauthorized = httpx.post(f"{server.url}/v1/models/evil", content=model, timeout=10)
        assert unauthorized.status_code == 401

        answer = predict(server.url, x)
        np.testing.assert_allclose(answer["logits"], want["logits"], rtol=1e-4, atol=1e-5)
        for binary_in in (True, False):
            via_triton = triton_infer(server.port, x, binary_in=binary_in)
            for name in ("logits", "features"):
                np.testing.assert_allclose(via_triton[name], answer[name], rtol=1e-5, atol=1e-6)

        # SIGTERM while a request waits in its 400 ms batch window: it completes, the exit is clean.
        # The client connects first, so the request leaves at once (a fresh httpx.post spent over 150 ms
        # building its client on a loaded 2-core machine, and the SIGTERM overtook it).
        late: dict[str, object] = {}
        client = httpx.Client(base_url=server.url, timeout=30)
        assert client.get("/v2/health/live").status_code == 200

        def in_flight() -> None:
            late["response"] = client.post(
                "/predict", json={"model": "tiny", "inputs": {"input": x[:1].tolist()}}
            )

        thread = threading.Thread(target=in_flight)
        thread.start()
        time.sleep(0.2)
        start = time.monotonic()
        assert server.terminate() == 0
        assert time.monotonic() - start < GRACE_S + 2
        thread.join(timeout=10)
        client.close()
        response = late["response"]
        assert isinstance(response, httpx.Response) and response.status_code == 200
        np.testing.assert_allclose(
            response.json()["outputs"]["logits"], want["logits"][:1], rtol=1e-4, atol=1e-5
        )

    with running(models, tmp_path / "second") as again:
        assert predict(again.url, x)["logits"].tolist() == answer["logits"].tolist()
        np.testing.assert_array_equal(triton_infer(again.port, x)["logits"], via_triton["logits"])
        listing = httpx.get(f"{again.url}/v1/models", timeout=10).json()
        assert listing == {
            "models": [{"name": "tiny", "versions": [{"version": 1, "state": "READY", "error": None}]}]
        }
        assert again.terminate() == 0
    leftovers = [p for p in (models / ".staging").iterdir()] if (models / ".staging").exists() else []
    assert leftovers == []


@pytest.mark.slow
def test_demo_model_on_a_fresh_store(tmp_path: Path) -> None:
    """CI proof that the default start works: the zoo's mobilenet_v3_large is built, optimized (its ImageNet
    normalisation folded in), verified and served (about 10 s on 2 cores); a JPEG POSTed as curl would
    (``--data-binary @cat.jpg -H 'content-type: image/jpeg'``) gives the reference pipeline's top 5, and
    uint8 tensors through tritonclient give the original float model's outputs."""
    import image_kit
    import images

    from service import zoo

    with running(tmp_path / "models", tmp_path / "demo", demo=True, ready_timeout=240) as server:
        meta = httpx.get(f"{server.url}/v2/models/mobilenet_v3_large", timeout=10).json()
        name = meta["inputs"][0]["name"]
        assert meta["inputs"] == [{"name": name, "datatype": "UINT8", "shape": [-1, 3, 224, 224]}]
        photo = images.jpeg(640, 480, seed=5)
        r = httpx.post(f"{server.url}/predict", content=photo, headers={"content-type": "image/jpeg"}, timeout=30)
        assert r.status_code == 200, r.text
        (top,) = r.json()["predictions"]
        model = zoo.build("mobilenet_v3_large").SerializeToString()
        demo = {"resize": 256, "crop": [224, 224]}
        wire = image_kit.pixels([photo], demo)
        probs = image_kit.softmax(next(iter(ort_reference(model, image_kit.normalised(wire)).values())))[0]
        best = np.argsort(-probs, kind="stable")[:5]
        assert [(p["label"], p["index"]) for p in top] == [(f"class_{i}", int(i)) for i in best]
        np.testing.assert_allclose([p["score"] for p in top], probs[best], rtol=1e-3, atol=1e-6)
        import tritonclient.http as triton

        with triton.InferenceServerClient(url=f"127.0.0.1:{server.port}") as client:
            tensor = triton.InferInput(name, list(wire.shape), "UINT8")
            tensor.set_data_from_numpy(wire)
            got = client.infer("mobilenet_v3_large", [tensor]).as_numpy(meta["outputs"][0]["name"])
        want = next(iter(ort_reference(model, image_kit.normalised(wire)).values()))
        # logits of random weights reach +-100; the folded first conv rounds differently: 1e-5 of that scale
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * float(np.abs(want).max()))
        record = httpx.get(f"{server.url}/v1/models/mobilenet_v3_large", timeout=10).json()["versions"][0]
        assert record["report"]["nodes_after"] < record["report"]["nodes_before"]
        assert "RANDOM weights" in record["description"] and record["config"]["postprocess"]["label_count"] == 1000
        assert server.terminate() == 0
