#!/bin/bash
# One GPU (issue 21, session 27), after c44ce6c: per-step host times with the change and
# without it (site_noskip/), batch 1 and 32, then the paired bench with every draft rejected.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
root=$PWD; here=$root/docs/results/2026-11-28-s27
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
for cfg in "1 skip 6" "1 noskip 6" "32 skip 3" "32 noskip 3"; do
  set -- $cfg; pp=""; [ $2 = noskip ] && pp=$here/site_noskip
  echo "== steps, batch $1, $2" | tee -a $OUT/log
  PYTHONPATH=$pp BS=$1 OUTLEN=256 ROUNDS=$3 OUT=/tmp timeout 95 python3 $here/steps_gpu.py 2>&1 | grep -E "^(plain|reject|trained)" | tee -a $OUT/log
done
EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$root/eagle-demo\"}"
( cd /tmp && timeout 70 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
    --batch-sizes 1,32 --iters 10 --speculative-config "$EAGLE" --compare spec-off --paired --spec-reject-all \
    --json $OUT/reject-paired.json > /tmp/rp.log 2>&1 )
echo "[reject-paired] rc=$?" | tee -a $OUT/log; grep -E "^batch" /tmp/rp.log | sed 's/roofline.*MBU *[0-9.]*%//' | tee -a $OUT/log
