"""service.runtime.fused_ops: whether the library loads here, without CUDA and without raising. (The library
built and served on the CPU provider: tests/unit/kernels; on CUDA: tests/gpu/test_gpu_fused_ops.py.)"""

from __future__ import annotations

from pathlib import Path

from onnx import helper

from service.runtime import fused_ops


def test_no_path_does_not_load() -> None:
    assert not fused_ops.library_loads(None)


def test_a_missing_file_a_directory_and_a_non_library_do_not_load(tmp_path: Path) -> None:
    bogus = tmp_path / "libbogus.so"
    bogus.write_bytes(b"not an ELF file")
    for path in (tmp_path / "libonnxcnn_ops.so", tmp_path, bogus):
        assert not fused_ops.library_loads(path)
        assert fused_ops.build_info(path) is None


def test_a_graph_uses_the_fused_ops_by_their_domain() -> None:
    def model(domain: str):
        node = helper.make_node("SqueezeExcite", ["x"], ["y"], domain=domain)
        return helper.make_model(helper.make_graph([node], "g", [], []))

    assert fused_ops.uses_fused_ops(model("ai.onnxcnn"))
    assert not fused_ops.uses_fused_ops(model(""))
