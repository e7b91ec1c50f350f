#!/bin/bash
# One GPU (issue 20): asynchronous loads from the CPU tier (plugin API 2.18). The GPU tests of
# the tier, then the chat workload on this tree and on the tree before the change
# (baseline/ = 8792ac4), alternated on one warm machine.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
inst() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" > /tmp/pip.log 2>&1 || { echo "install $1 failed"; tail -5 /tmp/pip.log; exit 1; }; }
chat() { timeout 200 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/$1.json 2>&1 | grep -v "^WARNING\|it/s\]" | tail -3 | tee -a $OUT/log; }
inst .
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_offload.py tests/test_kv_offload_loads.py 2>&1 | tail -5 | tee $OUT/log
echo "== chat, this tree" | tee -a $OUT/log; chat chat-new-1
inst baseline; echo "== chat, baseline" | tee -a $OUT/log; chat chat-base-1
inst .
