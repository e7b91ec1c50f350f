#!/bin/bash
# Call 9 (H100/H200): issue 20's multi-turn chat workload (TTFT with and without the CPU tier)
# on this tree (kernels built at start-up), twice.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
for i in 1 2; do
  ( cd /tmp && timeout 280 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
      --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat-$i.json 2>&1 ) > $OUT/chat-$i.log
  echo "[chat-$i] rc=$?" | tee -a $OUT/log; grep -v "it/s\]" $OUT/chat-$i.log | tail -4 | tee -a $OUT/log
done
