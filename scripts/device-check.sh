#!/usr/bin/env bash
# The GPU device check: on an NVIDIA machine with PyTorch, GPU-to-GPU
# transfers between two processes in every verification mode, checked with
# torch on the receiver after mc_guard_sync, throughput per mode. Needs
# build/libmcguard.so (make build, anywhere: libcuda is loaded at run
# time). Writes device-check.json under $OUT (or build/device-check).
# Runs twice: torch's default allocator, then its expandable segments (VMM
# memory) under $out/vmm. Finishes in about 4 minutes (2 allocators x 2
# paths x 5 modes x 6 s plus start-up).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/device-check}
mkdir -p "$out"
nvidia-smi -L | tee "$out/nvidia-smi.txt" || true
export MCGUARD_LIBRARY=${MCGUARD_LIBRARY:-$PWD/build/libmcguard.so}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
ldd "$MCGUARD_LIBRARY" | tee "$out/ldd.txt"
# Both runs go ahead whatever the first one found; the status is the worse.
rc=0
timeout 200 python3 -u -m mcguard.tools.devicecheck --out "$out" "$@" 2>&1 | tee "$out/device-check.log" || rc=$?
mkdir -p "$out/vmm"
timeout 200 python3 -u -m mcguard.tools.devicecheck --out "$out/vmm" --expandable-segments "$@" 2>&1 | tee "$out/vmm/device-check.log" || rc=$?
exit $rc
