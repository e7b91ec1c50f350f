#!/bin/bash
# Issue 16's speed check (session 14): base 0b9bade (baseline/, carried) vs HEAD, interleaved; arg lat|tp.
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
#bench lat-qwen latency --model qwen3-0.6b --batch-sizes 1 --input-len 128 --output-len 512 --iters 3 --max-model-len 4096
#bench tp-fi throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 --attention-backend flashinfer
#bench lat-8b latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 512 --iters 2 --max-model-len 4096
case "${1:-lat}" in
lat)
  bench lat-qwen latency --model qwen3-0.6b --batch-sizes 1 --input-len 128 --output-len 512 --iters 3 --max-model-len 4096
  bench lat-8b latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 512 --iters 2 --max-model-len 4096 ;;
tp)
  bench tp-tr throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 --attention-backend triton
  bench tp-fi throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 --attention-backend flashinfer
  bench tp-tr2 throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 --attention-backend triton ;;
esac
# second round, the head first
if [ "${1:-}" = tp2 ]; then
  bench2() { local tag=$1; shift; for tree in . baseline; do use "$ROOT/$tree"; name=$( [ "$tree" = . ] && echo head || echo base )
    ( cd /tmp && timeout 300 pagelm bench "$@" --json $OUT/$tag-$name.json ) 2>&1 | grep -v "^WARNING\|it/s\]" | tail -1 | tee -a $OUT/log; done; }
  for i in 1 2; do
    bench2 tr$i throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 --attention-backend triton
    bench2 fi$i throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 --attention-backend flashinfer
  done
fi
# third round: triton only, alternating which tree goes first
if [ "${1:-}" = tr3 ]; then
  one() { use "$ROOT/$1"; ( cd /tmp && timeout 200 pagelm bench throughput --model qwen3-0.6b --workload nano-vllm --max-model-len 4096 --attention-backend triton --json $OUT/tr3-$2.json ) 2>&1 | grep -v "^WARNING\|it/s\]" | tail -1 | sed "s/^/[$2] /" | tee -a $OUT/log; }
  one baseline base1; one . head1; one . head2; one baseline base2; one baseline base3; one . head3
fi
