#!/bin/bash
# One GPU (issue 21; for a later session: branch wip/decode-rotary). One-token split-K decode
# attention does the q/k norm, rotary and K/V store itself, one kernel fewer per layer. First
# the GPU tests (the kernel against the two it replaces at qwen3-0.6b's shape, both ways of
# merging splits; no Triton build inside a step; PDL on/off), then batch-1 decode, this tree
# and baseline/ (main: `git archive main | tar -x -C baseline`) alternated: qwen3-0.6b twice,
# llama-3.1-8b once. run_f.sh adds the in-kernel split merge on both trees.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
bench() {  # tree model name [env...]
    tree=$1 model=$2 name=$3; shift 3
    dir=$PWD; [ $tree = base ] && dir=$PWD/baseline
    python3 -m pip install -q --no-deps --no-build-isolation -e $dir > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
    ( cd /tmp && env "$@" timeout 120 pagelm bench latency --model $model --batch-sizes 1 --input-len 128 \
        --output-len 512 --iters 3 --max-model-len 4096 --json /tmp/$name.json > /tmp/$name.log 2>&1 )
    python3 - /tmp/$name.json $name <<'PY' | tee -a $OUT/log
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    print(f"[{sys.argv[2]}] {r['decode_tokens_per_s']:.1f} tok/s, TPOT {1000 * r['tpot_s']:.3f} ms")
except Exception as e:
    print(f"[{sys.argv[2]}] no result ({e})")
PY
}
if [ -z "$SKIP_TESTS" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
  timeout ${TEST_S:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_rotary.py \
      tests/test_triton_builds_at_startup.py tests/test_pdl_metadata.py 2>&1 | tail -4 | tee -a $OUT/log
fi
for round in 1 2; do
  for tree in new base; do bench $tree qwen3-0.6b qwen3-0.6b-$tree-r$round X=1; done
done
for tree in new base; do bench $tree llama-3.1-8b llama-3.1-8b-$tree-r1 X=1; done
