#!/bin/bash
# One GPU, for the next session (issue 21): the opt-in fusions' GPU tests (q/k norm + rotary +
# K/V store in one kernel; split-K attention merging in its own kernel), then batch-1 latency
# without them, with the first, with both (interleaved); then Qwen2-VL-2B with equal-context
# decode batches (issue 19).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_rotary_kv_store.py tests/test_triton_gpu.py tests/test_fused_ops.py 2>&1 | tail -4 | tee -a $OUT/log
lat() { ( cd /tmp && timeout 100 env $2 pagelm bench latency --model $1 --batch-sizes 1 --input-len 128 --output-len 512 --iters 3 \
    --max-model-len 4096 --json $OUT/lat-$1-$3.json 2>&1 ) | grep -v "^WARNING\|it/s\]" | tail -2 | sed "s/^/[$3] /" | tee -a $OUT/log; }
R=PAGELM_ROTARY_KV_FUSION=1; B="PAGELM_ROTARY_KV_FUSION=1 PAGELM_SPLIT_REDUCE_FUSION=1"
lat qwen3-0.6b X=0 plain
lat qwen3-0.6b $R rotary
lat qwen3-0.6b "$B" both
lat qwen3-0.6b X=0 plain2
lat qwen3-0.6b $R rotary2
lat qwen3-0.6b "$B" both2
lat llama-3.1-8b X=0 plain
lat llama-3.1-8b "$B" both
timeout 120 pagelm bench multimodal --model qwen2-vl-2b --dtype bfloat16 --input-len 64 --output-len 128 \
    --batch-size 8 --image-size 640x480 --num-images 64 --encoder-batch 16 --iters 5 \
    --max-model-len 4096 --json $OUT/mm-qwen2-vl.json > $OUT/mm.log 2>&1; echo "mm rc $?" | tee -a $OUT/log; grep -v "^\s*\^" $OUT/mm.log | tail -5 | tee -a $OUT/log
