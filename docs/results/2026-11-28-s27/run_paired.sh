#!/bin/bash
# One GPU (issue 21, session 27): EAGLE on the demo model (trained head eagle-demo/, and every
# draft rejected) against plain decoding with `--paired`: both engines up at once, in two
# processes, timed run by run in turns. The SM clock is logged every 250 ms meanwhile.
# Usage: run_paired.sh ROUNDS [ITERS]
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
root=$PWD; rounds=${1:-2}; iters=${2:-10}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu,clocks_event_reasons.active --format=csv,noheader -lms 250 > $OUT/clocks.csv &
smi=$!
python3 -m pip install -q --no-deps --no-build-isolation -e $root > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$root/eagle-demo\"}"
i=0
for r in $(seq $rounds); do
  for kind in trained reject; do
    i=$((i+1)); name=$i-$kind; extra=(); [ $kind = reject ] && extra=(--spec-reject-all)
    echo "[$name] start $(date +%T.%N | cut -c1-12)" >> $OUT/log
    ( cd /tmp && timeout 200 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
        --batch-sizes 1,32 --iters $iters --speculative-config "$EAGLE" --compare spec-off --paired "${extra[@]}" \
        --json $OUT/$name.json > /tmp/$name.log 2>&1 )
    echo "[$name] rc=$? end $(date +%T.%N | cut -c1-12)" | tee -a $OUT/log
    grep -E "pairs' speedups|^batch" /tmp/$name.log | sed 's/roofline.*MBU *[0-9.]*%//' | tee -a $OUT/log
  done
done
kill $smi
