"""One acceptance rule: ``python -m service optimize`` refuses what an upload refuses, with the very message the
upload answers (``registry.acceptance.accepted_model``, called by both).

Regression: the CLI loaded weights stored beside the model (external data) and optimized it (exit 0) where
the upload refused it (400), and a hostile external path got another message from each."""

from __future__ import annotations

from pathlib import Path

import builders
import httpx
import numpy as np
import onnx
import pytest
from api_kit import upload
from onnx import TensorProto, helper, numpy_helper

from service.__main__ import main

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
