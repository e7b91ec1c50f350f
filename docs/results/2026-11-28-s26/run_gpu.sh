#!/bin/bash
# One GPU (issue 21, session 26): EAGLE on the demo model with its trained head (eagle-demo/,
# demo-cache/ carried) and with every draft rejected, batch 1 and 32, 128 in / 256 out, each
# run beside its own plain run, for the code before this session's changes (s26base/ = 80ae65c,
# carried) and after (the tree), alternated: run_gpu.sh base new new base
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
root=$PWD; i=0
for variant in "$@"; do
  tree=$root; [ $variant = base ] && tree=$root/s26base
  python3 -m pip install -q --no-deps --no-build-isolation -e $tree > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
  for kind in trained reject; do
    i=$((i+1)); name=$i-$variant-$kind; extra=()
    [ $kind = reject ] && extra=(--spec-reject-all)
    EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$root/eagle-demo\"}"
    ( cd /tmp && timeout 150 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
        --batch-sizes 1,32 --iters 3 --speculative-config "$EAGLE" --compare spec-off "${extra[@]}" --json $OUT/$name.json 2>&1 ) > $OUT/$name.log
    echo "[$name] rc=$? $(date +%T)" | tee -a $OUT/log
    python3 - $OUT/$name.json <<'PY' | tee -a $OUT/log
import json,sys
for r in json.load(open(sys.argv[1]))["results"]:
    s, p = r["decode_tokens_per_s"], r["spec_off"]["decode_tokens_per_s"]
    print(f"  batch {r['batch_size']}: plain {p:.0f} eagle {s:.0f} = {s/p:.2f}x, acc len {r['spec']['mean_acceptance_length']}, drafts {r['spec'].get('num_drafts')}")
PY
    [ -s $OUT/$name.json ] && rm -f $OUT/$name.log
  done
done
python3 -m pip install -q --no-deps --no-build-isolation -e $root > /tmp/pip.log 2>&1
if [ -n "$TESTS" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS 2>&1 | tail -15 | tee -a $OUT/log
fi
