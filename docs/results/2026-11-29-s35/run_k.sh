#!/bin/bash
# One GPU (issue 21; for a later session, on main): the three batch-1 models kernel by kernel,
# to choose the next fusion from where a step goes today. kernel_profile.py (this folder) also
# splits the timeline into steps at host gaps (median span per step); `pagelm bench latency
# --profile-kernels` (the second loop) divides by the run's steps.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
for m in qwen3-0.6b llama-3.2-1b llama-3.1-8b; do
  MODEL=$m timeout 150 python3 "$(dirname "$0")/kernel_profile.py" > $OUT/profile-$m.txt 2>&1
  head -40 $OUT/profile-$m.txt; tail -1 $OUT/profile-$m.txt
done
for m in qwen3-0.6b llama-3.2-1b llama-3.1-8b; do
  ( cd /tmp && timeout 150 pagelm bench latency --model $m --batch-sizes 1 --input-len 128 --output-len 512 \
      --iters 2 --max-model-len 4096 --profile-kernels 25 --json $OUT/bench-profile-$m.json ) 2>&1 | grep -v USDT | tail -32
done
