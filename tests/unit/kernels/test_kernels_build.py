"""kernels.build and kernels.ort_headers: finding nvcc, the GPU targets, the headers' API version, apt
sources, stamps; and (slow, where an nvcc exists) that the CUDA build compiles and its library loads here.
Fetching the headers: test_kernels_ort_headers.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from kernels import build, graphs, ort_headers, reference


def test_gencode_has_sass_for_each_arch_and_ptx_of_the_newest():
    assert build.gencode_flags([90]) == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    flags = build.gencode_flags([90, 80, 80])
    assert flags == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    with pytest.raises(build.BuildError, match="compute capabilities"):
        build.gencode_flags([9])
    with pytest.raises(build.BuildError):
        build.gencode_flags([])


def test_parse_archs():
    assert build.parse_archs("80,90") == (80, 90)
    with pytest.raises(Exception, match="--archs"):
        build.parse_archs("sm_90")


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_nvcc_search_order(tmp_path):
    explicit, env_nvcc, on_path = (_executable(tmp_path / d / "nvcc") for d in ("a", "b", "c"))
    home = tmp_path / "cuda"
    _executable(home / "bin" / "nvcc")
    which = lambda _name: str(on_path)  # noqa: E731
    assert build.find_nvcc(str(explicit), {"NVCC": str(env_nvcc)}, which) == explicit
    assert build.find_nvcc(None, {"NVCC": str(env_nvcc)}, which) == env_nvcc
    assert build.find_nvcc(None, {}, which) == on_path
    assert build.find_nvcc(None, {"CUDA_HOME": str(home)}, lambda _name: None) == home / "bin" / "nvcc"
    with pytest.raises(build.BuildError, match="not an executable"):
        build.find_nvcc(str(tmp_path / "missing"), {}, lambda _name: None)


def test_cuda_library_dirs_find_the_static_runtime(tmp_path):
    nvcc = _executable(tmp_path / "cu13" / "bin" / "nvcc")
    assert build.cuda_library_dirs(nvcc) == []
    (tmp_path / "cu13" / "lib").mkdir()
    (tmp_path / "cu13" / "lib" / "libcudart_static.a").write_bytes(b"")
    assert build.cuda_library_dirs(nvcc) == [tmp_path / "cu13" / "lib"]
    command = build.nvcc_command(nvcc, tmp_path / "inc", tmp_path / "out.so", [90])
    assert f"-L{tmp_path / 'cu13' / 'lib'}" in command and "-cudart=static" in command
    assert "-DONNXCNN_WITH_CUDA" in command and command[-2:] == ["-o", str(tmp_path / "out.so")]
    assert {Path(a).name for a in command if a.endswith((".cc", ".cu"))} == {
        "onnxcnn_ops.cc", "cpu_kernels.cc", "dwconv_act.cu", "se_block.cu"}


def test_stamp_changes_with_the_command_and_compiler():
    command = build.cpu_command("g++", Path("inc"), Path("out.so"))
    assert build.stamp_of(command, "g++ 12") == build.stamp_of(command, "g++ 12")
    assert build.stamp_of(command, "g++ 12") != build.stamp_of(command, "g++ 13")
    assert build.stamp_of(command, "g++ 12") != build.stamp_of([*command, "-g"], "g++ 12")


def test_header_api_version_is_read_and_checked(tmp_path):
    (tmp_path / ort_headers.HEADER).write_text("// x\n#define ORT_API_VERSION 21\n")
    assert ort_headers.api_version(tmp_path) == 21
    ort_headers.check_api_version(21, "1.31.1")
    ort_headers.check_api_version(21, "1.21.0")
    with pytest.raises(ort_headers.HeaderError, match="serves up to 20"):
        ort_headers.check_api_version(21, "1.20.1")
    with pytest.raises(ort_headers.HeaderError, match="no ORT_API_VERSION"):
        (tmp_path / ort_headers.HEADER).write_text("nothing\n")
        ort_headers.api_version(tmp_path)
    with pytest.raises(ort_headers.HeaderError, match=r"no onnxruntime_c_api\.h"):
        ort_headers.api_version(tmp_path / "missing")


def test_the_debian_mirror_is_read_from_both_apt_formats():
    deb822 = (
        "Types: deb\nURIs: http://127.0.0.1:9/debian-security\nSuites: trixie-security\n\n"
        "Types: deb\nURIs: http://127.0.0.1:9/debian\nSuites: trixie\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    assert ort_headers.debian_mirror([deb822]) == "http://127.0.0.1:9/debian"
    one_line = "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://127.0.0.1:9/debian/ trixie main\n"
    assert ort_headers.debian_mirror([one_line]) == "http://127.0.0.1:9/debian"
    assert ort_headers.debian_mirror(["deb file:/srv/mirror/debian trixie main"]) == "file:/srv/mirror/debian"
    assert ort_headers.debian_mirror(["deb http://127.0.0.1:9/debian-security trixie-security main"]) is None
    assert ort_headers.debian_mirror(["Types: deb-src\nURIs: http://127.0.0.1:9/debian\n"]) is None
    assert ort_headers.debian_mirror(["Types: deb\nURIs: http://127.0.0.1:9/debian\nEnabled: no\n"]) is None


def test_resolve_prefers_an_explicit_folder_and_never_fetches_when_told(tmp_path):
    with pytest.raises(ort_headers.HeaderError, match="not an ONNX Runtime include folder"):
        ort_headers.resolve(tmp_path, tmp_path / "default")
    with pytest.raises(ort_headers.HeaderError, match="fetching is off"):
        ort_headers.resolve(None, tmp_path / "default", allow_fetch=False)


@pytest.mark.slow
def test_cuda_build_compiles_and_its_library_loads_here(cpu_library):
    """The nvcc build (sm_90 + PTX) where an nvcc exists; without a GPU its CPU kernels still run."""
    if build.find_nvcc() is None:
        pytest.skip("no nvcc here (pip install '.[kernels]' brings one)")
    result = build.build()
    info = ctypes.CDLL(str(result.path)).OnnxcnnOpsBuildInfo
    info.restype = ctypes.c_char_p
    assert b"CUDA 13." in info() and result.cuda
    data = result.path.read_bytes()
    assert b"sm_90" in data or b".target sm_90" in data  # the fat binary's targets
    spec = graphs.SeSpec(12, 5, 5, 6)
    model = graphs.se_model(spec, fused=True)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(result.path))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = graphs.input_array((2, 12, 5, 5), seed=0)
    w = graphs.model_weights(model)
    want = reference.squeeze_excite(x, w["w1_0"], w["b1_0"], w["w2_0"], w["b2_0"], alpha=spec.alpha, beta=spec.beta)
    assert reference.within_tolerance(session.run(None, {"x": x})[0], want)
    assert np.isfinite(want).all()
