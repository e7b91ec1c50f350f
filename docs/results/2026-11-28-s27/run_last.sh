#!/bin/bash
# One GPU (issue 21, session 27), after 6ff2627: steps_gpu.py at batch 32 and batch 1, with
# cumulative profiles (prof-*.txt) of each engine's generate.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
here=$PWD/docs/results/2026-11-28-s27
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
for cfg in "32 3" "1 4"; do
  set -- $cfg
  echo "== steps, batch $1" | tee -a $OUT/log
  BS=$1 OUTLEN=256 ROUNDS=$2 timeout 80 python3 $here/steps_gpu.py 2>&1 | grep -E "^(plain|reject|trained)" | tee -a $OUT/log
done
rm -f $OUT/prof-plain-bs*.txt
