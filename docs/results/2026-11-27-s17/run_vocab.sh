#!/bin/bash
# One H100 (issue 21, session 17): what one speculative EAGLE step costs at llama-3.1-8b shapes
# with a 32,768-token draft vocabulary (EAGLE-3's reduced vocabulary: each drafting pass reads
# 32,768 rows of the 128,256-row LM head), against the full vocabulary (session 16: 1.51x a
# plain decode step, goal <= 1.3x). Same command as session 16's `run_spec.sh` 8B run: random
# target weights, a random EAGLE head of its shapes (--random-draft-head), k=3, adaptive
# drafting off (every step drafts 3, ~none accepted), batch 1, 128 in / 128 out, each run
# beside no speculation (--compare spec-off).
#   run_vocab.sh         (~7 min) round 1: full vocabulary, then the 32,768-token draft vocabulary
#   run_vocab.sh 2       (~7 min) round 2, the other order: draft vocabulary, then full
#   run_vocab.sh tests   (~3 min) the GPU test of EAGLE's drafting graphs, full and draft vocabulary
# From the repository root, nothing to carry (the 8B preset and both random heads, ~0.5 GB
# each, are written on the device under $PAGELM_CACHE_DIR). Logs and JSON under $OUT; `log`
# is the summary, ending with each run's step cost:
#   spec-step cost = spec_off.decode_tokens_per_s / decode_tokens_per_s x spec.mean_acceptance_length
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=${PAGELM_CACHE_DIR:-/tmp/pagelm-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/log
git log --oneline -1 | tee -a $OUT/log
bench() {  # bench NAME TIMEOUT ARGS...: one `pagelm bench latency`, its last lines in the log
    local name=$1 limit=$2; shift 2
    ( cd /tmp && timeout $limit pagelm bench latency --json $OUT/$name.json "$@" 2>&1 ) > $OUT/$name.log
    echo "[$name] rc=$?" | tee -a $OUT/log
    grep -v "^WARNING\|it/s\]\|step/s" $OUT/$name.log | tail -6 | sed "s/^/[$name] /" | tee -a $OUT/log
}
FULL='{"method": "eagle", "num_speculative_tokens": 3, "adaptive": false}'
VOCAB='{"method": "eagle", "num_speculative_tokens": 3, "adaptive": false, "draft_vocab_size": 32768}'
big() { bench "$1" "$2" --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 128 --iters 2 \
    --max-model-len 1024 --max-num-seqs 8 --random-draft-head --compare spec-off --speculative-config "${@:3}"; }
cost() {  # the step cost of every JSON of this call
    python3 - "$OUT" <<'PY' | tee -a $OUT/log
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("8b-*.json")):
    for r in json.loads(path.read_text())["results"]:
        plain, spec = r["spec_off"]["decode_tokens_per_s"], r["decode_tokens_per_s"]
        length = r["spec"]["mean_acceptance_length"] or 1.0
        print(f"{path.stem}: batch {r['batch_size']}: plain {plain:.1f} tok/s, eagle {spec:.1f} tok/s, "
              f"acceptance length {length:.2f}: spec-step cost {plain / spec * length:.2f}x a plain step")
PY
}

case "$1" in
tests)
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_spec_graphs.py -k "eagle_greedy_tokens" -rA 2>&1 \
        | grep -E "PASS|FAIL|passed|failed|^E " | tail -8 | tee -a $OUT/log ;;
2)
    big 8b-vocab32768-r2 240 "$VOCAB"
    big 8b-full-r2 240 "$FULL"
    cost ;;
*)
    big 8b-full-r1 240 "$FULL"
    big 8b-vocab32768-r1 240 "$VOCAB"
    cost ;;
esac
