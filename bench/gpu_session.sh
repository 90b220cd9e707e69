#!/usr/bin/env bash
# The GPU machine's measurements, run there after ../shared/gpu/stage and its setup calls:
#   bench/gpu_session.sh PART [PART...]
# PART: check | triton | tests | fused | fault | shapes | kbuild | census | cold | coldwarm | coldfresh | engine |
#       shm | service | all
#   check       nvidia-smi, versions, httptools
#   triton      installs Triton's server (.gpu/triton/nvidia_pytriton-*.whl, staged by bench/stage_triton.sh and
#               carried in a call of its own: the script's header says how) into /tmp/site once, and checks that
#               the Python backend's stub for python3 finds its libraries (libpython among them)
#   tests       pytest ${TESTS:-tests/gpu}
#   fused       bench/fused_ops.py (the fused CUDA operators: build, check, model timing; FUSED_PHASES)
#   cold        bench/coldstart.py --store both: COLD_RUNS warm-store starts (COLD_PARALLEL at once), then
#               COLD_RUNS fresh-store starts (COLD_PARALLEL_FRESH at once); no start begins after
#               COLD_DEADLINE_S, and the file is rewritten after every start (COLD_ENV: extra --env SERVICE_X=Y)
#   coldwarm    the warm-store half of cold alone; coldfresh the fresh-store half alone
#   fault       bench/nchw_fault.py (FAULT_DEADLINE_S): which NCHW configurations fault the GPU, sanitized
#   shapes      bench/graph_shapes.py (SHAPES_REPS, SHAPES_DEADLINE_S): CUDA graphs of every bucket in one
#               session against one session per bucket, each case in its own process, checked against the CPU
#   kbuild      python3 -m kernels.build (the fused-op library; skipped when already built from these sources)
#   census      bench/kernel_census.py: kernels per batch-1 inference, before/after the fused ops where built
#   engine      bench/engine.py (ENGINE_ARGS; the tuner also times the fused-op variant where it is built)
#   shm         bench/shared_memory.py --device cuda: a lone request in system and CUDA shared memory against the
#               body, alternating (CUDA needs cuda.bindings: ../shared/gpu/stage cuda-bindings)
#   service     bench/service.py --device cuda (SERVERS, SERIES, CONCURRENCY, WORKERS, ROUNDS, SERVICE_ARGS such as
#               --shared-memory); SERVERS defaults to
#               client_ceiling,service,service_workers, plus triton where the triton part installed it (then
#               Triton and our servers run side by side in ROUNDS alternating rounds: e.g. SERIES=binary,grpc)
# Parts run in the order given. Everything lands under $OUT/session and is packed into $OUT/session.tgz at
# the end (the device tool brings back at most 8 files). Export GIT_COMMIT=<commit> (git there would name an
# unrelated checkout).
#
# Device calls (600 s each at most; every part below fits in 560 s), after the six setup calls of
# ../shared/gpu/stage, each as: source .gpu/device-setup.sh && GIT_COMMIT=<commit> bench/gpu_session.sh PARTS
#   0. check tests    ~3-5 min (TESTS_TIMEOUT_S 300): tests/gpu, among them the engine warmed and served on its
#                     own thread (no second capture) and the cuDNN search comparison on the GPU.
#   1. check cold     ~6-7 min: the warm store is prepared once (a fresh start that serves until its tuning has
#                     proven a record: ~1-2 min), 30 warm starts 6 at once, then fresh starts 5 at once until
#                     COLD_DEADLINE_S (400 s; ~12-15 s per start and its 100 checked requests: 20-30 of the 30).
#                     If fewer than 30 fresh starts ran, a second call: COLD_RUNS=<missing> ... coldfresh (~1.5 min).
#   2. engine         ~9 min (ENGINE_DEADLINE_S 500): the engine table.
#   3. service        ~9 min: the service table.
# Result files (in session.tgz): coldstart.json (per store: ready_s p50, max and every start, each start's
# load-phase line), engine-*.json, service-cuda.json, and each part's log.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
S="$OUT/session"
mkdir -p "$S"
pack() { [ -d "$S" ] && tar czf "$OUT/session.tgz" -C "$OUT" session && rm -rf "$S"; }
trap pack EXIT
trap 'pack; exit 143' TERM INT
run() {  # run NAME TIMEOUT_S COMMAND...: output to $S/NAME.log, its tail to the reply
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) ==="
  timeout "$limit" "$@" >"$S/$name.log" 2>&1
  echo "exit $? ($name)" | tee -a "$S/$name.log"
  tail -n "${TAIL:-15}" "$S/$name.log"
}
for part in "${@:-all}"; do
  case $part in
    check|all)
      nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$S/gpu.txt"
      python3 -c 'import onnxruntime as o, httptools, sys; print(sys.version.split()[0], o.__version__, o.get_available_providers())' \
        2>&1 | tee -a "$S/gpu.txt" ;;&
    triton)
      if ls .gpu/triton/nvidia_pytriton-*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/pytriton ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/triton/nvidia_pytriton-*.whl
      fi
      python3 - <<'PY' 2>&1 | tee "$S/triton.txt"
import os, subprocess, sys, sysconfig
sys.path.insert(0, ".")
from bench.triton_repository import TritonInstall, triton_env
install = TritonInstall.find()
if install is None:
    sys.exit("no nvidia-pytriton wheel with a stub for this python: stage it (bench/stage_triton.sh)")
env = triton_env(install, os.environ)
libs = subprocess.run(["ldd", str(install.stub())], env=env, capture_output=True, text=True).stdout
print("stub", install.stub(), "libpython dir", sysconfig.get_config_var("LIBDIR"))
print("\n".join(line for line in libs.splitlines() if "python" in line or "not found" in line))
PY
      ;;
    tests|all)
      run gpu-tests "${TESTS_TIMEOUT_S:-300}" python3 -m pytest ${TESTS:-tests/gpu} -q -p no:cacheprovider ;;&
    fused|all)
      run fused-ops "${FUSED_TIMEOUT_S:-340}" python3 bench/fused_ops.py --deadline-s "${FUSED_DEADLINE_S:-300}" \
        --phases "${FUSED_PHASES:-build,check,model}" --out "$S/fused-ops.json" ;;&
    cold|all)
      # shellcheck disable=SC2086
      run coldstart "${COLD_TIMEOUT_S:-555}" python3 bench/coldstart.py --store both --runs "${COLD_RUNS:-30}" \
        --parallel "${COLD_PARALLEL:-6}" --parallel-fresh "${COLD_PARALLEL_FRESH:-5}" --ready-timeout-s 150 \
        --deadline-s "${COLD_DEADLINE_S:-400}" ${COLD_ENV:-} --out "$S/coldstart.json" ;;&
    coldwarm)
      # shellcheck disable=SC2086
      run coldstart-warm "${COLD_TIMEOUT_S:-555}" python3 bench/coldstart.py --store warm --runs "${COLD_RUNS:-30}" \
        --parallel "${COLD_PARALLEL:-6}" --ready-timeout-s 150 --deadline-s "${COLD_DEADLINE_S:-400}" ${COLD_ENV:-} \
        --out "$S/coldstart-warm.json" ;;&
    coldfresh)
      # shellcheck disable=SC2086
      run coldstart-fresh "${COLD_TIMEOUT_S:-555}" python3 bench/coldstart.py --store fresh --runs "${COLD_RUNS:-30}" \
        --parallel "${COLD_PARALLEL_FRESH:-5}" --ready-timeout-s 150 --deadline-s "${COLD_DEADLINE_S:-400}" \
        ${COLD_ENV:-} --out "$S/coldstart-fresh.json" ;;&
    fault)
      run nchw-fault "${FAULT_TIMEOUT_S:-300}" python3 bench/nchw_fault.py --deadline-s "${FAULT_DEADLINE_S:-150}" \
        --out "$S/nchw-fault.json" ;;&
    shapes)
      run graph-shapes "${SHAPES_TIMEOUT_S:-280}" python3 bench/graph_shapes.py --reps "${SHAPES_REPS:-3}" \
        --parallel "${SHAPES_PARALLEL:-8}" --deadline-s "${SHAPES_DEADLINE_S:-200}" --out "$S/graph-shapes.json" ;;&
    kbuild)
      run kernels-build "${KBUILD_TIMEOUT_S:-200}" python3 -m kernels.build --no-fetch ;;&
    census)
      run kernel-census "${CENSUS_TIMEOUT_S:-150}" python3 bench/kernel_census.py --out "$S/kernel-census.json" ;;&
    engine|all)
      run engine "${ENGINE_TIMEOUT_S:-560}" python3 bench/engine.py --deadline-s "${ENGINE_DEADLINE_S:-500}" \
        --out-dir "$S" ${ENGINE_ARGS:-} ;;&
    shm|all)
      run shared-memory "${SHM_TIMEOUT_S:-300}" python3 bench/shared_memory.py --device cuda \
        --out "$S/shared-memory-cuda.json" ;;&
    service|all)
      servers=client_ceiling,service,service_workers
      python3 -c 'import sys; sys.path.insert(0, "."); from bench.triton_repository import TritonInstall as T
sys.exit(T.find() is None)' 2>/dev/null && servers=$servers,triton
      # shellcheck disable=SC2086
      run service "${SERVICE_TIMEOUT_S:-560}" python3 bench/service.py --device cuda --quick \
        --servers "${SERVERS:-$servers}" --workers "${WORKERS:-4}" --rounds "${ROUNDS:-2}" \
        --series "${SERIES:-binary}" --concurrency "${CONCURRENCY:-1,8,32,64}" ${SERVICE_ARGS:-} \
        --out "$S/service-cuda.json" ;;&
    check|triton|tests|fused|fault|shapes|kbuild|census|cold|coldwarm|coldfresh|engine|shm|service|all) ;;
    *) echo "unknown part $part" >&2 ;;
  esac
done
