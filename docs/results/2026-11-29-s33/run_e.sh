#!/bin/bash
# One GPU (issue 21): the q/k/v GEMV pulling the o projection's weight into L2 at its end
# (PAGELM_L2_PREFETCH_TAIL_MB), while attention leaves HBM idle; batch-1 decode, off and on
# alternated. The GEMV prefetch tests first.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_ops.py -k prefetch 2>&1 | tail -1 | tee -a $OUT/log
for m in ${MODELS:-llama-3.1-8b qwen3-0.6b}; do
  for mb in ${MBS:-0 32 0 32}; do
    name=$m-tail$mb-$RANDOM
    ( cd /tmp && PAGELM_L2_PREFETCH_TAIL_MB=$mb timeout 150 pagelm bench latency --model $m --batch-sizes 1 --input-len 128 \
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
done
