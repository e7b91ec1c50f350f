#!/bin/bash
# Issue 18, call A (two GPUs): the all-reduce time, then TP=2 parity (small fp32, 8B bf16).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=docs/results/2026-11-26-x2
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m; git log -1 --format=%h; } 2>&1 | tee $OUT/log
[ -n "$SKIP_AR" ] || timeout 120 python3 $R/allreduce.py 2>&1 | grep -v Warning | tee -a $OUT/log
timeout 200 python3 $R/parity.py small "$@" 2>&1 | grep -E "prompts|TP=|Error|error|Traceback|  \{" | tee -a $OUT/log
timeout 330 python3 $R/parity.py 8b "$@" 2>&1 | grep -E "prompts|ready|Error|error|Traceback|  \{" | tee -a $OUT/log
