#!/bin/bash
# Issue 18, session 12, call D: parity TP=2 / PP=2 against TP=1 with the NCCL abort at shutdown.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
R=docs/results/2026-11-26-x2
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 130 python3 $R/parity.py small pipeline_parallel_size=2 2>&1 | grep -E "prompts|TP=|Error|error|Traceback|  \{|File \"/work" | head -40 | tee $OUT/log
timeout 140 python3 $R/parity.py 8b pipeline_parallel_size=2 2>&1 | grep -E "prompts|ready|Error|error|Traceback|  \{|File \"/work" | head -40 | tee -a $OUT/log
