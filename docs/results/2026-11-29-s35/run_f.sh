#!/bin/bash
# One GPU (issue 21; for a later session, after run_e.sh, branch wip/decode-rotary): the
# in-kernel split merge (PAGELM_SPLIT_REDUCE_FUSION=1, 8% slower on an H100 in session 14,
# before PDL and the metadata reads before the wait) on main and on the fold, beside neither:
# qwen3-0.6b at batch 1, four settings alternated twice.
export PYTHONUNBUFFERED=1
source <(sed -n '/^bench()/,/^}/p' "$(dirname "$0")/run_e.sh")
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
for round in 1 2; do
  for tree in new base; do
    bench $tree qwen3-0.6b qwen3-0.6b-$tree-r$round PAGELM_SPLIT_REDUCE_FUSION=0
    bench $tree qwen3-0.6b qwen3-0.6b-$tree-merged-r$round PAGELM_SPLIT_REDUCE_FUSION=1
  done
done
