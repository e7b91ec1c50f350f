#!/bin/bash
# One GPU (issue 21, session 29): the GPU tests of the spec files, cProfile of this tree's
# EAGLE and plain engines per step (profile_gpu.py, batch 1 and 32), then phases_gpu.py
# (timers off: TPOT of plain decoding and EAGLE with the trained head in one process) for
# this tree ("new") and baseline/ (main before the session) in turns. Usage: run_prof.sh ROUNDS
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
here=$PWD/docs/results/2026-11-28-s29
root=$PWD
install() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }; }
install $root
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_spec_graphs.py tests/test_spec_device_drafts.py \
  tests/test_spec_backoff.py 2>&1 | tail -3 | tee $OUT/log
for bs in 1 32; do
  BS=$bs timeout 150 python3 $here/profile_gpu.py 2>&1 | grep -v USDT > $OUT/prof-bs$bs.txt
done
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
cat $OUT/log
