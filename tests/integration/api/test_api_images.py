"""Images in, labels out, through the real app and registry: every way a client sends images gives the
labels and scores of the reference pipeline (tests/helpers/image_kit.py: the same decoder, numpy
normalisation, ONNX Runtime on the ORIGINAL float model, softmax, top-k); the served graph takes uint8."""

from __future__ import annotations

import base64
import io
import json

import httpx
import image_kit
import images
import numpy as np
import orjson
import pytest
from api_kit import AUTH, make_settings, serve_app, upload
from image_kit import LABELS, assert_same_strings, assert_same_top, class_strings, parse_class_strings

from service.image_requests import serialize_bytes

pytestmark = pytest.mark.anyio

HEADER = "Inference-Header-Content-Length"
JPEGS = [images.jpeg(40, 30, seed=s) for s in (1, 2)]
PNG = images.png(30, 44, seed=3)


@pytest.fixture(scope="module")
async def app(tmp_path_factory: pytest.TempPathFactory):
    """``cls``: the 10-class classifier as an image model (uint8 wire), ``plain``: the same bytes without
    an image config, ``flt``: the same model with a float32 wire (nothing folded)."""
    model = image_kit.classifier()
    async with serve_app(make_settings(tmp_path_factory.mktemp("images"))) as client:
        client.model = model  # type: ignore[attr-defined]
        await upload(client, "cls", model, image_kit.CONFIG)
        await upload(client, "plain", model)
        await upload(client, "flt", model, {**image_kit.CONFIG, "preprocess": {**image_kit.PREPROCESS,
                                                                               "wire_dtype": "float32"}})
        yield client


def _predictions(r: httpx.Response) -> list[list[dict]]:
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"model", "version", "predictions"}, body
    return body["predictions"]


# ------------------------------------------------------------------ /predict
@pytest.mark.parametrize("data", [JPEGS[0], PNG], ids=["jpeg", "png"])
async def test_an_image_body_gives_the_reference_top_5(app: httpx.AsyncClient, data: bytes) -> None:
    media = "image/jpeg" if data[:2] == b"\xff\xd8" else "image/png"
    r = await app.post("/predict", params={"model": "cls"}, content=data, headers={"content-type": media})
    got = _predictions(r)
    assert len(got) == 1 and len(got[0]) == 5
    assert_same_top(got, image_kit.top_k(app.model, [data]))


async def test_a_multipart_batch_of_three(app: httpx.AsyncClient) -> None:
    batch = [JPEGS[0], PNG, JPEGS[1]]
    files = [("image", (f"{i}.img", data, "application/octet-stream")) for i, data in enumerate(batch)]
    r = await app.post("/predict", params={"model": "cls"}, files=files)
    got = _predictions(r)
    assert len(got) == 3
    assert_same_top(got, image_kit.top_k(app.model, batch))


@pytest.mark.parametrize("form", ["images", "image", "data-url"])
async def test_base64_json(app: httpx.AsyncClient, form: str) -> None:
    encoded = [base64.b64encode(d).decode() for d in JPEGS]
    doc: dict = {"model": "cls"}
    if form == "images":
        doc["images"], sent = encoded, JPEGS
    elif form == "image":
        doc["image"], sent = encoded[0], JPEGS[:1]
    else:
        doc["image"], sent = "data:image/jpeg;base64," + encoded[1], JPEGS[1:]
    got = _predictions(await app.post("/predict", json=doc))
    assert_same_top(got, image_kit.top_k(app.model, sent))


async def test_raw_outputs_on_request(app: httpx.AsyncClient) -> None:
    want = image_kit.logits(app.model, JPEGS[:1])
    r = await app.post("/predict", params={"model": "cls", "raw": "true"}, content=JPEGS[0],
                       headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["outputs"]["logits"], want, rtol=1e-4, atol=1e-5)
    r = await app.post("/predict", json={"model": "cls", "image": base64.b64encode(JPEGS[0]).decode(), "raw": True})
    np.testing.assert_allclose(r.json()["outputs"]["logits"], want, rtol=1e-4, atol=1e-5)


async def test_a_float32_wire_model_gives_the_same_answer(app: httpx.AsyncClient) -> None:
    """``flt`` keeps its float input (the server normalises in numpy): same labels as the folded ``cls``."""
    meta = (await app.get("/v2/models/flt")).json()
    assert meta["inputs"][0]["datatype"] == "FP32"
    got = _predictions(await app.post("/predict", params={"model": "flt"}, content=PNG,
                                      headers={"content-type": "image/png"}))
    assert_same_top(got, image_kit.top_k(app.model, [PNG]))


# ------------------------------------------------------------------ tensors: uint8 on the wire
async def test_the_served_signature_is_uint8(app: httpx.AsyncClient) -> None:
    meta = (await app.get("/v2/models/cls")).json()
    assert meta["inputs"] == [{"name": "input", "datatype": "UINT8", "shape": [-1, 3, 8, 8]}]
    plain = (await app.get("/v2/models/plain")).json()
    assert plain["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 8, 8]}]


def _v2_binary(tensor: dict, payload: bytes, outputs: list | None = None) -> tuple[bytes, dict]:
    doc: dict = {"inputs": [{**tensor, "parameters": {"binary_data_size": len(payload)}}]}
    if outputs is not None:
        doc["outputs"] = outputs
    head = orjson.dumps(doc)
    return head + payload, {HEADER: str(len(head))}


async def test_uint8_tensors_on_v2_and_npy(app: httpx.AsyncClient) -> None:
    wire = image_kit.pixels(JPEGS)
    want = image_kit.logits(app.model, JPEGS)
    body, headers = _v2_binary({"name": "input", "datatype": "UINT8", "shape": list(wire.shape)}, wire.tobytes())
    r = await app.post("/v2/models/cls/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    logits = next(o for o in r.json()["outputs"] if o["name"] == "logits")
    np.testing.assert_allclose(np.reshape(logits["data"], logits["shape"]), want, rtol=1e-4, atol=1e-5)
    buffer = io.BytesIO()
    np.save(buffer, wire)
    r = await app.post("/predict", params={"model": "cls"}, content=buffer.getvalue(),
                       headers={"content-type": "application/x-npy"})
    np.testing.assert_allclose(r.json()["outputs"]["logits"], want, rtol=1e-4, atol=1e-5)
    r = await app.post("/predict", json={"model": "cls", "inputs": {"input": wire.tolist()}})
    np.testing.assert_allclose(r.json()["outputs"]["logits"], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("values", "mentions"), [([[[[0.5]]]], "whole numbers"), ([[[[300]]]], "[0, 255]")])
async def test_json_floats_or_out_of_range_values_for_uint8_are_refused(
    app: httpx.AsyncClient, values: list, mentions: str
) -> None:
    x = np.zeros((1, 3, 8, 8)).tolist()
    x[0][0][0][0] = values[0][0][0][0]
    r = await app.post("/predict", json={"model": "cls", "inputs": {"input": x}})
    assert r.status_code == 400 and mentions in r.json()["error"], r.text


# ------------------------------------------------------------------ V2 BYTES tensors and classification
async def test_v2_bytes_binary_and_json(app: httpx.AsyncClient) -> None:
    want = image_kit.logits(app.model, JPEGS)
    tensor = {"name": "input", "datatype": "BYTES", "shape": [2]}
    body, headers = _v2_binary(tensor, serialize_bytes(JPEGS))
    r = await app.post("/v2/models/cls/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    out = next(o for o in r.json()["outputs"] if o["name"] == "logits")
    np.testing.assert_allclose(np.reshape(out["data"], out["shape"]), want, rtol=1e-4, atol=1e-5)
    doc = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2, 1],
                       "data": [[base64.b64encode(d).decode()] for d in JPEGS]}]}
    r = await app.post("/v2/models/cls/infer", json=doc)
    out = next(o for o in r.json()["outputs"] if o["name"] == "logits")
    np.testing.assert_allclose(np.reshape(out["data"], out["shape"]), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("binary", [False, True])
async def test_the_classification_extension(app: httpx.AsyncClient, binary: bool) -> None:
    body, headers = _v2_binary({"name": "input", "datatype": "BYTES", "shape": [2]}, serialize_bytes(JPEGS),
                               outputs=[{"name": "logits", "parameters": {"classification": 3, "binary_data": binary}}])
    r = await app.post("/v2/models/cls/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    if binary:
        n = int(r.headers[HEADER])
        (out,) = orjson.loads(r.content[:n])["outputs"]
        rows = _bytes_elements(r.content[n:], out["shape"])
    else:
        (out,) = r.json()["outputs"]
        rows = np.array([s.encode() for s in out["data"]], dtype=object).reshape(out["shape"])
    assert (out["name"], out["datatype"], out["shape"]) == ("logits", "BYTES", [2, 3])
    assert_same_strings(parse_class_strings(rows), class_strings(image_kit.top_k(app.model, JPEGS, k=3)))


def _bytes_elements(blob: bytes, shape: list[int]) -> np.ndarray:
    items, offset = [], 0
    while offset < len(blob):
        size = int.from_bytes(blob[offset : offset + 4], "little")
        items.append(blob[offset + 4 : offset + 4 + size])
        offset += 4 + size
    return np.array(items, dtype=object).reshape(shape)


async def test_classification_of_a_model_without_labels_ranks_raw_values(app: httpx.AsyncClient) -> None:
    """As Triton: ``score:index`` of the raw output, no softmax, no label."""
    x = image_kit.normalised(image_kit.pixels(JPEGS[:1]))
    doc = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}],
           "outputs": [{"name": "logits", "parameters": {"classification": 2}}]}
    (out,) = (await app.post("/v2/models/plain/infer", json=doc)).json()["outputs"]
    raw = image_kit.logits(app.model, JPEGS[:1])[0]
    best = np.argsort(-raw, kind="stable")[:2]
    assert out["data"] == [f"{raw[i]:f}:{i}" for i in best]


# ------------------------------------------------------------------ what a client can learn
async def test_the_model_record_shows_preprocessing_and_the_labels_route(app: httpx.AsyncClient) -> None:
    (record,) = (await app.get("/v1/models/cls")).json()["versions"]
    pre, post = record["config"]["preprocess"], record["config"]["postprocess"]
    assert (pre["resize"], pre["crop"], pre["wire_dtype"], pre["layout"]) == (12, [8, 8], "uint8", "NCHW")
    assert pre["mean"] == [0.485, 0.456, 0.406] and pre["std"] == [0.229, 0.224, 0.225]
    assert post == {"softmax": True, "top_k": 5, "label_count": 10}
    assert record["inputs"][0]["datatype"] == "UINT8"
    fold = next(p for p in record["report"]["passes"] if p["name"] == "fold_input_normalization")
    assert fold["rewrites"] == 1
    labels = (await app.get("/v1/models/cls/labels")).json()
    assert labels == {"name": "cls", "version": 1, "output": "logits", "labels": list(LABELS)}
    text = await app.get("/v1/models/cls/versions/1/labels", headers={"accept": "text/plain"})
    assert text.text.splitlines() == list(LABELS)
    r = await app.get("/v1/models/plain/labels")
    assert r.status_code == 404 and "no labels" in r.json()["error"]


# ------------------------------------------------------------------ upload rules
@pytest.mark.parametrize(
    ("config", "mentions"),
    [
        ({"preprocess": {}}, "takes height 8"),
        ({"preprocess": {"resize": 8, "crop": [8, 6]}}, "takes width 8"),
        ({"preprocess": {"resize": 8, "crop": [8, 8], "layout": "NHWC", "wire_dtype": "float32"}}, "channels"),
        ({"postprocess": {"labels": ["a", "b"]}}, "2 labels given, but output 'logits' has 10 classes"),
        ({"preprocess": {"resize": 8, "crop": [8, 8]}, "postprocess": {"top_k": 0}}, "top_k"),
    ],
)
async def test_an_image_config_that_does_not_fit_the_model_is_422(
    fresh: httpx.AsyncClient, config: dict, mentions: str
) -> None:
    answer = await upload(fresh, "bad", image_kit.classifier(), config, expect=422)
    assert mentions in answer["error"], answer
    assert (await fresh.get("/v1/models/bad")).status_code == 404


async def test_a_two_input_model_cannot_take_images(fresh: httpx.AsyncClient) -> None:
    import builders

    answer = await upload(fresh, "pair", builders.two_inputs(), {"preprocess": {}}, expect=422)
    assert "one input" in answer["error"]


async def test_labels_as_a_multipart_file(fresh: httpx.AsyncClient) -> None:
    text = "\ufeff" + "\r\n".join(LABELS) + "\r\n"
    config = json.dumps({"preprocess": image_kit.PREPROCESS, "postprocess": {"top_k": 2}})
    files = {"file": ("m.onnx", image_kit.classifier(), "application/octet-stream"), "config": (None, config),
             "labels": ("labels.txt", text.encode(), "text/plain")}
    r = await fresh.post("/v1/models/lab", files=files, headers=AUTH)
    assert r.status_code == 201, r.text
    assert (await fresh.get("/v1/models/lab/labels")).json()["labels"] == list(LABELS)
    got = _predictions(await fresh.post("/predict", content=PNG, headers={"content-type": "image/png"}))
    assert_same_top(got, image_kit.top_k(image_kit.classifier(), [PNG], k=2))


@pytest.mark.parametrize(
    ("labels", "config", "status", "mentions"),
    [
        ("\n".join(LABELS[:9]), None, 422, "9 labels given"),
        ("a\n\nb\n" + "\n".join(LABELS[3:]), None, 422, "label 1"),
        ("\n".join(LABELS).encode("utf-16"), None, 400, "not UTF-8"),
        ("\n".join(LABELS), {"postprocess": {"labels": list(LABELS)}}, 400, "twice"),
        ("x" * (600 * 1024), None, 413, "labels"),
        ("", None, 422, "no label"),
    ],
)
async def test_bad_labels_files(
    fresh: httpx.AsyncClient, labels: str | bytes, config: dict | None, status: int, mentions: str
) -> None:
    files = {"file": ("m.onnx", image_kit.classifier(), "application/octet-stream"),
             "labels": ("labels.txt", labels.encode() if isinstance(labels, str) else labels, "text/plain")}
    if config is not None:
        files["config"] = (None, json.dumps(config))
    r = await fresh.post("/v1/models/lab", files=files, headers=AUTH)
    assert r.status_code == status and mentions in r.json()["error"], r.text
    assert (await fresh.get("/v1/models/lab")).status_code == 404


async def test_the_folded_graph_equals_the_unfolded_one_through_the_upload_path(app: httpx.AsyncClient) -> None:
    """The same uint8 pixels: ``cls`` (normalisation folded into its first conv) and ``plain`` fed the numpy
    normalisation give the same outputs."""
    wire = image_kit.pixels([JPEGS[1], PNG])
    x = image_kit.normalised(wire)
    folded = await app.post("/predict", json={"model": "cls", "inputs": {"input": wire.tolist()}})
    unfolded = await app.post("/predict", json={"model": "plain", "inputs": {"input": x.tolist()}})
    for name in ("logits", "features"):
        np.testing.assert_allclose(folded.json()["outputs"][name], unfolded.json()["outputs"][name],
                                   rtol=1e-4, atol=1e-5)


async def test_images_for_a_tensor_model_are_415(app: httpx.AsyncClient) -> None:
    r = await app.post("/predict", params={"model": "plain"}, content=PNG, headers={"content-type": "image/png"})
    assert r.status_code == 415 and "without a preprocess config" in r.json()["error"]


async def test_the_only_model_is_used_when_none_is_named(tmp_path) -> None:
    async with serve_app(make_settings(tmp_path)) as client:
        await upload(client, "only", image_kit.classifier(), image_kit.CONFIG)
        got = _predictions(await client.post("/predict", content=JPEGS[0], headers={"content-type": "image/jpeg"}))
        assert_same_top(got, image_kit.top_k(image_kit.classifier(), JPEGS[:1]))


async def test_an_image_model_is_reused_from_the_store_after_a_restart(tmp_path) -> None:
    """Config, labels and the folded graph come back from the store: no optimizer run at the second start."""
    settings = make_settings(tmp_path)
    async with serve_app(settings) as client:
        await upload(client, "cls", image_kit.classifier(), image_kit.CONFIG)
        first = _predictions(await client.post("/predict", content=PNG, headers={"content-type": "image/png"}))
    async with serve_app(settings) as again:
        assert again.app.state.manager.optimizations == 0
        assert (await again.get("/v2/models/cls")).json()["inputs"][0]["datatype"] == "UINT8"
        assert (await again.get("/v1/models/cls/labels")).json()["labels"] == list(LABELS)
        second = _predictions(await again.post("/predict", content=PNG, headers={"content-type": "image/png"}))
    assert second == first
