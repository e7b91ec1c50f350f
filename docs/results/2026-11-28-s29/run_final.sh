#!/bin/bash
# One GPU (issue 21, session 29): the GPU tests of the decode fast path and the spec files;
# phases_gpu.py (timers off, REJECT=1: plain decoding, EAGLE with the trained head and EAGLE
# with every draft rejected, in one process) for this tree ("new") and baseline/ (main before
# the session) in turns at batch 1 and 32; this tree's phases at batch 1 with timers; then
# profile_gpu.py at batch 1 and 32 (PROFILE_BS="": none). Usage: run_final.sh ROUNDS
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
here=$PWD/docs/results/2026-11-28-s29
root=$PWD
install() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }; }
install $root
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fast_path.py tests/test_spec_graphs.py \
  tests/test_spec_device_drafts.py tests/test_spec_backoff.py 2>&1 | tail -3 | tee $OUT/log
for round in $(seq 1 $1); do
  for tree in new base; do
    dir=$root; [ $tree = base ] && dir=$root/baseline
    install $dir
    for bs in 1 32; do
      echo "== $tree round $round batch $bs" >> $OUT/log
      REJECT=1 WRAP=0 BS=$bs OUTLEN=256 ROUNDS=6 timeout 120 python3 $here/phases_gpu.py 2>&1 | grep -E 'TPOT|acceptance' >> $OUT/log
    done
  done
done
install $root
WRAP=1 BS=1 OUTLEN=256 ROUNDS=4 OUT=/tmp timeout 100 python3 $here/phases_gpu.py 2>&1 | grep -v USDT > $OUT/phases-new-bs1.txt
for bs in ${PROFILE_BS-1 32}; do
  BS=$bs timeout 100 python3 $here/profile_gpu.py 2>&1 | grep -v USDT > $OUT/prof-bs$bs.txt
done
cat $OUT/log
