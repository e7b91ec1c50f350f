#!/bin/bash
# One GPU (issue 21, session 34, call 3; branch wip/kv-before-wait): split-K decode attention
# reads its first tile's keys and values from before the step's own tokens before the PDL
# wait. First batch-1 decode, this tree and baseline/ (main before it: `git archive main |
# tar -x -C baseline`) alternated; then the GPU tests (PDL on/off, EAGLE's drafts among them).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
bench() {  # tree model name
    dir=$PWD; [ $1 = base ] && dir=$PWD/baseline
    python3 -m pip install -q --no-deps --no-build-isolation -e $dir > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
    ( cd /tmp && timeout 120 pagelm bench latency --model $2 --batch-sizes 1 --input-len 128 --output-len 512 \
        --iters 3 --max-model-len 4096 --json /tmp/$3.json > /tmp/$3.log 2>&1 )
    python3 - /tmp/$3.json $3 <<'PY' | tee -a $OUT/log
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    print(f"[{sys.argv[2]}] {r['decode_tokens_per_s']:.1f} tok/s, TPOT {1000 * r['tpot_s']:.3f} ms")
except Exception as e:
    print(f"[{sys.argv[2]}] no result ({e})")
PY
}
for round in 1 2; do
  for tree in new base; do bench $tree qwen3-0.6b qwen3-0.6b-$tree-r$round; done
done
for tree in new base; do bench $tree llama-3.1-8b llama-3.1-8b-$tree-r1; done
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
timeout ${TEST_S:-280} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pdl_metadata.py tests/test_triton_gpu.py \
    2>&1 | tail -3 | tee -a $OUT/log
