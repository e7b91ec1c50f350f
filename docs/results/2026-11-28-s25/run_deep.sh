#!/bin/bash
# One GPU (issue 21, session 25): EAGLE on the demo model with its trained head (eagle-demo/,
# demo-cache/ carried), batch 1 and 32, 128 in / 256 out, each run beside its own plain run.
# `old`: the deep-backoff change switched off (site_spec/sitecustomize.py, S25_NO_DEEP=1);
# `new`: as committed; `new128`: with "max_backoff_steps": 128. ORDER: e.g.
#   run_deep.sh reject:old reject:new reject:new128 trained:old trained:new reject:new128 reject:old
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache PYTHONPATH=$PWD/docs/results/2026-11-28-s25/site_spec
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
i=0
for what in "$@"; do
  i=$((i+1)); kind=${what%%:*}; variant=${what#*:}; name=$i-$kind-$variant
  maxb=32; envs=(X=1); extra=()
  [ $variant = old ] && envs=(S25_NO_DEEP=1)
  [ $variant = new128 ] && maxb=128
  [ $kind = reject ] && extra=(--spec-reject-all)
  EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$PWD/eagle-demo\", \"max_backoff_steps\": $maxb}"
  ( cd /tmp && env "${envs[@]}" timeout 150 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
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
