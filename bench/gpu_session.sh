#!/usr/bin/env bash
# The GPU session's measurements, as run on the device machine (after ../shared/gpu/stage and its
# setup calls), one or more parts per call:
#   bench/gpu_session.sh PART [PART...]   PART: probe|hostcopy|tuner|engine|service|tests|bisect|floor|sharing|census|all
# Several parts in one call run in the order above (one call saves the machine's idle time between calls).
# Extra arguments: ENGINE_ARGS (bench/engine.py, e.g. "--models mnv3_2019,resnet50"), SERVERS, SERIES, CONCURRENCY, WORKERS,
# TUNER_MODEL and TUNER_PRECISION (bench/tuner_check.py), CENSUS_ARGS (bench/kernel_census.py, e.g. "--models mnv3"),
# FLOOR_ARGS (bench/http_overhead.py, e.g. "--variants service,floor_raw").
# Everything lands in $OUT (logs and JSON), which the lead copies into bench/results/. Run it from a
# `git archive` snapshot with GIT_COMMIT=<that commit> exported: git on the device machine would name
# whatever stale checkout surrounds the snapshot in every result header.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
parts=" ${*:-all} "
want() { [[ $parts == *" $1 "* ]] || { [[ $parts == *" all "* ]] && [ "${2:-}" != only ]; }; }
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/gpu.txt"
nproc | sed 's/^/cpus: /' | tee -a "$OUT/gpu.txt"
# uvicorn[standard]'s parser: ../shared/gpu/stage fetches plain uvicorn, so stage with `../shared/gpu/stage httptools`
python3 -c 'import httptools' 2>/dev/null \
  || echo "WARNING: httptools missing: uvicorn falls back to its pure-Python parser (h11); service figures will be low" \
  | tee -a "$OUT/gpu.txt"
if want probe; then
  timeout "${PROBE_TIMEOUT_S:-240}" python3 bench/cuda_probe.py --deadline-s "${PROBE_DEADLINE_S:-220}" \
    --out "$OUT/cuda-probe.json" 2>&1 | tee "$OUT/probe.log" | tail -40
fi
if want hostcopy; then  # the engine's row copies against whole-bucket copies; which memory page-locks (~1.5 min)
  timeout "${HOSTCOPY_TIMEOUT_S:-150}" python3 bench/host_copy.py --out "$OUT/host-copy.json" 2>&1 \
    | tee "$OUT/hostcopy.log" | tail -30
fi
if want tuner; then  # what precision "auto" serves for one model, and its times (about 2 minutes)
  timeout "${TUNER_TIMEOUT_S:-200}" python3 bench/tuner_check.py --model "${TUNER_MODEL:-resnet50}" \
    --precision "${TUNER_PRECISION:-auto}" --out "$OUT/tuner-check.json" 2>&1 | tee "$OUT/tuner.log" | tail -20
fi
if want engine; then
  timeout "${ENGINE_TIMEOUT_S:-560}" python3 bench/engine.py --deadline-s "${ENGINE_DEADLINE_S:-500}" \
    --out-dir "$OUT" ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine.log" | tail -80
fi
if want service; then
  # client_ceiling first: what the load generator can send on this host bounds every other figure
  timeout "${SERVICE_TIMEOUT_S:-560}" python3 bench/service.py --device cuda --quick \
    --client "${CLIENT:-raw}" --client-procs "${CLIENT_PROCS:-4}" \
    --servers "${SERVERS:-client_ceiling,service,service_workers,service_nobatch,naive}" --workers "${WORKERS:-4}" \
    --series "${SERIES:-binary,json}" --concurrency "${CONCURRENCY:-1,8,32,64}" --out "$OUT/service-cuda.json" 2>&1 | tee "$OUT/service.log" | tail -90
fi
if want tests; then
  timeout "${TESTS_TIMEOUT_S:-120}" python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
fi
if want bisect only; then
  timeout "${BISECT_TIMEOUT_S:-200}" python3 bench/cuda_bisect.py --timeout-s 45 --max-tries 9 \
    --out "$OUT/cuda-bisect.json" 2>&1 | tee "$OUT/bisect.log" | tail -30
fi
if want floor only; then  # the HTTP stack's own cost on this host (CPU provider, a near-empty model)
  timeout "${FLOOR_TIMEOUT_S:-240}" python3 bench/http_overhead.py --rounds "${FLOOR_ROUNDS:-3}" --requests 300 ${FLOOR_ARGS:-} \
    --out "$OUT/http-overhead.json" 2>&1 | tee "$OUT/floor.log" | tail -14
fi
if want sharing only; then  # N processes on one GPU; b64 variants without CUDA graphs
  timeout "${SHARING_TIMEOUT_S:-540}" python3 bench/gpu_sharing.py --parts "${SHARING_PARTS:-sharing,b64}" \
    --sharing-plan "${SHARING_PLAN:-1@0,2@0,4@0,1@1,4@1}" --out "$OUT/gpu-sharing.json" 2>&1 \
    | tee "$OUT/sharing.log" | tail -30
fi
if want census only; then
  timeout "${CENSUS_TIMEOUT_S:-240}" python3 bench/kernel_census.py ${CENSUS_ARGS:-} --out "$OUT/kernel-census.json" 2>&1 \
    | tee "$OUT/census.log" | tail -30
fi
