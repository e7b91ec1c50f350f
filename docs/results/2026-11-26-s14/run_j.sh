#!/bin/bash
# Two GPUs (issue 17): PP=2 with each stage's CUDA graphs, EAGLE under PP=2, and the offline
# in-process DP=2 (after the current-device fix) against one GPU; then DP=2 throughput if time.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 290 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed_gpu.py -rA \
  -k "in_one_process or (pp2_with_cuda_graphs and llama and None) or (pp2_eagle and llama)" 2>&1 | grep -E "PASS|FAIL|ERROR|passed|failed|Error" | tail -12 | tee $OUT/log
