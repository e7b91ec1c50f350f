#!/bin/bash
# One GPU (session 32, the 2.25 kernels): GPU tests of the graph and spec files, then
# fused_ab.py at batch 1 and 32 (24 rounds), then timeline_gpu.py at batch 1.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
D=docs/results/2026-11-28-s32
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_spec_graphs.py tests/test_gpu_fast_path.py tests/test_graph_inputs_kernel.py tests/test_draft_inputs_kernel.py 2>&1 | tail -4 | tee $OUT/tests.log
for bs in 1 32; do
  BS=$bs ROUNDS=${ROUNDS:-24} timeout 200 python3 $D/fused_ab.py 2>&1 | grep -v -E 'Warning|warn' | tail -6 | tee $OUT/fused-bs$bs.txt
done
BS=1 timeout 100 python3 $D/timeline_gpu.py 2>&1 | grep -v Warning | tee $OUT/timeline-bs1.txt
