#!/bin/bash
# One GPU (issue 21, session 28): GPU tests of the spec files, then this tree ("new") against
# baseline/ (the tree before the session's changes, carried) in turns: phases_gpu.py at
# batch 1 and 32, and the paired bench (trained head, --compare spec-off --paired).
# Usage: run_ab.sh ROUNDS [tests]
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
here=$PWD/docs/results/2026-11-28-s28
root=$PWD
if [ "$2" = tests ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_spec_graphs.py tests/test_spec_device_drafts.py tests/test_spec_backoff.py 2>&1 | tail -4 | tee $OUT/gpu-tests.txt
fi
for round in $(seq 1 $1); do
  for tree in new base; do
    dir=$root; [ $tree = base ] && dir=$root/baseline
    (cd $dir && python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }
    for bs in 1 32; do
      wrap=0; [ $round = 1 ] && wrap=1
      echo "== $tree round $round batch $bs timers $wrap" | tee -a $OUT/log
      WRAP=$wrap BS=$bs OUTLEN=256 ROUNDS=4 OUT=/tmp timeout 100 python3 $here/phases_gpu.py 2>&1 | grep -v USDT > $OUT/phases-$tree-r$round-bs$bs.txt
      grep -E "TPOT|^==|step |spec.execute|spec.propose|proposer.propose_step|_graph_step|DraftStore.keep|load_step" $OUT/phases-$tree-r$round-bs$bs.txt | head -24 >> $OUT/log
    done
  done
done
cat $OUT/log | grep -E "^== (new|base)|TPOT"
