#!/bin/bash
# One GPU (issue 21, session 30): phases_gpu.py (timers off, REJECT=1 COLD=1: plain decoding,
# EAGLE with the trained head, EAGLE with every draft rejected, and the same with the
# proposer's record cleared before each batch, in one process) for this tree ("new") and
# baseline/ (main before the session) in turns at batch 1 and 32. HEAD, K from the
# environment. Usage: run_ab.sh ROUNDS [TREES]
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
here=$PWD/docs/results/2026-11-28-s30
root=$PWD
install() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }; }
for round in $(seq 1 $1); do
  for tree in ${2-new base}; do
    dir=$root; [ $tree = base ] && dir=$root/baseline
    install $dir
    for bs in ${BS_LIST-1 32}; do
      echo "== $tree round $round batch $bs K=${K-3} HEAD=${HEAD-eagle-demo}" >> $OUT/log
      REJECT=1 COLD=1 WRAP=0 BS=$bs OUTLEN=256 ROUNDS=${ROUNDS-6} timeout 250 python3 $here/phases_gpu.py 2>&1 | grep -E 'TPOT|acceptance|verifications a|per-round' >> $OUT/log
    done
  done
done
install $root
cat $OUT/log
