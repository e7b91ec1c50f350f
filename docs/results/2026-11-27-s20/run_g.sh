#!/bin/bash
# Call 7 (H100 or H200): this tree's GPU tests around the change: the Triton backend's (the
# split-merge tests rewritten: repeatable bits, within one rounding of the reduce launch), no
# kernel built inside a step, the engine's fast path and the speculative graphs (which replay
# the split launch at 1 + k tokens).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
git log --oneline -1 2>/dev/null | tee -a $OUT/log
timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors -rA \
    tests/test_triton_gpu.py tests/test_triton_builds_at_startup.py tests/test_gpu_fast_path.py tests/test_spec_graphs.py \
    > $OUT/tests.log 2>&1
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" $OUT/tests.log | tail -60 | tee -a $OUT/log
