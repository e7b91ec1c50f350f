#!/bin/bash
# One GPU (issue 20): the chat probe (step times, copier runs, profile) after the one-copy-per-run
# copier, then the pressure workload as before and with longer outputs (more preemptions).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 240 python3 docs/results/2026-11-26-s13/chat_probe.py --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat.json 2>&1 | grep -v "^WARNING\|it/s\]" | tail -80
timeout 150 pagelm bench offload --model llama-3.1-8b --workload pressure --num-seqs 32 --input-len 2048 \
    --output-len 512 --max-model-len 4096 --json $OUT/pressure.json 2>&1 | grep -v "^WARNING\|it/s\]" | tail -12
timeout 180 pagelm bench offload --model llama-3.1-8b --workload pressure --num-seqs 32 --input-len 1024 \
    --output-len 2048 --max-model-len 4096 --json $OUT/pressure-long-out.json 2>&1 | grep -v "^WARNING\|it/s\]" | tail -12
