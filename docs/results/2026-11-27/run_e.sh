#!/bin/bash
# Two GPUs (issues 17, 18): DP=2 with each replica in its own process (the server's path),
# TP=2's step breakdown again (its header line was cut last time), then PP=2 (pp_profile.sh).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
d=docs/results/2026-11-27
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 150 python3 $d/dp_async.py 2 2>&1 | grep -E "^DP=|Error|error" | tail -4 | tee -a $OUT/log
timeout 100 python3 $d/profile_tp.py 2 2>&1 | grep -E "^TP=|^  " | head -24 | tee -a $OUT/log
[ -f $d/pp_profile.sh ] && timeout 240 bash $d/pp_profile.sh 2>&1 | tail -30 | tee -a $OUT/log
