#!/usr/bin/env bash
# Create ./.venv (Python >= 3.11) and install the project into it. Idempotent and quiet when up to date.
# Usage: scripts/setup.sh [extra]   (extra: "test" adds the test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extra=${1:-}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.installed${extra:+-$extra}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extra:+[$extra]}"
  touch "$stamp"
fi
# checkov (the Kubernetes manifest policy checks) in its own environment: its pins clash with pytest's.
tools=.venv/tools/checkov
if [ "$extra" = test ] && { [ ! -x "$tools/bin/checkov" ] || [ pyproject.toml -nt "$tools/.installed" ]; }; then
  [ -x "$tools/bin/python" ] || "$PYTHON" -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$tools/bin/python" -m pip install -q --disable-pip-version-check --group pyproject.toml:checkov
  touch "$tools/.installed"
fi
