"""The load test's hand-built KServe binary requests and its response checks, against tritonclient.

The official client is the reference for the wire format: our request must be the bytes it would send,
and a response it builds must pass our checks while a wrong shape or truncated payload must not.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
th = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is the wire-format reference")


@pytest.fixture(scope="module")
def lf():
    spec = importlib.util.spec_from_file_location("loadtest_payloads", ROOT / "loadtests" / "payloads.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


METADATA = {
    "name": "tiny",
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 4, 4]}],
    "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}],
}


def test_binary_request_is_byte_identical_to_tritonclients(lf) -> None:
    info = lf.parse_metadata(METADATA)
    arrays = lf.make_inputs(info, batch=2, seed=3)
    assert arrays["input"].shape == (2, 3, 4, 4) and arrays["input"].dtype == np.float32
    body, header_len = lf.kserve_binary_body(info, arrays)

    tin = th.InferInput("input", [2, 3, 4, 4], "FP32")
    tin.set_data_from_numpy(arrays["input"], binary_data=True)
    ref_body, ref_len = th.InferenceServerClient.generate_request_body(
        [tin], outputs=[th.InferRequestedOutput("output", binary_data=True)]
    )
    assert header_len == ref_len
    assert body == bytes(ref_body)


def _response(outputs: dict[str, np.ndarray], *, truncate: int = 0) -> tuple[bytes, str]:
    header = {
        "model_name": "tiny",
        "outputs": [
            {
                "name": k,
                "datatype": "FP32",
                "shape": list(v.shape),
                "parameters": {"binary_data_size": v.nbytes},
            }
            for k, v in outputs.items()
        ],
    }
    head = json.dumps(header).encode()
    body = head + b"".join(v.tobytes() for v in outputs.values())
    return body[: len(body) - truncate], str(len(head))


def test_binary_response_check_accepts_the_right_shape_only(lf) -> None:
    info = lf.parse_metadata(METADATA)
    good, length = _response({"output": np.arange(20, dtype=np.float32).reshape(2, 10)})
    parsed = th.InferResult.from_response_body(good, header_length=int(length))  # the reference reads it
    assert parsed.as_numpy("output").shape == (2, 10)
    assert lf.check_kserve_response(info, good, length, batch=2) is None

    assert "shape" in lf.check_kserve_response(info, good, length, batch=1)
    wrong, length = _response({"output": np.zeros((2, 9), np.float32)})
    assert "shape" in lf.check_kserve_response(info, wrong, length, batch=2)
    short, length = _response({"output": np.zeros((2, 10), np.float32)}, truncate=4)
    assert "bytes" in lf.check_kserve_response(info, short, length, batch=2)
    other, length = _response({"logits": np.zeros((2, 10), np.float32)})
    assert "missing" in lf.check_kserve_response(info, other, length, batch=2)


def test_json_predict_body_and_check(lf) -> None:
    info = lf.parse_metadata(METADATA)
    arrays = lf.make_inputs(info, batch=1, seed=0)
    body = json.loads(lf.predict_body(info, arrays))
    assert body["model"] == "tiny"
    sent = np.asarray(body["inputs"]["input"], dtype=np.float32)
    np.testing.assert_allclose(sent, arrays["input"], atol=5e-5)
    assert lf.check_predict_response(info, {"outputs": {"output": [[0.0] * 10]}}, batch=1) is None
    assert "shape" in lf.check_predict_response(info, {"outputs": {"output": [[0.0] * 9]}}, batch=1)
    assert "missing" in lf.check_predict_response(info, {"outputs": {}}, batch=1)


def test_dynamic_non_batch_dims_need_an_explicit_shape(lf) -> None:
    tensor = lf.Tensor("input", "FP32", (-1, 3, -1, -1))
    with pytest.raises(ValueError, match="LOADTEST_SHAPE"):
        lf.concrete_shape(tensor, 1)
    assert lf.concrete_shape(tensor, 4, "3,64,64") == (4, 3, 64, 64)


def test_grpc_request_and_response_check(lf) -> None:
    """The prebuilt gRPC request carries the raw tensor; the check accepts a right answer only."""
    from tritonclient.grpc import service_pb2 as pb

    info = lf.parse_metadata(METADATA)
    arrays = lf.make_inputs(info, batch=2, seed=5)
    request = lf.grpc_infer_request(info, arrays)
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [("input", "FP32", [2, 3, 4, 4])]
    assert request.raw_input_contents[0] == arrays["input"].astype("<f4").tobytes()
    response = pb.ModelInferResponse(model_name="tiny")
    response.outputs.add(name="output", datatype="FP32", shape=[2, 10])
    response.raw_output_contents.append(np.zeros((2, 10), np.float32).tobytes())
    assert lf.check_grpc_response(info, response, 2) is None
    assert "shape" in lf.check_grpc_response(info, response, 3)
    response.raw_output_contents[0] = b"\0" * 8
    assert "raw_output_contents" in lf.check_grpc_response(info, response, 2)
    metadata = pb.ModelMetadataResponse(name="tiny")
    metadata.inputs.add(name="input", datatype="FP32", shape=[-1, 3, 4, 4])
    metadata.outputs.add(name="output", datatype="FP32", shape=[-1, 10])
    assert lf.parse_metadata(lf.grpc_metadata(metadata)) == info


def test_the_readme_lists_every_user_of_the_locustfile_and_counts_them() -> None:
    """loadtests/README.md names each user class of locustfile.py once in its table, and says how many there are
    (it said "four kinds of traffic" and listed three)."""
    import re

    source = (ROOT / "loadtests" / "locustfile.py").read_text(encoding="utf-8")
    users = re.findall(r"^class ([A-Z]\w*User)\(", source, re.M)
    readme = (ROOT / "loadtests" / "README.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `(\w+User)` \|", readme, re.M)
    assert sorted(listed) == sorted(users), (listed, users)
    words = {2: "two", 3: "three", 4: "four", 5: "five"}
    assert f"with {words[len(users)]} kinds of users" in readme
