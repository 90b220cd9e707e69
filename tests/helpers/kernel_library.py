"""The custom-op library, built once per test session (CPU kernels only, with g++: seconds).

Skipped, not failed, where the machine cannot build it at all (no C++ compiler, or no way to get ONNX
Runtime's headers); a compile error fails the tests that need the library.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kernels import build, ort_headers


@pytest.fixture(scope="session")
def cpu_library() -> Path:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the custom-op library")
    try:
        return build.build(cpu_only=True).path
    except ort_headers.HeaderError as exc:
        pytest.skip(f"ONNX Runtime headers unavailable: {exc}")
