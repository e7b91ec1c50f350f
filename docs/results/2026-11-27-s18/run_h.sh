#!/bin/bash
# One GPU (issue 20): the chat workload three times on 36dfc88 (the first on a fresh machine
# compiles kernels the warm-up does not meet; the other two are warm).
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
F="^WARNING\|it/s\]\|Warning\|warn"
for i in 1 2 3; do
  echo "== chat $i" | tee -a $OUT/log
  timeout 150 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat-$i.json 2>&1 | grep -v "$F" | tail -3 | tee -a $OUT/log
done
