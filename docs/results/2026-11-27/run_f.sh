#!/bin/bash
# One H100 (issue 21): the split-K GEMV's GPU tests and micro-benchmark (gemv_bench.py), then
# qwen3-0.6b latency at batch 1 and 8 with PAGELM_TRITON_GEMV=0 / =1 (single rows stay on the
# fused one-row GEMV: PAGELM_TRITON_GEMV_MIN_ROWS=2).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_splitk.py 2>&1 | tail -2 | tee -a $OUT/log
timeout 120 python3 docs/results/2026-11-27/gemv_bench.py --json $OUT/gemv_bench.json 2>&1 | grep -v "Warning\|warn_once" | tee -a $OUT/log
lat() { ( cd /tmp && timeout 80 env PAGELM_TRITON_GEMV=$1 PAGELM_TRITON_GEMV_MIN_ROWS=2 pagelm bench latency --model qwen3-0.6b --batch-sizes 1,8 \
    --input-len 128 --output-len 512 --iters 3 --max-model-len 4096 --json $OUT/lat-gemv$1.json 2>&1 ) | grep -v "^WARNING\|it/s\]" | tail -2 | sed "s/^/[PAGELM_TRITON_GEMV=$1] /" | tee -a $OUT/log; }
lat 0
lat 1
