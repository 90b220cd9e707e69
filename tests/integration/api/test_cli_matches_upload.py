"""One acceptance rule: ``python -m service optimize`` refuses what an upload refuses, with the very message the
upload answers, and takes what it takes (``registry.acceptance.accepted_model``, called by both).

Regression: the CLI loaded weights stored beside the model (external data) and optimized it (exit 0) where
the upload refused it (400), and a hostile external path got another message from each."""

from __future__ import annotations

from pathlib import Path

import builders
import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from api_kit import reference, sample, upload
from onnx import TensorProto, helper, numpy_helper

from service.__main__ import main
from service.optimizer.ir_version import runtime_ir_version

pytestmark = pytest.mark.anyio


def _beside(folder: Path) -> Path:
    """``m.onnx`` with its weights in ``m.onnx.data`` next to it, as ``torch.onnx.export(dynamo=True)`` writes."""
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 3, 3])],
        [numpy_helper.from_array(np.ones((3, 2, 3, 3), np.float32), "w")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / "m.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert (folder / "m.onnx.data").stat().st_size == 3 * 2 * 3 * 3 * 4
    return path


def _hostile(folder: Path) -> Path:
    path = folder / "hostile.onnx"
    path.write_bytes(builders.external_initializer("../../etc/passwd"))
    return path


@pytest.mark.parametrize("make", [_beside, _hostile], ids=["external data beside the model", "hostile path"])
async def test_the_cli_refuses_what_the_upload_refuses_with_its_message(
    fresh: httpx.AsyncClient, tmp_path: Path, capsys: pytest.CaptureFixture[str], make
) -> None:
    path = make(tmp_path)
    answer = (await upload(fresh, "m", path.read_bytes(), expect=400))["error"]
    assert main(["optimize", str(path), str(tmp_path / "out.onnx")]) == 1
    assert capsys.readouterr().err == f"error: {answer}\n"
    assert "external data" in answer and not (tmp_path / "out.onnx").exists()


async def test_a_model_onnx_writes_today_uploads_serves_and_optimizes(
    fresh: httpx.AsyncClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``onnx.helper.make_model`` without ``ir_version`` stamps onnx's newest IR (14 with onnx 1.23), newer than
    ONNX Runtime reads; nothing in the model needs it, so it is lowered and served (was: 422), and the CLI takes
    it too (its output loads in ONNX Runtime)."""
    original = builders.tiny_cnn(seed=0)
    today = builders.newest_ir(original)
    assert onnx.load_from_string(today).ir_version == onnx.IR_VERSION > runtime_ir_version()
    await upload(fresh, "today", today)
    x = sample(2)
    r = await fresh.post("/predict", json={"model": "today", "inputs": {"input": x.tolist()}})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["outputs"]["logits"], reference(original, x)["logits"], rtol=1e-4, atol=1e-5)

    path, out = tmp_path / "today.onnx", tmp_path / "out.onnx"
    path.write_bytes(today)
    assert main(["optimize", str(path), str(out)]) == 0, capsys.readouterr().err
    written = onnx.load(str(out))
    assert written.ir_version <= runtime_ir_version()
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(["logits"], {"input": x})[0]
    np.testing.assert_allclose(got, reference(original, x)["logits"], rtol=1e-4, atol=1e-5)


async def test_a_model_that_needs_the_newer_ir_is_400_naming_the_fix(fresh: httpx.AsyncClient) -> None:
    newest = onnx.defs.onnx_opset_version()
    if helper.find_min_ir_version_for([helper.make_opsetid("", newest)]) <= runtime_ir_version():
        pytest.skip("onnx's newest opset needs no IR version newer than ONNX Runtime reads")
    answer = (await upload(fresh, "m", builders.newest_ir(builders.tiny_cnn(), opset=newest), expect=400))["error"]
    assert f"re-export with ir_version <= {runtime_ir_version()}" in answer, answer
