#!/usr/bin/env bash
# Set up (first run only) and run the linters and the whole test suite, e2e included.
# Extra arguments go to pytest (e.g. -k batcher). GPU tests are skipped where CUDA is not usable.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test || exit 1
.venv/bin/ruff check service tests bench loadtests || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests: the test setup is broken" >&2
  exit 1
fi
exit "$rc"
