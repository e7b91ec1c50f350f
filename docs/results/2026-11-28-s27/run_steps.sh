#!/bin/bash
# One GPU (issue 21, session 27): steps_gpu.py at batch 1 and 32 (eagle-demo/, demo-cache/ carried).
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
BS=1 OUTLEN=256 ROUNDS=8 timeout 200 python3 docs/results/2026-11-28-s27/steps_gpu.py 2>&1 | grep -v Warning | tail -6 | tee $OUT/log
BS=32 OUTLEN=256 ROUNDS=4 timeout 200 python3 docs/results/2026-11-28-s27/steps_gpu.py 2>&1 | grep -v Warning | tail -6 | tee -a $OUT/log
