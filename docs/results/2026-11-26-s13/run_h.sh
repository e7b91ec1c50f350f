#!/bin/bash
# Two GPUs, for the next session (issues 17, 18): does releasing the CUDA graphs end the TP=2
# shutdown hang; the two-GPU tests (PP=2 with each stage's graphs included); throughput at PP=2
# and DP=2 beside TP=1 (TP=2 measured in session 12: 9,590 output tok/s).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 120 python3 docs/results/2026-11-26-s12/shutdown_bisect.py default eager 2>&1 | grep -vE "Warning|warn\(" | tail -8 | tee $OUT/log
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed_gpu.py 2>&1 | tail -6 | tee -a $OUT/log
tput() { timeout 110 pagelm bench throughput --model llama-3.1-8b --workload nano-vllm --max-model-len 4096 \
    --json $OUT/tput-8b-$1.json "${@:2}" 2>&1 | grep -vi warn | tail -2 | sed "s/^/[$1] /" | tee -a $OUT/log; }
tput pp2 --pipeline-parallel-size 2
tput dp2 --data-parallel-size 2
tput tp1
