#!/bin/bash
# One GPU (issue 20): the copier with two high-priority side streams (swap-outs apart from
# loads) and tier sources held until a load lands. GPU tests, the timeline probe, the chat
# workload, then pressure (256 x (512 + 512)) on this tree and on baseline/ (8792ac4).
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
inst() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" > /tmp/pip.log 2>&1 || { echo "install $1 failed"; tail -5 /tmp/pip.log; exit 1; }; }
D=docs/results/2026-11-27-s18
F="^WARNING\|it/s\]\|Warning\|warn"
pressure() { timeout 150 pagelm bench offload --model llama-3.1-8b --workload pressure --num-seqs 256 --input-len 512 \
    --output-len 512 --max-model-len 2048 --json $OUT/$1.json 2>&1 | grep -v "$F" | tail -3 | tee -a $OUT/log; }
inst .
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_offload.py tests/test_kv_offload_loads.py 2>&1 | tail -3 | tee $OUT/log
echo "== timeline" | tee -a $OUT/log
timeout 200 python3 $D/chat_timeline.py $OUT/timeline.json 2>&1 | grep -v "$F" | tail -16 | tee -a $OUT/log
echo "== chat" | tee -a $OUT/log
timeout 200 pagelm bench offload --model llama-3.1-8b --workload chat --conversations 32 --turns 6 \
    --concurrency 8 --user-len 512 --reply-len 128 --max-model-len 4096 --json $OUT/chat.json 2>&1 | grep -v "$F" | tail -3 | tee -a $OUT/log
echo "== pressure, this tree" | tee -a $OUT/log; pressure pressure-new
inst baseline; echo "== pressure, baseline" | tee -a $OUT/log; pressure pressure-base
inst .
