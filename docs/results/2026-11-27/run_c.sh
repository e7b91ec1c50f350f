#!/bin/bash
# One GPU (issue 20), same warm machine as run_b.sh: the chat workload a second time (run to
# run spread), then pressure at a larger batch (512 x (256 + 768), max_num_seqs 512).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 150 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat2.json 2>&1 | grep -v "^WARNING\|it/s\]" | tail -3 | tee $OUT/log
timeout 280 pagelm bench offload --model llama-3.1-8b --workload pressure --num-seqs 512 --input-len 256 \
    --output-len 768 --max-model-len 2048 --max-num-seqs 512 --swap-space 40 --json $OUT/pressure-512.json 2>&1 | grep -v "^WARNING\|it/s\]" | tail -4 | tee -a $OUT/log
