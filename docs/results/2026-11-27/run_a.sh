#!/bin/bash
# One GPU (issue 21): EAGLE's drafting graphs, first GPU run: the GPU test (graphs = eager = no
# speculation), then the demo model (demo-cache/, carried, so the device does not train its own)
# with its EAGLE head trained on the CPU (eagle-demo/, carried), drafting graphs off and on,
# beside no speculation; then Medusa's heads (medusa-demo/, carried).
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_spec_graphs.py -k eagle -rA 2>&1 | grep -E "PASS|FAIL|passed|failed|^E " | tail -6 | tee $OUT/log
bench() { ( cd /tmp && timeout 120 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
    --batch-sizes 1,32 --speculative-config "$spec" --iters 2 --json $OUT/$1.json "${@:2}" 2>&1 ) \
    | grep -v "^WARNING\|it/s\]\|step/s" | tail -6 | sed "s/^/[$1] /" | tee -a $OUT/log; }
spec="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$PWD/eagle-demo\"}"
bench eagle-graphs-off --compare spec-off
PAGELM_EAGLE_DRAFT_GRAPHS=1 bench eagle-graphs-on
spec="{\"method\": \"medusa\", \"num_speculative_tokens\": 3, \"model\": \"$PWD/medusa-demo\"}"
bench medusa
