#!/bin/bash
# One H100 (issue 21, session 16): speculative steps with one host sync, Medusa's heads in CUDA
# graphs, and what one speculative step costs at llama-3.1-8b shapes.
#   run_spec.sh      (~8 min) the GPU spec-graph tests (EAGLE, Medusa), the demo model (demo-cache/,
#                    carried) batch 1,32: no speculation / EAGLE (eagle-demo/, carried) / Medusa
#                    (medusa-demo/, carried), k=3; then llama-3.1-8b random weights, random EAGLE
#                    head (--random-draft-head), adaptive off, batch 1, 128 in / 128 out, beside no
#                    speculation: spec-step cost = plain tok/s / spec tok/s x acceptance length.
#   run_spec.sh ab   (~4 min) the same EAGLE and 8B runs with the drafting after the host sync as
#                    before (PAGELM_SPEC_ONE_SYNC=0), and Medusa with its heads eager, for the A/B
#                    on the same machine.
# Logs and JSON under $OUT.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/log
git log --oneline -1 | tee -a $OUT/log
bench() {  # bench NAME TIMEOUT ARGS...: one `pagelm bench latency`, its last lines in the log
    local name=$1 limit=$2; shift 2
    ( cd /tmp && timeout $limit pagelm bench latency --json $OUT/$name.json "$@" 2>&1 ) > $OUT/$name.log
    echo "[$name] rc=$?" | tee -a $OUT/log
    grep -v "^WARNING\|it/s\]\|step/s" $OUT/$name.log | tail -6 | sed "s/^/[$name] /" | tee -a $OUT/log
}
demo() { bench "$1" "$2" --model demo --workload code --input-len 128 --output-len 256 --batch-sizes 1,32 --iters 2 "${@:3}"; }
EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$PWD/eagle-demo\"}"
MEDUSA="{\"method\": \"medusa\", \"num_speculative_tokens\": 3, \"model\": \"$PWD/medusa-demo\"}"
RANDOM_EAGLE='{"method": "eagle", "num_speculative_tokens": 3, "adaptive": false}'
big() { bench "$1" "$2" --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 128 --iters 2 \
    --max-model-len 1024 --max-num-seqs 8 --speculative-config "$RANDOM_EAGLE" --random-draft-head "${@:3}"; }

if [ "$1" = "ab" ]; then
    PAGELM_SPEC_ONE_SYNC=0 demo eagle-two-syncs 110 --speculative-config "$EAGLE"
    PAGELM_MEDUSA_DRAFT_GRAPHS=0 demo medusa-eager 90 --speculative-config "$MEDUSA"
    PAGELM_SPEC_ONE_SYNC=0 big 8b-eagle-two-syncs 150
    exit 0
fi

timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests/test_spec_graphs.py \
    -k "eagle or medusa" -rA 2>&1 | grep -E "PASS|FAIL|passed|failed|^E " | tail -8 | tee -a $OUT/log
demo eagle 120 --speculative-config "$EAGLE" --compare spec-off
demo medusa 90 --speculative-config "$MEDUSA"
big 8b-eagle 170 --compare spec-off
