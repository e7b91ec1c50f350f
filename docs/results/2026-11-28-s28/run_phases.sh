#!/bin/bash
# One GPU (issue 21, session 28): phases_gpu.py at batch 1 and 32 (phase times of plain and
# trained-EAGLE steps; torch ops per step). Usage: run_phases.sh [tag]
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
here=$PWD/docs/results/2026-11-28-s28
tag=${1:-a}
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
for bs in 1 32; do
  BS=$bs OUTLEN=256 ROUNDS=6 OUT=$OUT timeout 150 python3 $here/phases_gpu.py 2>&1 | grep -v USDT | tee $OUT/phases-$tag-bs$bs.txt
done
