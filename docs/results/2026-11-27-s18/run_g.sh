#!/bin/bash
# One GPU (issue 20): copies sorted by tier block (long runs: fewer, larger host-device
# copies). GPU tests, then the chat workload twice.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
F="^WARNING\|it/s\]\|Warning\|warn"
chat() { timeout 170 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/$1.json 2>&1 | grep -v "$F" | tail -3 | tee -a $OUT/log; }
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_offload.py tests/test_kv_offload_loads.py 2>&1 | tail -1 | tee $OUT/log
echo "== chat 1" | tee -a $OUT/log; chat chat-sorted-1
echo "== chat 2" | tee -a $OUT/log; chat chat-sorted-2
