#!/bin/bash
# One GPU (session 32): timeline_gpu.py at batch 1 and 32, then session 30's phases_gpu.py
# with step timers at batch 1 (4 rounds).
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-28-s32
for bs in 1 32; do
  BS=$bs timeout 150 python3 $D/timeline_gpu.py 2>&1 | grep -v Warning | tee $OUT/timeline-bs$bs.txt
done
HEAD=$PWD/eagle-long WRAP=1 BS=1 OUTLEN=256 ROUNDS=4 timeout 150 python3 docs/results/2026-11-28-s30/phases_gpu.py 2>&1 \
  | grep -v -E 'Warning|_warn_once' | tee $OUT/phases-bs1.txt
