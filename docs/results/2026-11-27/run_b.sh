#!/bin/bash
# One GPU (issue 20): the chat workload after the spill fix (23f6966), then a pressure workload
# at a large batch (256 x (512 + 512), pool a quarter): recompute's share of the run grows with
# the batch (batch x prefill time per token / decode step time), so swap has room to pay here.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 200 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat.json 2>&1 | grep -v "^WARNING\|it/s\]" | tail -4 | tee $OUT/log
timeout 250 pagelm bench offload --model llama-3.1-8b --workload pressure --num-seqs 256 --input-len 512 \
    --output-len 512 --max-model-len 2048 --json $OUT/pressure-256.json 2>&1 | grep -v "^WARNING\|it/s\]" | tail -5 | tee -a $OUT/log
