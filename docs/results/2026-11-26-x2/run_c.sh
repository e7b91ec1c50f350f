#!/bin/bash
# Issue 18, after the TP fix: TP=2 parity (small fp32, 8B bf16), then TP=2 batch-1 decode and
# nano-vllm throughput (TP=1 batch-1 decode was measured in the previous call on this machine).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=docs/results/2026-11-26-x2
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
git log -1 --format=%h | tee $OUT/log
timeout 90 python3 $R/parity.py small 2>&1 | grep -E "prompts|Error|error|Traceback|  \{" | tee -a $OUT/log
timeout 110 python3 $R/parity.py 8b 2>&1 | grep -E "prompts|ready|Error|error|Traceback|  \{" | tee -a $OUT/log
timeout 90 pagelm bench latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 512 --iters 2 \
    --max-model-len 4096 --tensor-parallel-size 2 --json $OUT/lat-8b-tp2.json 2>&1 | grep -vi warn | tail -4 | tee -a $OUT/log
for tp in 2 1; do
  timeout 80 pagelm bench throughput --model llama-3.1-8b --workload nano-vllm --max-model-len 4096 \
    --tensor-parallel-size $tp --json $OUT/tput-8b-tp$tp.json 2>&1 | grep -vi warn | tail -4 | tee -a $OUT/log
done
