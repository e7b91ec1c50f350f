#!/bin/bash
# One GPU (issue 21; for a later session: branch wip/gemv-whole-k). A batch-1 GEMV whose
# program's rows of the weight (K padded to a power of two) fit PAGELM_GEMV_WHOLE_K_BYTES
# loads all of them in one chunk before its PDL wait, instead of 1024-wide chunks of which
# only the first is loaded before it (the others' HBM latency then follows the wait). At 16 KB
# that is qwen3-0.6b's o and down and llama-3.2-1b's qkv and o; at 32 KB also the 1B's gate_up.
# GEMV GPU tests first, then batch-1 decode with 0 (today) / 16384 / 32768 alternated, twice.
export PYTHONUNBUFFERED=1
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
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
PAGELM_GEMV_WHOLE_K_BYTES=32768 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_ops.py \
    -k gemv 2>&1 | tail -2 | tee -a $OUT/log
for round in 1 2; do
  for m in qwen3-0.6b llama-3.2-1b; do
    for bytes in 0 16384 32768; do
      bench new $m $m-whole$bytes-r$round PAGELM_GEMV_WHOLE_K_BYTES=$bytes
    done
  done
done
