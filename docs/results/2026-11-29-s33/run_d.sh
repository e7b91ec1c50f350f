#!/bin/bash
# One GPU (issue 20): torch.profiler over 300 ms of the chat workload with the CPU tier, as a
# batch of turns comes back: busy time per stream, the compute stream's gaps and kernels.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-29-s33
F="^WARNING\|it/s\]\|Warning\|warn"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 280 python3 $D/chat_profile.py 2>&1 | grep -v "$F" | tail -40 | tee -a $OUT/log
