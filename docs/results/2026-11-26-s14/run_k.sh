#!/bin/bash
# One GPU (issue 21): EAGLE's drafting graphs and async EAGLE, first GPU run: the GPU test
# (graphs = eager = no speculation), then the demo model with a head trained on the CPU
# (eagle-demo/, carried; `pagelm train-eagle --out eagle-demo --max-seconds 300`).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 70 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_spec_graphs.py -k eagle -rA 2>&1 | grep -E "PASS|FAIL|passed|failed|^E " | tail -6 | tee $OUT/log
( cd /tmp && timeout 120 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 --batch-sizes 1,32 \
    --speculative-config "{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$OLDPWD/eagle-demo\"}" \
    --compare spec-off --iters 2 --json $OUT/spec-eagle-demo.json 2>&1 ) | grep -v "^WARNING\|it/s\]" | tail -8 | tee -a $OUT/log
# issue 20: the chat workload again after the spill fix (23f6966)
timeout 200 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat.json 2>&1 | grep -v "^WARNING\|it/s\]" | tail -4 | tee -a $OUT/log
