#!/bin/bash
# Session 13, call A (two GPUs): where the TP=2 shutdown hang is (shutdown_bisect: CUDA graphs,
# async scheduling, symmetric memory each turned off), then small fp32 parity TP=2 / PP=2 vs TP=1.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 280 python3 docs/results/2026-11-26-s12/shutdown_bisect.py 2>&1 | grep -vE "Warning|warn\(" | tail -30 | tee -a $OUT/log
timeout 280 python3 docs/results/2026-11-26-x2/parity.py small pipeline_parallel_size=2 2>&1 | grep -E "prompts|TP=|Error|error|Traceback|shut|built" | head -40 | tee -a $OUT/log
