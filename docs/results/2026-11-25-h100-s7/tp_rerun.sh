#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=$PWD
use() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
for round in 1 2; do
  for be in triton flashinfer; do
    for tree in baseline .; do
      use "$ROOT/$tree"
      echo "== $tree $be round $round"
      ( cd /tmp && timeout 120 pagelm bench throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 --attention-backend $be ) 2>&1 | grep "pagelm:"
    done
  done
done
