#!/bin/bash
# Call 4 (H100): this tree's GPU tests (no kernel built inside a step; the Triton backend's
# GPU tests), then `pagelm bench throughput` nano-vllm on qwen3-0.6b: triton, flashinfer, triton.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 320 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_builds_at_startup.py tests/test_triton_gpu.py > $OUT/tests.log 2>&1
tail -5 $OUT/tests.log | tee -a $OUT/log; grep -A30 "AssertionError" $OUT/tests.log | head -60 >> $OUT/log
tp() {  # tp NAME BACKEND
  ( cd /tmp && timeout 150 pagelm bench throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 \
      --attention-backend $2 --json $OUT/$1.json 2>&1 ) > $OUT/$1.log
  echo "[$1] rc=$? $(grep ' pagelm: ' $OUT/$1.log | tail -1)" | tee -a $OUT/log
}
tp triton-1 triton; tp flashinfer-1 flashinfer; tp triton-2 triton
