#!/bin/bash
# Call 1 (H100): the attention kernels alone (attn_sweep.py), then where the nano-vllm run
# spends its GPU time with each backend (profile_nano.py). Summary in $OUT/log.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-27-s20
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 240 python3 $D/attn_sweep.py "$@" 2>&1 | grep -v Warning | tee $OUT/sweep.log | tee -a $OUT/log
for b in triton flashinfer; do
  timeout 200 python3 $D/profile_nano.py $b 2>&1 | grep "^\[" | tee -a $OUT/log
done
