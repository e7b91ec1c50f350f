#!/bin/bash
# One H100 (issue 21, session 19): EAGLE's drafts left on the device until the next
# verification (DeviceDrafts), against the tree before it (baseline/ = 2bccc2a, carried),
# alternated on one warm machine. The 8B step-cost command is session 17's (run_vocab.sh):
# random llama-3.1-8b weights, a random EAGLE head with a 32,768-token draft vocabulary, k=3,
# adaptive off (every step drafts 3, ~none accepted), batch 1, 128 in / 128 out, beside no
# speculation: spec-step cost = plain tok/s / spec tok/s x acceptance length (goal <= 1.3x).
#   run_spec.sh tests   GPU tests: EAGLE's graph tests, the device-drafts tests (CUDA graphs on)
#   run_spec.sh new N   8B on this tree, as run N (8b-new-N)
#   run_spec.sh base N  8B on baseline/, as run N (8b-base-N)
#   run_spec.sh reject N  demo model, trained head, every draft shifted off by one
#                       (--spec-reject-all: a useless drafter; adaptive drafting on), batch
#                       1 and 32, this tree then baseline, as run N
#   run_spec.sh demo    demo model (demo-cache/), trained head (eagle-demo/), batch 1 and 32,
#                       this tree then baseline, each beside no speculation
# Logs and JSON under $OUT; `log` is the summary.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
inst() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" > /tmp/pip.log 2>&1 || { echo "install $1 failed"; tail -5 /tmp/pip.log; exit 1; }; }
bench() {  # bench NAME TIMEOUT ARGS...: one `pagelm bench latency`, its last lines in the log
    local name=$1 limit=$2; shift 2
    ( cd /tmp && timeout $limit pagelm bench latency --json $OUT/$name.json "$@" 2>&1 ) > $OUT/$name.log
    echo "[$name] rc=$?" | tee -a $OUT/log
    grep -v "^WARNING\|it/s\]\|step/s" $OUT/$name.log | tail -4 | sed "s/^/[$name] /" | tee -a $OUT/log
}
VOCAB='{"method": "eagle", "num_speculative_tokens": 3, "adaptive": false, "draft_vocab_size": 32768}'
EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$PWD/eagle-demo\"}"
big() { bench "$1" 240 --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 128 --iters 2 \
    --max-model-len 1024 --max-num-seqs 8 --random-draft-head --compare spec-off --speculative-config "$VOCAB"; }
demo() { bench "$1" 150 --model demo --workload code --input-len 128 --output-len 256 --batch-sizes 1,32 --iters 3 \
    --speculative-config "$EAGLE" --compare spec-off "${@:2}"; }
cost() {  # the step cost of every JSON of this call
    python3 - "$OUT" <<'PY' | tee -a $OUT/log
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for r in json.loads(path.read_text())["results"]:
        plain, spec = r["spec_off"]["decode_tokens_per_s"], r["decode_tokens_per_s"]
        length = r["spec"]["mean_acceptance_length"] or 1.0
        print(f"{path.stem}: batch {r['batch_size']}: plain {plain:.1f} tok/s, eagle {spec:.1f} tok/s ({spec / plain:.2f}x), "
              f"acceptance length {length:.2f}: spec-step cost {plain / spec * length:.2f}x a plain step")
PY
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/log
git log --oneline -1 | tee -a $OUT/log
case "$1" in
tests)
    inst .
    timeout 300 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors tests/test_spec_device_drafts.py \
        tests/test_spec_graphs.py -k "device or store or guided or eagle" -rA 2>&1 | grep -E "PASS|FAIL|SKIP|passed|failed|^E " | tail -20 | tee -a $OUT/log ;;
new) inst .; big 8b-new-$2; cost ;;
base) inst baseline; big 8b-base-$2; cost ;;
demo) inst .; demo demo-new; inst baseline; demo demo-base; cost ;;
reject) inst .; demo reject-new-$2 --spec-reject-all; inst baseline; demo reject-base-$2 --spec-reject-all; cost ;;
esac
