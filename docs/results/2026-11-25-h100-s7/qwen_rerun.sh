#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=$PWD
use() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
for round in 1 2; do
  for tree in baseline .; do
    use "$ROOT/$tree"
    echo "== $tree round $round"
    ( cd /tmp && timeout 200 pagelm bench latency --model qwen3-0.6b --batch-sizes 1 --input-len 128 --output-len 512 --iters 5 --max-model-len 4096 ) 2>&1 | grep "batch    1"
  done
done
