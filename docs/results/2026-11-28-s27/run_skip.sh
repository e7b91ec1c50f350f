#!/bin/bash
# One GPU (issue 21, session 27): Proposer.skip_ahead on and off (site_noskip/), the demo model
# with EAGLE: per-step host times (steps_gpu.py), then the paired bench.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
root=$PWD; here=$root/docs/results/2026-11-28-s27
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
for v in skip noskip; do
  pp=""; [ $v = noskip ] && pp=$here/site_noskip
  echo "== steps, $v" | tee -a $OUT/log
  PYTHONPATH=$pp BS=1 OUTLEN=256 ROUNDS=8 OUT=/tmp timeout 150 python3 $here/steps_gpu.py 2>&1 | grep -E "^(plain|reject|trained|batch)" | tee -a $OUT/log
done
EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$root/eagle-demo\"}"
for run in reject-skip reject-noskip trained-skip reject-skip2; do
  pp=""; [ $run = reject-noskip ] && pp=$here/site_noskip
  extra=(); [[ $run = reject* ]] && extra=(--spec-reject-all)
  ( cd /tmp && PYTHONPATH=$pp timeout 150 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
      --batch-sizes 1,32 --iters 10 --speculative-config "$EAGLE" --compare spec-off --paired "${extra[@]}" \
      --json $OUT/$run.json > /tmp/$run.log 2>&1 )
  echo "[$run] rc=$?" | tee -a $OUT/log
  grep -E "^batch" /tmp/$run.log | sed 's/roofline.*MBU *[0-9.]*%//' | tee -a $OUT/log
done
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu $root/tests/test_spec_graphs.py $root/tests/test_spec_device_drafts.py $root/tests/test_spec_backoff.py 2>&1 | tail -6 | tee -a $OUT/log
