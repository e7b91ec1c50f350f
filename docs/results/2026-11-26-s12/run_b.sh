#!/bin/bash
# Issue 18, session 12, call B (two GPUs): parity with the shutdown fix, then batch-1 decode
# TP=1 / TP=2 (symmetric-memory all-reduce) / TP=2 with NCCL only, then nano-vllm TP=2.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=docs/results/2026-11-26-x2
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
git log -1 --format=%h | tee $OUT/log
timeout 170 python3 $R/parity.py small pipeline_parallel_size=2 2>&1 | grep -E "prompts|TP=|Error|error|Traceback|  \{|File|Thread" | head -60 | tee -a $OUT/log
lat() { timeout 100 pagelm bench latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 512 --iters 2 \
    --max-model-len 4096 --json $OUT/lat-8b-$1.json "${@:2}" 2>&1 | grep -vi warn | tail -2 | tee -a $OUT/log; }
lat tp2-symm --tensor-parallel-size 2
lat tp2-nccl --tensor-parallel-size 2 --disable-custom-all-reduce
lat tp1 --tensor-parallel-size 1
timeout 100 pagelm bench throughput --model llama-3.1-8b --workload nano-vllm --max-model-len 4096 \
    --tensor-parallel-size 2 --json $OUT/tput-8b-tp2.json 2>&1 | grep -vi warn | tail -2 | tee -a $OUT/log
