"""Images in, labels out over gRPC, with ``tritonclient.grpc`` as users call it: encoded JPEG/PNG images as a
BYTES input (raw, as the client serializes BYTES, and typed ``bytes_contents``), the classification extension
(``class_count``) as BYTES strings; every answer equal to the reference pipeline (tests/helpers/image_kit.py:
the same decoder, numpy normalisation, ONNX Runtime on the original float model) and to REST's."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import image_kit
import images
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_kit import put_model, start
from image_kit import assert_same_strings, class_strings, parse_class_strings
from threaded_server import ThreadedServer
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

JPEGS = [images.jpeg(40, 30, seed=s) for s in (1, 2)]
PNG = images.png(30, 44, seed=3)
MODEL = image_kit.classifier()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    """``cls``: the 10-class classifier as an image model (uint8 wire, labels); ``plain``: the same model
    without an image config."""
    server = start(tmp_path_factory.mktemp("grpc-images"))
    try:
        put_model(server.url, "cls", MODEL, json.dumps(image_kit.CONFIG))
        put_model(server.url, "plain", MODEL)
        yield server
    finally:
        server.stop()


def image_input(blobs: list[bytes], shape: list[int] | None = None) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("input", shape or [len(blobs)], "BYTES")
    tensor.set_data_from_numpy(np.array(blobs, dtype=object).reshape(shape or [len(blobs)]))
    return tensor


def test_encoded_images_give_the_reference_logits(live: ThreadedServer) -> None:
    client = grpcclient.InferenceServerClient(live.grpc_target)
    batch = [JPEGS[0], PNG, JPEGS[1]]
    for shape in ([3], [3, 1]):
        result = client.infer("cls", [image_input(batch, shape)], outputs=[grpcclient.InferRequestedOutput("logits")])
        np.testing.assert_allclose(result.as_numpy("logits"), image_kit.logits(MODEL, batch), rtol=1e-4, atol=1e-5)


def test_typed_bytes_contents_are_accepted(live: ThreadedServer) -> None:
    """A client that fills ``contents.bytes_contents`` instead of ``raw_input_contents``."""
    with grpc.insecure_channel(live.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        tensor = pb.ModelInferRequest.InferInputTensor(name="input", datatype="BYTES", shape=[2])
        tensor.contents.bytes_contents.extend(JPEGS)
        answer = stub.ModelInfer(pb.ModelInferRequest(model_name="cls", inputs=[tensor]))
    spec = next(i for i, o in enumerate(answer.outputs) if o.name == "logits")
    logits = np.frombuffer(answer.raw_output_contents[spec], dtype="<f4").reshape(answer.outputs[spec].shape)
    np.testing.assert_allclose(logits, image_kit.logits(MODEL, JPEGS), rtol=1e-4, atol=1e-5)


def test_the_classification_extension_matches_the_reference_and_rest(live: ThreadedServer) -> None:
    client = grpcclient.InferenceServerClient(live.grpc_target)
    top3 = grpcclient.InferRequestedOutput("logits", class_count=3)
    result = client.infer("cls", [image_input(JPEGS)], outputs=[top3])
    rows = result.as_numpy("logits")
    (out,) = result.get_response(as_json=True)["outputs"]
    assert (out["datatype"], [int(d) for d in out["shape"]]) == ("BYTES", [2, 3])
    assert_same_strings(parse_class_strings(rows), class_strings(image_kit.top_k(MODEL, JPEGS, k=3)))

    rest = httpclient.InferenceServerClient(live.url.removeprefix("http://"))
    tensor = httpclient.InferInput("input", [2], "BYTES")
    tensor.set_data_from_numpy(np.array(JPEGS, dtype=object), binary_data=True)
    answer = rest.infer("cls", [tensor], outputs=[httpclient.InferRequestedOutput("logits", class_count=3)])
    assert answer.as_numpy("logits").tolist() == rows.tolist()


def test_classification_of_a_tensor_request_without_labels_ranks_raw_values(live: ThreadedServer) -> None:
    """As Triton: ``score:index`` of the raw output (no softmax, no label) for a model without postprocess."""
    client = grpcclient.InferenceServerClient(live.grpc_target)
    x = image_kit.normalised(image_kit.pixels(JPEGS[:1]))
    tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("plain", [tensor], outputs=[grpcclient.InferRequestedOutput("logits", class_count=2)])
    raw = image_kit.logits(MODEL, JPEGS[:1])[0]
    best = np.argsort(-raw, kind="stable")[:2]
    assert [s.decode() for s in result.as_numpy("logits").reshape(-1)] == [f"{raw[i]:f}:{i}" for i in best]


@pytest.mark.parametrize(
    ("model", "inputs", "class_count", "mentions"),
    [
        ("cls", lambda: [image_input(JPEGS + JPEGS, [2, 2])], 0, "shape [N] or [N, 1]"),
        ("cls", lambda: [image_input([b"not an image"])], 0, "image"),
        ("plain", lambda: [image_input(JPEGS)], 0, "BYTES is not supported"),
        ("cls", lambda: [image_input(JPEGS)], 1001, "classification must be an integer from 1 to 1000"),
    ],
    ids=["bad-shape", "not-an-image", "not-an-image-model", "k-too-large"],
)
def test_bad_image_requests_are_invalid_argument(live: ThreadedServer, model, inputs, class_count, mentions) -> None:
    client = grpcclient.InferenceServerClient(live.grpc_target)
    outputs = [grpcclient.InferRequestedOutput("logits", class_count=class_count)]
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, inputs(), outputs=outputs)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value
    assert mentions in caught.value.message(), caught.value.message()
    assert client.is_server_live()
