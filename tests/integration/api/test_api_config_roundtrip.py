"""One config vocabulary: what ``GET /v1/models/{name}`` and ``GET /v2/models/{name}/config`` show of a
version's config uploads unchanged as the config of a new version, which then shows the same; the names of
earlier releases are still read, with one warning per upload."""

from __future__ import annotations

import json
import logging

import builders
import httpx
import image_kit
import images
import pytest
from api_kit import AUTH, OCTET, upload

pytestmark = pytest.mark.anyio

CONFIG = {"max_batch_size": 4, "max_delay_ms": 0.3, "queue_size": 40, "timeout_s": 7.5, "precision": "fp32",
          "buckets": [1, 2, 4], "fused_conv": False, "verify_tolerance": {"rtol": 1e-3, "atol": 1e-4},
          "description": "the tiny test model"}


async def _post(client: httpx.AsyncClient, name: str, model: bytes, config: object, labels: str | None = None
                ) -> httpx.Response:
    files = {"file": ("model.onnx", model, OCTET), "config": (None, json.dumps(config))}
    if labels is not None:
        files["labels"] = ("labels.txt", labels.encode(), "text/plain")
    return await client.post(f"/v1/models/{name}", files=files, headers=AUTH)


async def _configs(client: httpx.AsyncClient, name: str) -> list[dict]:
    return [v["config"] for v in (await client.get(f"/v1/models/{name}")).json()["versions"]]


async def test_the_config_get_shows_uploads_unchanged(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    await upload(fresh, "net", tiny_bytes, CONFIG)
    (shown,) = await _configs(fresh, "net")
    assert shown == {**CONFIG, "preprocess": None, "postprocess": None}  # every key, the upload's names
    r = await _post(fresh, "net", tiny_bytes, shown)
    assert r.status_code == 201, r.text
    assert await _configs(fresh, "net") == [shown, shown]


async def test_the_triton_config_uploads_unchanged(fresh: httpx.AsyncClient, tiny_bytes: bytes) -> None:
    await upload(fresh, "net", tiny_bytes, CONFIG)
    triton = (await fresh.get("/v2/models/net/config")).json()
    assert triton["max_batch_size"] == 4 and triton["dynamic_batching"] == {"max_queue_delay_microseconds": 300}
    assert json.loads(triton["parameters"]["precision"]["string_value"]) == "fp32"
    r = await _post(fresh, "net", tiny_bytes, triton)
    assert r.status_code == 201, r.text
    assert (await fresh.get("/v2/models/net/versions/2/config")).json() == triton
    first, second = await _configs(fresh, "net")
    assert second == first


async def test_a_classifier_round_trips_with_its_labels(fresh: httpx.AsyncClient) -> None:
    model = image_kit.classifier()
    await upload(fresh, "cls", model, image_kit.CONFIG)
    (shown,) = await _configs(fresh, "cls")
    assert shown["postprocess"] == {"softmax": True, "top_k": 5, "label_count": 10}
    labels = (await fresh.get("/v1/models/cls/labels", headers={"accept": "text/plain"})).text
    wrong = await _post(fresh, "cls", model, shown, labels="a\nb\n")
    assert wrong.status_code == 422 and "label_count is 10, but 2 labels" in wrong.json()["error"], wrong.text
    r = await _post(fresh, "cls", model, shown, labels=labels)
    assert r.status_code == 201, r.text
    assert await _configs(fresh, "cls") == [shown, shown]
    assert (await fresh.get("/v1/models/cls/versions/2/labels")).json()["labels"] == list(image_kit.LABELS)


async def test_a_classifiers_shown_config_uploads_unchanged_with_another_classifier(fresh: httpx.AsyncClient) -> None:
    """What GET shows of a classifier (its labels counted, not listed) uploads unchanged without the labels, also
    with a classifier of another class count: the count counts no labels, so the new model reports indices."""
    await upload(fresh, "cls", image_kit.classifier(), image_kit.CONFIG)
    (shown,) = await _configs(fresh, "cls")
    assert shown["postprocess"]["label_count"] == 10
    other = builders.tiny_cnn(seed=3, classes=7)
    r = await _post(fresh, "other", other, shown)
    assert r.status_code == 201, r.text
    (taken,) = await _configs(fresh, "other")
    assert taken == {**shown, "postprocess": {**shown["postprocess"], "label_count": None}}
    assert (await fresh.get("/v1/models/other/labels")).status_code == 404
    r = await fresh.post("/predict", params={"model": "other"}, content=images.jpeg(40, 30),
                         headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    assert [sorted(p) for p in r.json()["predictions"][0]] == [["index", "score"]] * 5  # indices, no labels


async def test_deprecated_names_are_read_with_one_warning(
    fresh: httpx.AsyncClient, tiny_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    old = {"max_delay_s": 0.002, "tolerance": {"rtol": 1e-3, "atol": 1e-4}, "verify": False}
    with caplog.at_level(logging.WARNING, logger="service.model_config"):
        r = await _post(fresh, "net", tiny_bytes, old)
    assert r.status_code == 201, r.text
    (shown,) = await _configs(fresh, "net")
    assert shown["max_delay_ms"] == pytest.approx(2.0) and shown["verify_tolerance"] == old["tolerance"]
    assert r.json()["report"]["verified"] is True, "a model's config never switches verification off"
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == "service.model_config"]
    assert len(warnings) == 1, warnings
    assert all(word in warnings[0] for word in ("max_delay_s", "max_delay_ms", "tolerance", "verify")), warnings


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"max_delay_s": 0.002, "max_delay_ms": 2}, "give max_delay_ms only"),
        ({"platform": "tensorflow_savedmodel"}, "platform must be 'onnxruntime_onnx'"),
        ({"platform": "onnxruntime_onnx", "instance_group": []}, "no field instance_group"),
        ({"parameters": {"precision": "fp16"}}, "parameters.precision"),
        ({"parameters": {"max_batch_size": {"string_value": "4"}}}, "Triton's own field"),
        ({"dynamic_batching": {"max_queue_delay_microseconds": "soon"}}, "max_queue_delay_microseconds"),
        ({"parameters": {"nope": {"string_value": "1"}}}, "nope"),
    ],
)
async def test_configs_that_cannot_be_read_are_422_naming_why(
    fresh: httpx.AsyncClient, tiny_bytes: bytes, config: dict, named: str
) -> None:
    r = await _post(fresh, "net", tiny_bytes, config)
    assert r.status_code == 422 and named in r.json()["error"], r.text
