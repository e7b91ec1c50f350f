#!/bin/bash
# Issue 18, session 12, call C: where a TP=2 engine's shutdown hangs (both ranks' Python stacks,
# dumped by faulthandler on SIGABRT), and whether the symmetric-memory all-reduce is taken.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
R=docs/results/2026-11-26-x2
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
timeout 150 python3 $R/parity.py small > $OUT/parity.log 2>&1 &
sleep 80
ps aux | grep -E "spawn|parity" | grep -v grep | cut -c1-200 | tee $OUT/ps
pkill -6 -f "multiprocessing.spawn"; sleep 3; pkill -6 -f "parity.py engine"; sleep 5
grep -vE "Warning|warn\(" $OUT/parity.log | tail -80
timeout 100 pagelm bench latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 64 --iters 1 \
    --max-model-len 4096 --tensor-parallel-size 2 > $OUT/lat.log 2>&1
grep -iE "symm|all-reduce|batch    1|error" $OUT/lat.log | head; python3 -c "
import torch, torch.distributed._symmetric_memory as s; print('one_shot_all_reduce_copy' in dir(torch.ops.symm_mem) or 'resolved lazily')"
