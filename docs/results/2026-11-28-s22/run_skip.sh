#!/bin/bash
# One H100 (issue 21, session 22), an experiment not merged: EAGLE's head skipping the steps
# where nobody drafts. It needs a one-line change not in the tree: in
# plugins/spec_decode/eagle.py, `needs_ahead_target = os.environ.get("PAGELM_EAGLE_SKIP_IDLE") != "1"`
# (the head's KV then goes stale over the skipped steps; outputs stay exact). Demo model with
# its trained head (eagle-demo/, demo-cache/ carried), batch 1 and 32, each beside its own
# plain run: every draft rejected (a useless drafter) and as trained, with and without the skip.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || exit 1
EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$PWD/eagle-demo\"}"
b() { name=$1; shift; ( cd /tmp && env "$@" timeout 150 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 --batch-sizes 1,32 --iters 3 \
  --speculative-config "$EAGLE" --compare spec-off $EXTRA --json $OUT/$name.json 2>&1 ) > $OUT/$name.log; echo "[$name] rc=$?";
  python3 - $OUT/$name.json <<'PY'
import json,sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(f"  batch {r['batch_size']}: plain {r['spec_off']['decode_tokens_per_s']:.0f} eagle {r['decode_tokens_per_s']:.0f} = {r['decode_tokens_per_s']/r['spec_off']['decode_tokens_per_s']:.2f}x, acc len {r['spec']['mean_acceptance_length']}")
PY
}
EXTRA=--spec-reject-all b reject-now X=1
EXTRA=--spec-reject-all b reject-skip PAGELM_EAGLE_SKIP_IDLE=1
EXTRA= b trained-now X=1
EXTRA= b trained-skip PAGELM_EAGLE_SKIP_IDLE=1
EXTRA=--spec-reject-all b reject-now2 X=1
EXTRA=--spec-reject-all b reject-skip2 PAGELM_EAGLE_SKIP_IDLE=1
