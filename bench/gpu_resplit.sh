#!/usr/bin/env bash
# After ../shared/gpu/stage: re-split .gpu/ortgpu.part* into five 52 MiB parts (stage writes four of 62 MiB).
# Why: a call carries 64 MiB with the working tree; since the tree passed ~1.9 MB, part00 + the tree went
# over the limit ("the working tree is larger than 64 MiB", 2026-11-30). The copy of device-setup.sh in
# .gpu/ is changed to wait for five parts. Then make six run calls: part00..part03 alone, and part04 with
# .gpu/wheels and the command (see bench/gpu_session.sh).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)/.gpu"
parts=(ortgpu.part*)
[ "${#parts[@]}" -eq 5 ] && grep -q -- '-eq 5 \]' device-setup.sh && { echo "already five parts"; exit 0; }
cat "${parts[@]}" > whole.whl.tmp
rm -f ortgpu.part*
split -b 52m -d whole.whl.tmp ortgpu.part
rm whole.whl.tmp
chmod u+w device-setup.sh
sed -i 's/-eq 4 \]/-eq 5 ]/; s/once all four are there/once all five are there/' device-setup.sh
ls -l ortgpu.part* && grep -n -- '-eq 5' device-setup.sh
