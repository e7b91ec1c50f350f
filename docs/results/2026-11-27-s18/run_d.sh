#!/bin/bash
# One GPU (issue 20): the timeline probe, warmed up, with the scheduler's steps around one
# batch of returning turns.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=/tmp/pagelm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 200 python3 docs/results/2026-11-27-s18/chat_timeline.py $OUT/timeline.json 2>&1 | grep -v "^WARNING\|it/s\]\|Warning\|warn" | tail -70 | tee $OUT/log
