#!/bin/bash
# One GPU (issue 20): the chat workload with the bench's new untimed warm-up, this tree against
# baseline/ (8792ac4 with the same bench file), alternated: new, baseline, new.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
inst() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" > /tmp/pip.log 2>&1 || { echo "install $1 failed"; tail -5 /tmp/pip.log; exit 1; }; }
F="^WARNING\|it/s\]\|Warning\|warn"
chat() { timeout 170 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/$1.json 2>&1 | grep -v "$F" | tail -3 | tee -a $OUT/log; }
inst .; echo "== chat, this tree" | tee $OUT/log; chat chat-new-1
inst baseline; echo "== chat, baseline" | tee -a $OUT/log; chat chat-base-1
inst .; echo "== chat, this tree" | tee -a $OUT/log; chat chat-new-2
