#!/bin/bash
# Issue 18, call B (two GPUs): batch-1 decode and nano-vllm throughput, llama-3.1-8b, TP=1 vs TP=2.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
git log -1 --format=%h | tee $OUT/log
for tp in 1 2; do
  timeout 200 pagelm bench latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 512 --iters 2 \
    --max-model-len 4096 --tensor-parallel-size $tp --json $OUT/lat-8b-tp$tp.json 2>&1 | grep -vi warn | tail -8 | tee -a $OUT/log
done
for tp in 1 2; do
  timeout 220 pagelm bench throughput --model llama-3.1-8b --workload nano-vllm --max-model-len 4096 \
    --tensor-parallel-size $tp --json $OUT/tput-8b-tp$tp.json 2>&1 | grep -vi warn | tail -6 | tee -a $OUT/log
done
