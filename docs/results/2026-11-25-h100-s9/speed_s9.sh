#!/bin/bash
# Issue 16's speed check: the commit before the redesign (baseline/, 0b9bade) and HEAD (.),
# interleaved per benchmark so both see the same machine state.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
use() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) && echo "== using $1 ($(cd $1 && ls pyproject.toml))" | tee -a $OUT/log; }
bench() {  # tag args...
  local tag=$1; shift
  for tree in baseline .; do
    use "$ROOT/$tree"
    name=$( [ "$tree" = . ] && echo head || echo base )
    ( cd /tmp && timeout 300 pagelm bench "$@" --json $OUT/$tag-$name.json ) 2>&1 | grep -v "^WARNING\|it/s\]" | tail -6 | tee -a $OUT/log
  done
}
bench lat-qwen latency --model qwen3-0.6b --batch-sizes 1 --input-len 128 --output-len 512 --iters 3 --max-model-len 4096
bench tp-fi throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 --attention-backend flashinfer
bench lat-8b latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 512 --iters 2 --max-model-len 4096
