#!/bin/bash
# One GPU (issue 20): loads polled before each schedule (no step's lag) and 256 MiB staging
# batches (fewer kernels to queue a load). GPU tests, the chat workload, the timeline probe.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-27-s18
F="^WARNING\|it/s\]\|Warning\|warn"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_offload.py tests/test_kv_offload_loads.py 2>&1 | tail -2 | tee $OUT/log
echo "== chat" | tee -a $OUT/log
timeout 200 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat.json 2>&1 | grep -v "$F" | tail -3 | tee -a $OUT/log
echo "== timeline" | tee -a $OUT/log
timeout 200 python3 $D/chat_timeline.py $OUT/timeline.json 2>&1 | grep -v "$F" | tail -40 | tee -a $OUT/log
