#!/bin/bash
# One GPU (issue 20): the host time of each part of the engine step in the chat workload with
# the CPU tier (a host sync stalls the async pipeline), and the allocator's calls.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-29-s33
F="^WARNING\|it/s\]\|Warning\|warn"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 200 python3 $D/chat_timeline.py $OUT/timeline_host.json 2>&1 | grep -v "$F" | grep -v "^step\|^{" | tail -14 | tee -a $OUT/log
