"""Images through the official tritonclient against a real server subprocess: encoded images as a BYTES
tensor, uint8 tensors, and ``InferRequestedOutput(..., class_count=k)`` parsed as tritonclient parses it,
all equal to the reference pipeline (tests/helpers/image_kit.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import image_kit
import images
import numpy as np
import pytest
from live_server import AUTH, OCTET, running

pytestmark = pytest.mark.e2e

JPEGS = [images.jpeg(48, 36, seed=s) for s in (11, 12, 13)]


def test_tritonclient_bytes_images_uint8_tensors_and_class_count(tmp_path: Path) -> None:
    import tritonclient.http as triton

    model = image_kit.classifier()
    with running(tmp_path / "models", tmp_path / "logs") as server:
        r = httpx.post(f"{server.url}/v1/models/cls", content=model, params={"config": json.dumps(image_kit.CONFIG)},
                       headers={**AUTH, "content-type": OCTET}, timeout=120)
        assert r.status_code == 201, r.text
        want3 = image_kit.class_strings(image_kit.top_k(model, JPEGS, k=3))
        with triton.InferenceServerClient(url=f"127.0.0.1:{server.port}") as client:
            assert "classification" in client.get_server_metadata()["extensions"]
            encoded = triton.InferInput("input", [len(JPEGS)], "BYTES")
            encoded.set_data_from_numpy(np.array(JPEGS, dtype=np.object_), binary_data=True)
            wire = image_kit.pixels(JPEGS)
            pixels = triton.InferInput("input", list(wire.shape), "UINT8")
            pixels.set_data_from_numpy(wire)
            for tensor in (encoded, pixels):
                for binary in (True, False):
                    out = triton.InferRequestedOutput("logits", binary_data=binary, class_count=3)
                    got = client.infer("cls", [tensor], outputs=[out]).as_numpy("logits")
                    assert got.shape == (3, 3)
                    image_kit.assert_same_strings(image_kit.parse_class_strings(got), want3)
            logits = client.infer("cls", [encoded], outputs=[triton.InferRequestedOutput("logits")]).as_numpy("logits")
            np.testing.assert_allclose(logits, image_kit.logits(model, JPEGS), rtol=1e-4, atol=1e-5)
        assert server.terminate() == 0
