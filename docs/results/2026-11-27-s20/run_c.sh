#!/bin/bash
# Call 3 (H100): the no-builds-inside-a-step test on baseline/ (HEAD before the change: expected
# to fail) and on this tree, the Triton GPU tests on this tree, then the kernel builds
# during a nano-vllm run on this tree (jit_during_run.py, triton).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
inst() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" > /tmp/pip.log 2>&1 || { echo "install $1 failed"; tail -5 /tmp/pip.log; exit 1; }; }
D=docs/results/2026-11-27-s20
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
inst baseline
echo "== baseline: test_triton_builds_at_startup" | tee -a $OUT/log
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_builds_at_startup.py 2>&1 | tail -15 | tee -a $OUT/log
inst .
echo "== this tree: GPU tests" | tee -a $OUT/log
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_builds_at_startup.py tests/test_triton_gpu.py 2>&1 | tail -15 | tee -a $OUT/log
timeout 150 python3 $D/jit_during_run.py triton 2>&1 | grep "^\[" | cut -c1-400 | tee -a $OUT/log
