#!/bin/bash
# spread_gpu.py at batch 32 and 1 (12 rounds, no timers), then batch 32 with step timers (4 rounds).
# Usage (device, repo root, demo-cache/ and eagle-long/ carried): bash docs/results/2026-11-28-s31/run_spread.sh
set -e
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
(python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }
S=docs/results/2026-11-28-s31/spread_gpu.py
for bs in ${BS_LIST:-32 1}; do
  BS=$bs ROUNDS=${ROUNDS:-12} python3 $S 2>&1 | grep -v -i warn | tee $OUT/spread-bs$bs.txt
done
if [ "${TIMERS:-1}" = 1 ]; then
  BS=32 ROUNDS=4 WRAP=1 python3 $S 2>&1 | grep -v -i warn > $OUT/spread-timers-bs32.txt
fi
