#!/bin/bash
# One GPU (session 31, after 493a893): session 30's phases_gpu.py (plain, the trained head,
# every draft rejected; one process, generates alternated, 24 rounds) at batch 1 and 32.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
for bs in 1 32; do
  HEAD=$PWD/eagle-long REJECT=1 WRAP=0 BS=$bs OUTLEN=256 ROUNDS=24 timeout 200 python3 docs/results/2026-11-28-s30/phases_gpu.py 2>&1 \
    | grep -E 'TPOT|acceptance|verifications a|per-round' | tee $OUT/phases-bs$bs.txt
done
