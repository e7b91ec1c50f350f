#!/bin/bash
# One GPU (issue 21, session 31), the final code: the GPU tests of the decode fast path and the
# spec files; session 30's phases_gpu.py (plain, the trained head eagle-long/, every draft
# rejected; one process, 24 rounds) at batch 1 and 32; spread_gpu.py (plain, every draft
# rejected, that engine with speculation off; 36 rounds) at batch 32 and 1.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
(python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fast_path.py tests/test_spec_graphs.py \
  tests/test_spec_device_drafts.py tests/test_spec_backoff.py tests/test_draft_proposer.py 2>&1 | tail -3 | tee $OUT/tests.log
for bs in 1 32; do
  HEAD=$PWD/eagle-long REJECT=1 WRAP=0 BS=$bs OUTLEN=256 ROUNDS=24 timeout 250 python3 docs/results/2026-11-28-s30/phases_gpu.py 2>&1 \
    | grep -E 'TPOT|acceptance|verifications a|per-round' | tee $OUT/phases-bs$bs.txt
done
ROUNDS=36 RUNS=plain,reject,reject_off TIMERS=0 bash docs/results/2026-11-28-s31/run_spread.sh > /dev/null 2>&1
grep -v "per round" $OUT/spread-bs*.txt
