#!/bin/bash
# Session 13, call D (one GPU): issue 19's Qwen2-VL-2B figures, issue 20's CPU-tier figures,
# and the GPU tests of both (M-RoPE decode graphs; swap/spill on CUDA without host syncs).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/log
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_qwen2_vl.py tests/test_kv_offload.py 2>&1 | tail -8 | tee -a $OUT/log
timeout 200 pagelm bench multimodal --model qwen2-vl-2b --dtype bfloat16 --input-len 64 --output-len 128 \
    --batch-size 8 --image-size 640x480 --num-images 64 --encoder-batch 16 --iters 5 \
    --max-model-len 4096 --json $OUT/mm-qwen2-vl.json > $OUT/mm.log 2>&1; echo "mm rc $?" | tee -a $OUT/log; tail -25 $OUT/mm.log | tee -a $OUT/log
timeout 200 pagelm bench offload --model llama-3.1-8b --workload pressure --num-seqs 32 --input-len 2048 \
    --output-len 512 --max-model-len 4096 --json $OUT/pressure.json > $OUT/pressure.log 2>&1; echo "pressure rc $?" | tee -a $OUT/log; tail -20 $OUT/pressure.log | tee -a $OUT/log
