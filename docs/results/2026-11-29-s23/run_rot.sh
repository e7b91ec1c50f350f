#!/bin/bash
# One H100 (issue 21, session 23): the q/k norm + rotary + K/V store fusion made the default.
# "tests": the GPU tests that run it, with FlashInfer and xgrammar from .whl (carried);
# "bench": `pagelm bench latency` at batch 1, fused (default) and PAGELM_ROTARY_KV_FUSION=0
# interleaved, "MODEL:BACKEND:ROUNDS" ...; "tput ROUNDS": the nano-vllm workload, fused / not.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD && export PYTHONUNBUFFERED=1 || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || exit 1
mode=$1; shift
if [ "$mode" = tests ]; then
  timeout 560 python3 -m pytest -q -p no:cacheprovider "$@" > $OUT/tests.log 2>&1
  echo "[tests] rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -12
  exit
fi
if [ "$mode" = tput ]; then  # nano-vllm throughput on qwen3-0.6b, fused / not, alternated
  for r in $(seq 1 ${1:-1}); do
    for fusion in 1 0; do
      name=tput-fusion$fusion-r$r
      ( cd /tmp && PAGELM_ROTARY_KV_FUSION=$fusion timeout 200 pagelm bench throughput --model qwen3-0.6b --workload nano-vllm \
          --max-model-len 4096 --json $OUT/$name.json 2>&1 ) > $OUT/$name.log
      rc=$?; [ $rc = 0 ] && rm -f $OUT/$name.log
      python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][-1]; print(f\"[{sys.argv[2]}] {r['output_tokens_per_s']:.0f} output tok/s, {r['elapsed_s']:.2f} s\")" $OUT/$name.json $name 2>&1 | tail -1
    done
  done
  exit
fi
for spec in "$@"; do
  IFS=: read model backend rounds <<< "$spec"
  for r in $(seq 1 ${rounds:-1}); do
    for fusion in 1 0; do
      name=$model-$backend-fusion$fusion-r$r
      ( cd /tmp && PAGELM_ROTARY_KV_FUSION=$fusion timeout 200 pagelm bench latency --model $model --batch-sizes 1 --input-len 128 \
          --output-len 512 --iters 3 --max-model-len 4096 --attention-backend $backend --json $OUT/$name.json 2>&1 ) > $OUT/$name.log
      rc=$?; [ $rc = 0 ] && rm -f $OUT/$name.log
      python3 - $OUT/$name.json $name $rc <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    print(f"[{sys.argv[2]}] {r['decode_tokens_per_s']:.1f} tok/s, TPOT {1000 * r['tpot_s']:.3f} ms")
except Exception as e:
    print(f"[{sys.argv[2]}] rc={sys.argv[3]} no result ({e})")
PY
    done
  done
done
