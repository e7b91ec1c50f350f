#!/bin/bash
# One H100, about 5 minutes (issue 21): the split-K GEMV's GPU tests, its microbenchmark, then
# batch-1 latency with PAGELM_TRITON_GEMV=0 and =1 interleaved (qwen3-0.6b twice each,
# llama-3.1-8b once each). JSON and the log in $OUT. Run from the repository root.
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then  # the lead's offline wheels, as in the earlier run_*.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_splitk.py 2>&1 | tail -2 | tee -a $OUT/log
timeout 120 python3 docs/results/2026-11-27/gemv_bench.py --json $OUT/gemv_bench.json 2>&1 | grep -v "Warning\|warn_once" | tee -a $OUT/log
lat() { ( cd /tmp && timeout 100 env PAGELM_TRITON_GEMV=$2 pagelm bench latency --model $1 --batch-sizes 1 --input-len 128 --output-len 512 --iters 3 \
    --max-model-len 4096 --json $OUT/lat-$1-gemv$2-$3.json 2>&1 ) | grep -v "^WARNING\|it/s\]" | tail -2 | sed "s/^/[$1 PAGELM_TRITON_GEMV=$2 #$3] /" | tee -a $OUT/log; }
lat qwen3-0.6b 0 1
lat qwen3-0.6b 1 1
lat qwen3-0.6b 0 2
lat qwen3-0.6b 1 2
lat llama-3.1-8b 0 1
lat llama-3.1-8b 1 1
