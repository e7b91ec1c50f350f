#!/bin/bash
# Two GPUs (issues 17, 18): DP=2 with each replica's core in its own process after the fix
# (the core process makes its own GPU current): the GPU test, then the nano-vllm throughput.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed_gpu.py -k in_processes -rA 2>&1 | grep -E "PASS|FAIL|passed|failed|^E " | tail -5 | tee -a $OUT/log
timeout 150 python3 docs/results/2026-11-27/dp_async.py 2 2>&1 | grep -E "^DP=|Error|error" | tail -4 | tee -a $OUT/log
