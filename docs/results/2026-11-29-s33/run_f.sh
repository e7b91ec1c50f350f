#!/bin/bash
# One GPU (issue 21): batch-1 decode with the decode graphs' split-K count capped
# (PAGELM_GRAPH_MAX_SPLITS=1: no split launch and no reduce launch; the default is 32 splits
# of the KV range at batch 1), qwen3-0.6b at 128 + 512 tokens (contexts 128-640), alternated.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
for s in 32 1 32 1 4; do
  name=qwen3-0.6b-splits$s-$RANDOM
  ( cd /tmp && PAGELM_GRAPH_MAX_SPLITS=$s timeout 100 pagelm bench latency --model qwen3-0.6b --batch-sizes 1 --input-len 128 \
    --output-len 512 --iters 3 --max-model-len 4096 --json /tmp/$name.json > /tmp/$name.log 2>&1 )
  python3 - /tmp/$name.json $name <<'PY' | tee -a $OUT/log
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    print(f"[{sys.argv[2]}] {r['decode_tokens_per_s']:.1f} tok/s, TPOT {1000 * r['tpot_s']:.3f} ms")
except Exception as e:
    print(f"[{sys.argv[2]}] no result ({e})")
PY
done
