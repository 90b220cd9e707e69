"""service.runtime.fused_ops.probe: never raises, says why a library is not usable. (A usable library on the
CPU provider: tests/unit/kernels/test_kernels_library.py; on CUDA: bench/fused_ops.py on the GPU machine.)"""

from __future__ import annotations

import pytest

from service.runtime import fused_ops
from service.runtime.device import cuda_status

CPU = "CPUExecutionProvider"


def test_no_path_is_not_usable():
    status = fused_ops.probe(None)
    assert not status.usable and "no fused-op library" in status.reason


def test_missing_file_is_named_without_its_directory(tmp_path):
    status = fused_ops.probe(tmp_path / "libonnxcnn_ops.so", provider=CPU)
    assert not status.usable
    assert "libonnxcnn_ops.so not found" in status.reason and str(tmp_path) not in status.reason


def test_a_directory_is_not_a_library(tmp_path):
    status = fused_ops.probe(tmp_path, provider=CPU)
    assert not status.usable and "is not a file" in status.reason


def test_a_file_that_is_no_library_is_reported_not_raised(tmp_path):
    bogus = tmp_path / "libbogus.so"
    bogus.write_bytes(b"not an ELF file")
    status = fused_ops.probe(bogus, provider=CPU)
    assert not status.usable and status.build_info is None
    assert status.reason.startswith("fused-op library unusable on CPUExecutionProvider")
    assert str(tmp_path) not in status.reason


def test_unknown_provider(tmp_path):
    bogus = tmp_path / "lib.so"
    bogus.write_bytes(b"x")
    status = fused_ops.probe(bogus, provider="TensorrtExecutionProvider")
    assert not status.usable and "unsupported provider" in status.reason


@pytest.mark.skipif(cuda_status()[0], reason="CUDA is usable here")
def test_cuda_probe_without_cuda_says_so(tmp_path):
    bogus = tmp_path / "lib.so"
    bogus.write_bytes(b"x")
    status = fused_ops.probe(bogus)
    assert not status.usable and status.reason.startswith("CUDA not usable")
