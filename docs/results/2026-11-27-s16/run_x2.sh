#!/bin/bash
# Two GPUs (issue 18), call 2: the whole tests/test_distributed_gpu.py (llama and qwen3
# variants of TP=2 / PP=2 parity, PP=2 with graphs, EAGLE under PP=2, bf16 real shapes, DP).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed_gpu.py -rA -s --durations=0 > $OUT/log-tests 2>&1; echo "tests rc=$?"
grep -E "^PASSED|^FAILED|^ERROR|passed|failed|first diverging|^E " $OUT/log-tests | tail -30
