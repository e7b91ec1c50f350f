#!/bin/bash
# One GPU (issue 21, session 35): whole-K GEMV chunks on by default (16 KB, unpadded K) vs
# baseline/ (main). GPU tests of the GEMV, the fast path and the reference models first, then
# batch-1 decode: llama-3.2-1b twice, qwen3-0.6b once, alternated with main.
export PYTHONUNBUFFERED=1
source <(sed -n '/^bench()/,/^}/p' "$(dirname "$0")/run_g.sh")
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_ops.py \
    tests/test_gpu_fast_path.py tests/test_gpu_reference.py tests/test_pdl_metadata.py 2>&1 | tail -4 | tee -a $OUT/log
for round in 1 2; do
  for tree in new base; do bench $tree llama-3.2-1b llama-3.2-1b-$tree-r$round X=1; done
done
for tree in new base; do bench $tree qwen3-0.6b qwen3-0.6b-$tree-r1 X=1; done
