#!/bin/bash
# One GPU (issue 20): a step's swap-outs in two parts, the forward pass waiting only for the
# spills of the blocks it rewrites. GPU tests of the tier; the timeline probe with the old
# order (ONEPART=1) and the new, alternated; the chat bench once.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-29-s33
F="^WARNING\|it/s\]\|Warning\|warn"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_offload.py tests/test_kv_offload_loads.py 2>&1 | tail -2 | tee -a $OUT/log
for v in 1 "" 1 ""; do
  echo "== timeline ONEPART=$v" | tee -a $OUT/log
  ONEPART=$v timeout 200 python3 $D/chat_timeline.py $OUT/timeline_onepart$v.json 2>&1 | grep -v "$F" | grep -v "^step\|^{" | tail -7 | tee -a $OUT/log
done
echo "== chat bench" | tee -a $OUT/log
timeout 200 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat.json 2>&1 | grep -v "$F" | tail -4 | tee -a $OUT/log
