"""``python -m service optimize``: an unwritable output is a one-line error, never a traceback; the output is
an ordinary file (mode 0644 less the umask).

Regression: ``save_model_file``'s OSError escaped ``_cmd_optimize`` (only ServiceError was caught).
"""

from __future__ import annotations

import os
import stat

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.__main__ import main


def _write_conv(path) -> None:
    weight = np.random.default_rng(0).standard_normal((2, 2, 1, 1)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 4, 4])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(path))


def test_unwritable_output_is_a_clear_error(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    _write_conv(src)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")

    rc = main(["optimize", str(src), str(blocker / "out.onnx")])

    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: cannot write") and "Traceback" not in err
    assert not (tmp_path / "file").is_dir()


def test_writable_output_is_written(tmp_path, capsys):
    src, out = tmp_path / "m.onnx", tmp_path / "sub" / "out.onnx"
    _write_conv(src)

    assert main(["optimize", str(src), str(out)]) == 0

    onnx.checker.check_model(onnx.load(str(out)))
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_output_is_an_ordinary_file_under_the_umask(tmp_path, capsys, umask):
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    _write_conv(src)
    before = os.umask(umask)
    try:
        assert main(["optimize", str(src), str(out)]) == 0
    finally:
        os.umask(before)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out.onnx"], "no temp file is left"
