#!/bin/bash
# One GPU (issue 21, session 29): phases_gpu.py (timers off: TPOT of plain decoding and EAGLE
# with the trained head in one process) for this tree ("new") and baseline/ (main before the
# session) in turns at batch 1 and 32, then profile_gpu.py for this tree at batch 1 when
# PROFILE=1. Usage: run_ab.sh ROUNDS
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
here=$PWD/docs/results/2026-11-28-s29
root=$PWD
install() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }; }
for round in $(seq 1 $1); do
  for tree in new base; do
    dir=$root; [ $tree = base ] && dir=$root/baseline
    install $dir
    for bs in 1 32; do
      echo "== $tree round $round batch $bs" >> $OUT/log
      WRAP=0 BS=$bs OUTLEN=256 ROUNDS=6 timeout 100 python3 $here/phases_gpu.py 2>&1 | grep -E 'TPOT|acceptance' >> $OUT/log
    done
  done
done
install $root
if [ "$PROFILE" = 1 ]; then
  BS=1 timeout 150 python3 $here/profile_gpu.py 2>&1 | grep -v USDT > $OUT/prof-bs1.txt
  WRAP=1 BS=1 OUTLEN=256 ROUNDS=4 OUT=/tmp timeout 100 python3 $here/phases_gpu.py 2>&1 | grep -v USDT > $OUT/phases-new-bs1.txt
fi
cat $OUT/log
