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
