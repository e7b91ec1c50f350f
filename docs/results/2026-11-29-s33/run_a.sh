#!/bin/bash
# One GPU (issue 20): where a chat turn's TTFT goes with the CPU tier now, and what loads that
# start at once (not after the step in flight) would buy: the timeline probe twice, the
# second with NOWAIT=1 (the copier's side streams do not wait for the compute stream).
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-29-s33
F="^WARNING\|it/s\]\|Warning\|warn"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
for v in "" 1 "" 1; do
  echo "== timeline NOWAIT=$v" | tee -a $OUT/log
  NOWAIT=$v timeout 240 python3 $D/chat_timeline.py $OUT/timeline_nowait$v.json 2>&1 | grep -v "$F" | grep -v "^step\|^{" | tail -12 | tee -a $OUT/log
done
