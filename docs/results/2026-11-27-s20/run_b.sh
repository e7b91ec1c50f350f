#!/bin/bash
# Call 2 (H100): Triton compiles inside the nano-vllm timed run? (jit_during_run.py), triton
# then flashinfer, each engine twice in one process.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-27-s20
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
for b in triton flashinfer; do
  timeout 280 python3 $D/jit_during_run.py $b 2>&1 | grep "^\[" | tee -a $OUT/log
done
