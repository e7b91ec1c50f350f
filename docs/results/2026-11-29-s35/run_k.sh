#!/bin/bash
# One GPU (issue 21; for a later session, on main): kernel_profile.py for the three batch-1
# models, to choose the next fusion from where a step goes today.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
for m in qwen3-0.6b llama-3.2-1b llama-3.1-8b; do
  MODEL=$m timeout 150 python3 "$(dirname "$0")/kernel_profile.py" > $OUT/profile-$m.txt 2>&1
  head -40 $OUT/profile-$m.txt; tail -1 $OUT/profile-$m.txt
done
