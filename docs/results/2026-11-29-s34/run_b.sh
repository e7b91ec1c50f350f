#!/bin/bash
# One GPU (issue 21, session 34, call 2): the GPU tests run_a.sh's 240 s pytest timeout cut
# off after test_triton_gpu.py and test_rotary_kv_store.py (24 passed): the new PDL on/off
# test, the drafting graphs' token checks and the fast-path checks.
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pdl_metadata.py tests/test_spec_graphs.py \
    tests/test_gpu_fast_path.py 2>&1 | tail -15 | tee $OUT/log
