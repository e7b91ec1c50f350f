#!/bin/bash
# One GPU (issue 21, session 28): GPU tests of the spec files, then the paired bench (EAGLE
# with the trained head on the demo model against plain decoding, both engines up, timed in
# turns) for this tree ("new") and baseline/ (the tree before the session's changes) in turns,
# then one run of every draft rejected with this tree. Usage: run_paired_ab.sh ROUNDS [ITERS]
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
root=$PWD; rounds=${1:-2}; iters=${2:-10}
install() { (cd $1 && python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }; }
install $root
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_spec_graphs.py tests/test_spec_device_drafts.py tests/test_spec_backoff.py 2>&1 | tail -2 | tee $OUT/log
EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$root/eagle-demo\"}"
bench() {  # name [extra]
  local name=$1; shift
  echo "[$name] start $(date +%T)" >> $OUT/log
  ( cd /tmp && timeout 150 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
      --batch-sizes 1,32 --iters $iters --speculative-config "$EAGLE" --compare spec-off --paired "$@" \
      --json $OUT/$name.json > /tmp/$name.log 2>&1 )
  echo "[$name] rc=$? end $(date +%T)" | tee -a $OUT/log
  grep -E "pairs' speedups|^batch" /tmp/$name.log | sed 's/roofline.*MBU *[0-9.]*%//' | tee -a $OUT/log
}
for r in $(seq $rounds); do
  for tree in new base; do
    dir=$root; [ $tree = base ] && dir=$root/baseline
    install $dir
    bench $r-$tree-trained
  done
done
install $root
bench new-reject --spec-reject-all
