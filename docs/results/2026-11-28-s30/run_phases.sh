#!/bin/bash
# One GPU (issue 21, session 30): this tree's phases_gpu.py with step timers (WRAP=1,
# REJECT=1, COLD=1) at the batch sizes in BS_LIST (default 32): per engine, the host time of
# each kind of step and its phases. Usage: run_phases.sh ROUNDS
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
here=$PWD/docs/results/2026-11-28-s30
(python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1) || { tail -3 /tmp/pip.log; exit 1; }
for bs in ${BS_LIST-32}; do
  REJECT=1 COLD=1 WRAP=1 BS=$bs OUTLEN=256 ROUNDS=$1 OUT=$OUT timeout 250 python3 $here/phases_gpu.py 2>&1 | grep -v USDT > $OUT/phases-bs$bs.txt
done
cat $OUT/phases-bs*.txt | grep -v "^ *[A-Z][a-zA-Z]*\.\|ops-" | head -150
