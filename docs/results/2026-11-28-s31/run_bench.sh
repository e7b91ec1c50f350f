#!/bin/bash
# One GPU (issue 21, session 31): the goals as `pagelm bench latency` figures. EAGLE with the
# trained head (eagle-long/), then with every draft rejected, against plain decoding,
# `--paired` (both engines up, in two processes, timed run by run in turns; the speedup is the
# median over the pairs). Usage: run_bench.sh [ITERS]
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
root=$PWD; iters=${1:-24}
python3 -m pip install -q --no-deps --no-build-isolation -e $root > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$root/eagle-long\"}"
for kind in trained reject; do
  extra=(); [ $kind = reject ] && extra=(--spec-reject-all)
  ( cd /tmp && timeout 280 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
      --batch-sizes 1,32 --iters $iters --speculative-config "$EAGLE" --compare spec-off --paired "${extra[@]}" \
      --json $OUT/$kind.json > /tmp/$kind.log 2>&1 )
  echo "[$kind] rc=$?" | tee -a $OUT/log
  grep -E "pairs' speedups|^batch" /tmp/$kind.log | sed 's/roofline.*MBU *[0-9.]*%//' | tee -a $OUT/log
done
