#!/bin/bash
# One GPU (session 31, after 493a893): argmax_ab.py at batch 1 and 32, then run_bench.sh 24.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
for bs in 1 32; do
  BS=$bs ROUNDS=24 timeout 150 python3 docs/results/2026-11-28-s31/argmax_ab.py 2>&1 | grep -E "^batch|Error|differ" | tee -a $OUT/argmax.txt
done
bash docs/results/2026-11-28-s31/run_bench.sh 24
