#!/bin/bash
# CPU (2 cores): the same bench command as run_gpu.sh, for the code before (80ae65c, installed
# editable in a venv: /tmp/s26venv/bin/pagelm) and after (pagelm), alternated.
# usage: cpu_ab.sh OUTDIR base new new base ...
out=$1; shift; mkdir -p $out; i=0
export PAGELM_CACHE_DIR=/work/main/demo-cache
for variant in "$@"; do
  cli=pagelm; [ $variant = base ] && cli=/tmp/s26venv/bin/pagelm
  for kind in trained reject; do
    i=$((i+1)); name=$i-$variant-$kind; extra=()
    [ $kind = reject ] && extra=(--spec-reject-all)
    EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"/work/main/eagle-demo\"}"
    ( cd /tmp && $cli bench latency --model demo --workload code --input-len 128 --output-len 256 \
        --batch-sizes 1,32 --iters 3 --speculative-config "$EAGLE" --compare spec-off "${extra[@]}" --json $out/$name.json > $out/$name.log 2>&1 )
    python3 - $out/$name.json $name <<'PY'
import json,sys
for r in json.load(open(sys.argv[1]))["results"]:
    s, p = r["decode_tokens_per_s"], r["spec_off"]["decode_tokens_per_s"]
    print(f"{sys.argv[2]} batch {r['batch_size']}: plain {p:.0f} eagle {s:.0f} = {s/p:.2f}x, acc len {r['spec']['mean_acceptance_length']:.2f}, drafts {r['spec'].get('num_drafts')}")
PY
    [ -s $out/$name.json ] && rm -f $out/$name.log
  done
done
