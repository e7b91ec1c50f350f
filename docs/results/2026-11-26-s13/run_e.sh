#!/bin/bash
# Session 13, call E (one GPU): issue 19's Qwen2-VL-2B figures (after the 4-D SDPA fix) and
# issue 20's multi-turn chat workload with and without the CPU tier.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 200 pagelm bench multimodal --model qwen2-vl-2b --dtype bfloat16 --input-len 64 --output-len 128 \
    --batch-size 8 --image-size 640x480 --num-images 64 --encoder-batch 16 --iters 5 \
    --max-model-len 4096 --json $OUT/mm-qwen2-vl.json > $OUT/mm.log 2>&1; echo "mm rc $?" | tee $OUT/log; grep -v "^\s*\^" $OUT/mm.log | tail -25 | tee -a $OUT/log
timeout 360 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat.json > $OUT/chat.log 2>&1; echo "chat rc $?" | tee -a $OUT/log; tail -25 $OUT/chat.log | tee -a $OUT/log
