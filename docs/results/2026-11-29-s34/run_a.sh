#!/bin/bash
# One GPU (issue 21, session 34, call 1; written in session 33 on branch wip/hoist-metadata): rotary, the K/V store,
# split-K attention and its reduce read the step's metadata before waiting for the kernel
# before them (PDL), and attention looks each tile's blocks up one tile ahead. First the GPU
# tests that compare these kernels and whole runs' tokens; then batch-1 decode, this tree and
# baseline/ (main before the change: `git archive main | tar -x -C baseline`) alternated.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_gpu.py tests/test_rotary_kv_store.py \
    tests/test_gpu_fast_path.py tests/test_spec_graphs.py tests/test_pdl_metadata.py 2>&1 | tail -2 | tee -a $OUT/log
for round in 1 2; do
  for tree in new base; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/baseline
    python3 -m pip install -q --no-deps --no-build-isolation -e $dir > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
    for m in ${MODELS:-qwen3-0.6b llama-3.1-8b}; do
      name=$m-$tree-r$round
      ( cd /tmp && timeout 120 pagelm bench latency --model $m --batch-sizes 1 --input-len 128 --output-len 512 \
          --iters 3 --max-model-len 4096 --json /tmp/$name.json > /tmp/$name.log 2>&1 )
      python3 - /tmp/$name.json $name <<'PY' | tee -a $OUT/log
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    print(f"[{sys.argv[2]}] {r['decode_tokens_per_s']:.1f} tok/s, TPOT {1000 * r['tpot_s']:.3f} ms")
except Exception as e:
    print(f"[{sys.argv[2]}] no result ({e})")
PY
    done
  done
done
