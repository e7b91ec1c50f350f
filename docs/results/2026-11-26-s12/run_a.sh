#!/bin/bash
# Issue 18, session 12, call A (two GPUs): one-shot all-reduce over symmetric memory vs NCCL,
# then TP=2 and PP=2 greedy parity against TP=1 (small fp32, llama-3.1-8b bf16).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=docs/results/2026-11-26-x2; S=docs/results/2026-11-26-s12
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
{ nvidia-smi --query-gpu=name --format=csv,noheader; git log -1 --format=%h; } 2>&1 | tee $OUT/log
timeout 100 python3 $S/allreduce_symm.py 2>&1 | grep -v Warning | tail -12 | tee -a $OUT/log
echo "NCCL_PROTO=LL:" | tee -a $OUT/log
NCCL_PROTO=LL timeout 60 python3 $R/allreduce.py 2>&1 | grep allreduce | tee -a $OUT/log
timeout 200 python3 $R/parity.py small pipeline_parallel_size=2 2>&1 | grep -E "prompts|TP=|Error|error|Traceback|  \{" | tee -a $OUT/log
timeout 260 python3 $R/parity.py 8b pipeline_parallel_size=2 2>&1 | grep -E "prompts|ready|Error|error|Traceback|  \{" | tee -a $OUT/log
