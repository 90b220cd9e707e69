"""The CPU image installs the OpenVINO EP plugin (build arg EXTRAS=openvino in the compose CPU service); the GPU
image does not."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _requirements(extras: str) -> list[str]:
    """The Dockerfile's dependency-layer snippet, run on the real pyproject.toml with EXTRAS set."""
    text = (ROOT / "Dockerfile").read_text()
    code = re.search(r'RUN python -c "(import os, tomllib.*?)"\s', text).group(1)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30,
                            env={**os.environ, "EXTRAS": extras}, check=True)
    return [line for line in result.stdout.splitlines() if line]


def test_the_extras_build_arg_adds_the_openvino_plugin() -> None:
    plain, cpu = _requirements(""), _requirements("openvino")
    assert not any(r.startswith("onnxruntime-ep-openvino") for r in plain)
    assert [r for r in cpu if r not in plain] == ["onnxruntime-ep-openvino>=1.8"]
    assert any(r.startswith("onnxruntime-gpu") for r in cpu)  # the plugin loads into it, it replaces nothing
    assert "ARG EXTRAS=" in (ROOT / "Dockerfile").read_text()


def test_the_openvino_extra_and_the_test_extra_name_the_plugin() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["openvino"] == ["onnxruntime-ep-openvino>=1.8"]
    assert "onnxruntime-ep-openvino>=1.8" in extras["test"]


def test_compose_builds_the_cpu_image_with_openvino() -> None:
    yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read docker/compose.yaml")
    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    cpu, gpu = services["serve-cpu"], services["serve"]
    assert cpu["build"]["args"] == {"EXTRAS": "openvino"}
    assert "args" not in gpu["build"]
    assert cpu["image"] != gpu["image"], "the two images must not overwrite each other's tag"
