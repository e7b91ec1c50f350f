#!/bin/bash
# Call 5 (H100): (1) the split-K merge's bit-identity GPU tests and the no-builds test on this
# tree (and the former on baseline/ = HEAD before this session's change, if they fail here);
# (2) the Triton decode tiles end to end (tile_ab.py): qwen3-0.6b batch 1 and 32 latency
# (128 in / 512 out) and the nano-vllm throughput, per variant.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
inst() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" > /tmp/pip.log 2>&1 || { echo "install $1 failed"; tail -5 /tmp/pip.log; exit 1; }; }
D=$PWD/docs/results/2026-11-27-s20
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
inst .
K="bit_identical or replays_in_a_cuda_graph"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_builds_at_startup.py tests/test_triton_gpu.py -k "$K or built_inside" 2>&1 | tail -4 | tee -a $OUT/log
if grep -q failed $OUT/log; then
  inst baseline
  echo "== baseline" | tee -a $OUT/log
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_gpu.py -k "$K" 2>&1 | tail -4 | tee -a $OUT/log
  inst .
fi
for v in default a b c; do
  ( cd /tmp && timeout 100 python3 $D/tile_ab.py $v bench latency --model qwen3-0.6b --batch-sizes 1,32 --input-len 128 \
      --output-len 512 --iters 3 --max-model-len 4096 --json $OUT/lat-$v.json 2>&1 ) > $OUT/lat-$v.log
  echo "[lat-$v] rc=$?" | tee -a $OUT/log; grep -i "tok/s" $OUT/lat-$v.log | grep -v "it/s\]" | tail -3 | tee -a $OUT/log
  ( cd /tmp && timeout 100 python3 $D/tile_ab.py $v bench throughput --model qwen3-0.6b --workload nano-vllm \
      --max-model-len 4096 2>&1 ) > $OUT/tp-$v.log
  echo "[tp-$v] rc=$? $(grep ' pagelm: ' $OUT/tp-$v.log | tail -1)" | tee -a $OUT/log
done
