#!/bin/bash
# Two GPUs (issues 17, 18): the in-process DP test after the capture-stream fix (3202e0d), DP=2
# throughput, a torch.profiler breakdown of TP=2 and TP=1 batch-1 decode steps (rank 0), TP=1
# throughput on the same machine.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed_gpu.py -k in_one_process -rA 2>&1 | grep -E "PASS|FAIL|passed|failed|^E " | tail -5 | tee -a $OUT/log
tput() { timeout 110 pagelm bench throughput --model llama-3.1-8b --workload nano-vllm --max-model-len 4096 \
    --json $OUT/tput-8b-$1.json "${@:2}" 2>&1 | grep -vi warn | tail -2 | sed "s/^/[$1] /" | tee -a $OUT/log; }
tput dp2 --data-parallel-size 2
d=docs/results/2026-11-27
timeout 100 python3 $d/profile_tp.py 2 2>&1 | grep -v "^WARNING\|it/s\]\|USDT" | tail -22 | tee -a $OUT/log
timeout 80 python3 $d/profile_tp.py 1 2>&1 | grep -v "^WARNING\|it/s\]\|USDT" | tail -22 | tee -a $OUT/log
tput tp1
