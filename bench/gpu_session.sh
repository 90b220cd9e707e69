#!/usr/bin/env bash
# The GPU session's measurements, as run on the device machine (after ../shared/gpu/stage and its
# setup calls): `bench/gpu_session.sh engine` then `bench/gpu_session.sh service`. Everything lands in
# $OUT (logs and JSON), which the lead copies into bench/results/.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
part=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/gpu.txt"
if [ "$part" = engine ] || [ "$part" = all ]; then
  timeout "${ENGINE_TIMEOUT_S:-330}" python3 bench/engine.py --deadline-s "${ENGINE_DEADLINE_S:-280}" \
    --out-dir "$OUT" 2>&1 | tee "$OUT/engine.log"
fi
if [ "$part" = service ] || [ "$part" = all ]; then
  timeout "${SERVICE_TIMEOUT_S:-230}" python3 bench/service.py --device cuda --quick --client-procs 4 \
    --concurrency 1,8,32,64 --out "$OUT/service-cuda.json" 2>&1 | tee "$OUT/service.log"
  timeout "${TESTS_TIMEOUT_S:-60}" python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log"
fi
