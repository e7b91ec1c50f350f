#!/bin/bash
# Session 13, call F (one GPU): Qwen2-VL-2B with equal-context decode batches (issue 19), then
# the chat workload's per-step probe with and without the CPU tier (issue 20).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 150 pagelm bench multimodal --model qwen2-vl-2b --dtype bfloat16 --input-len 64 --output-len 128 \
    --batch-size 8 --image-size 640x480 --num-images 64 --encoder-batch 16 --iters 5 \
    --max-model-len 4096 --json $OUT/mm-qwen2-vl.json > $OUT/mm.log 2>&1; echo "mm rc $?" | tee -a $OUT/log; grep -v "^\s*\^" $OUT/mm.log | tail -6 | tee -a $OUT/log
timeout 380 python3 docs/results/2026-11-26-s13/chat_probe.py --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 > $OUT/probe.log 2>&1; echo "probe rc $?" | tee -a $OUT/log
grep -v "^\s*$" $OUT/probe.log | grep -v Warn | tail -90 | cut -c1-180
