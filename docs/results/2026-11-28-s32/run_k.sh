#!/bin/bash
# One GPU (session 32): k_sweep.py at batch 1 (k = 3..6, the trained head eagle-long) and at
# batch 32 (k = 3, 4), 24 rounds each.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-28-s32
BS=1 RUNS=${RUNS1:-k3=3:eagle-long,k4=4:eagle-long,k5=5:eagle-long,k6=6:eagle-long} timeout 280 python3 $D/k_sweep.py 2>&1 \
  | grep -v -E 'Warning|warn' | tail -6 | tee $OUT/k-bs1.txt
BS=32 RUNS=${RUNS32:-k3=3:eagle-long,k4=4:eagle-long} timeout 250 python3 $D/k_sweep.py 2>&1 \
  | grep -v -E 'Warning|warn' | tail -4 | tee $OUT/k-bs32.txt
