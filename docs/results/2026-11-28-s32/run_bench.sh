#!/bin/bash
# One GPU (issue 21, session 32): the speculative goals as `pagelm bench latency --paired`
# figures (24 pairs) after the 2.25 kernels: this session's head (eagle-xl/) at k = 5 (batch 1)
# and k = 3 (batch 1, 32), session 30's (eagle-long/) at k = 3, every draft rejected at k = 3.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
root=$PWD; iters=${1:-24}
python3 -m pip install -q --no-deps --no-build-isolation -e $root > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
run() {  # name head k batch-sizes [extra]
  local spec="{\"method\": \"eagle\", \"num_speculative_tokens\": $3, \"model\": \"$root/$2\"}"
  ( cd /tmp && timeout 200 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
      --batch-sizes $4 --iters $iters --speculative-config "$spec" --compare spec-off --paired $5 \
      --json $OUT/$1.json > /tmp/$1.log 2>&1 )
  echo "[$1: $2 k=$3 $5] rc=$?" | tee -a $OUT/log
  grep -E "pairs' speedups|^batch|acceptance" /tmp/$1.log | sed 's/roofline.*MBU *[0-9.]*%//' | tee -a $OUT/log
}
run xl-k5 eagle-xl 5 1
run xl-k3 eagle-xl 3 1,32
run long-k3 eagle-long 3 1,32
run reject eagle-long 3 1,32 --spec-reject-all
