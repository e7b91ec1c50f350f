#!/bin/bash
# One H100 (issue 21, session 23): batch-1 decode with each GEMV prefetching the next
# projection's weight into L2 (PAGELM_L2_PREFETCH_MB caps the bytes per projection; 0 is off,
# the code path before it; "default" leaves it unset). The GPU tests first ($TESTS: more test
# files), then `pagelm bench latency` at batch 1, the settings interleaved on one machine. Args: "MODEL:MB1,MB2,...:ROUNDS" ...
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || exit 1
if [ -z "$SKIP_TESTS" ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_ops.py ${TESTS} > $OUT/tests.log 2>&1
  echo "[tests] rc=$? $(tail -1 $OUT/tests.log)"
fi
for spec in "$@"; do
  IFS=: read model mbs rounds <<< "$spec"
  for r in $(seq 1 ${rounds:-1}); do
    for mb in ${mbs//,/ }; do
      name=$model-mb$mb-r$r
      setting=PAGELM_L2_PREFETCH_MB=$mb; [ $mb = default ] && setting=PAGELM_UNUSED=1
      ( cd /tmp && env $setting timeout 200 pagelm bench latency --model $model --batch-sizes 1 --input-len 128 \
          --output-len 512 --iters 3 --max-model-len 4096 --json $OUT/$name.json 2>&1 ) > $OUT/$name.log
      rc=$?
      [ $rc = 0 ] && rm -f $OUT/$name.log  # the JSON has it all (the device returns few files)
      python3 - $OUT/$name.json $name $rc <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
    print(f"[{sys.argv[2]}] {r['decode_tokens_per_s']:.1f} tok/s, TPOT {1000 * r['tpot_s']:.3f} ms, MBU {r.get('mbu')}")
except Exception as e:
    print(f"[{sys.argv[2]}] rc={sys.argv[3]} no result ({e})")
PY
    done
  done
done
