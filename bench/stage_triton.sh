#!/usr/bin/env bash
# Stage Triton's server for the GPU machine (which reaches no package index): run HERE, from the project's root,
# after ../shared/gpu/stage:   bench/stage_triton.sh
# It downloads the nvidia-pytriton wheel (55 MB, manylinux_2_35, no dependencies: only its tritonserver binary,
# Python backend and stubs are used) into .gpu/triton/, which git ignores. The wheel is too large to travel
# with .gpu/wheels in one call (64 MiB a call), so it takes a call of its own on the warm machine, after the six
# calls ../shared/gpu/stage lists:
#   carry [".gpu/triton", ".gpu/device-setup.sh"]   command: source .gpu/device-setup.sh && bench/gpu_session.sh triton
# The `triton` part installs it into /tmp/site (no dependencies) and checks the stub for python3 there; later
# calls on the same warm machine find it installed (bench/gpu_session.sh service then includes the triton server).
set -euo pipefail
VERSION=${PYTRITON_VERSION:-0.7.0}
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
mkdir -p .gpu/triton
rm -f .gpu/triton/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 -d .gpu/triton "nvidia-pytriton==$VERSION"
du -sh .gpu/triton/*.whl
