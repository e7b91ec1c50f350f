#!/bin/bash
# One GPU (issue 21, session 28), after the events recorded on the runner's stream: the GPU
# tests of the decode fast path and the spec files, then phases_gpu.py (timers off: TPOT of
# plain decoding and EAGLE with the trained head, in one process) for this tree ("new") and
# baseline/ (before the session's changes) in turns, at batch 1 and 32; then this tree's
# phases at batch 1 with timers. Usage: run_final.sh ROUNDS
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
here=$PWD/docs/results/2026-11-28-s28
root=$PWD
install() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }; }
install $root
timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fast_path.py tests/test_spec_graphs.py \
  tests/test_spec_device_drafts.py tests/test_spec_backoff.py 2>&1 | tail -3 | tee $OUT/log
for round in $(seq 1 $1); do
  for tree in new base; do
    dir=$root; [ $tree = base ] && dir=$root/baseline
    install $dir
    for bs in 1 32; do
      echo "== $tree round $round batch $bs" >> $OUT/log
      WRAP=0 BS=$bs OUTLEN=256 ROUNDS=6 timeout 100 python3 $here/phases_gpu.py 2>&1 | grep TPOT >> $OUT/log
    done
  done
done
install $root
WRAP=1 BS=1 OUTLEN=256 ROUNDS=4 OUT=/tmp timeout 100 python3 $here/phases_gpu.py 2>&1 | grep -v USDT > $OUT/phases-new-bs1.txt
cat $OUT/log
