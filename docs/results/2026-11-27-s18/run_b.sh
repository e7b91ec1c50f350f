#!/bin/bash
# One GPU (issue 20): each chat turn's timeline with the CPU tier (chat_timeline.py), with the
# copier's side stream at default and at the highest priority.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-27-s18
echo "== default priority" | tee $OUT/log
timeout 150 python3 $D/chat_timeline.py $OUT/timeline-default.json 2>&1 | grep -v "^WARNING\|it/s\]\|Warning\|warn" | tail -16 | tee -a $OUT/log
echo "== high priority" | tee -a $OUT/log
PRIORITY=1 timeout 150 python3 $D/chat_timeline.py $OUT/timeline-prio.json 2>&1 | grep -v "^WARNING\|it/s\]\|Warning\|warn" | tail -17 | tee -a $OUT/log
