#!/bin/bash
# One GPU (issue 21, session 30): the GPU tests of the decode fast path and the spec files,
# then this tree alone, the head trained at the benchmark's lengths (eagle-long/), k = 3,
# 12 rounds at batch 1 and 32, twice (run_ab.sh). Usage: run_final.sh
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
(python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fast_path.py tests/test_spec_graphs.py \
  tests/test_spec_device_drafts.py tests/test_spec_backoff.py tests/test_draft_proposer.py 2>&1 | tail -3 | tee $OUT/tests.log
HEAD=$PWD/eagle-long ROUNDS=12 bash docs/results/2026-11-28-s30/run_ab.sh 2 new
