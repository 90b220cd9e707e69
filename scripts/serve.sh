#!/usr/bin/env bash
# Set up (first run only) and start the service on http://127.0.0.1:8000 with the bundled demo model.
# Extra arguments go to `python -m service serve` (e.g. --port 9000); settings come from SERVICE_* variables.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m service serve "$@"
