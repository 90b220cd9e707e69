#!/usr/bin/env bash
# Set up (first run only) and run the linters and the whole test suite, e2e included.
# Extra arguments go to pytest (e.g. -k batcher). GPU tests are skipped where CUDA is not usable.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test || exit 1
# Optional: the PyTorch exporter tests (tests/integration/test_torch_exports.py) run where torch imports.
# PyPI's torch is a multi-GB CUDA build, so torch is installed only from a local CPU wheel when one is there
# (this project's CI machines keep one in /opt/wheels; point TORCH_WHEEL_DIR elsewhere if you have one).
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  tag=$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls "${TORCH_WHEEL_DIR:-/opt/wheels}"/torch-*+cpu-"$tag"-*.whl 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "$wheel" onnxscript || echo "torch not installed: exporter tests will be skipped" >&2
  fi
fi
.venv/bin/ruff check service tests bench loadtests kernels scripts || exit 1
# Two test processes, each taking whole files (their module-scoped servers stay in one process): the suite
# waits on servers and subprocesses more than it computes (two cores: 656 s in one process, 393 s in two).
# Pass -n 0 to run in one process.
.venv/bin/python -m pytest -n 2 --dist loadfile "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests: the test setup is broken" >&2
  exit 1
fi
exit "$rc"
