#!/bin/bash
# One GPU (issue 21): EAGLE's drafting graphs, first GPU run: the GPU test (graphs = eager = no
# speculation), then the demo model with its head trained on the CPU (eagle-demo/, carried),
# drafting graphs off and on, beside no speculation.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_spec_graphs.py -k eagle -rA 2>&1 | grep -E "PASS|FAIL|passed|failed|^E " | tail -6 | tee $OUT/log
spec="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$PWD/eagle-demo\"}"
bench() { ( cd /tmp && timeout 150 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
    --batch-sizes 1,32 --speculative-config "$spec" --iters 2 --json $OUT/eagle-$1.json "${@:2}" 2>&1 ) \
    | grep -v "^WARNING\|it/s\]" | tail -6 | sed "s/^/[$1] /" | tee -a $OUT/log; }
bench graphs-off --compare spec-off
PAGELM_EAGLE_DRAFT_GRAPHS=1 bench graphs-on
