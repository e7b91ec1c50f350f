#!/bin/bash
# One GPU (issue 21, session 32): the 8B speculative step's cost (session 17/19's command:
# random llama-3.1-8b weights, a random EAGLE head with a 32,768-token draft vocabulary, k=3,
# adaptive off, batch 1, 128 in / 128 out, beside no speculation; cost = plain tok/s / spec
# tok/s x acceptance length, goal <= 1.3x) on this tree (the 2.25 kernels) and on baseline/
# (e349c29, the tree before them), one after the other.
export PYTHONUNBUFFERED=1
VOCAB='{"method": "eagle", "num_speculative_tokens": 3, "adaptive": false, "draft_vocab_size": 32768}'
for tree in new base; do
  dir=$PWD; [ $tree = base ] && dir=$PWD/baseline
  python3 -m pip install -q --no-deps --no-build-isolation -e $dir > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
  ( cd /tmp && timeout 260 pagelm bench latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 128 \
      --iters 2 --max-model-len 1024 --max-num-seqs 8 --random-draft-head --compare spec-off \
      --speculative-config "$VOCAB" --json $OUT/8b-$tree.json > $OUT/8b-$tree.log 2>&1 )
  echo "[$tree] rc=$?" | tee -a $OUT/log
  grep -E "^batch" $OUT/8b-$tree.log | tee -a $OUT/log
done
