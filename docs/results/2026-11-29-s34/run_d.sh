#!/bin/bash
# One GPU (issue 21, session 34, calls 4 and 5): the new EAGLE PDL on/off test (then sizing
# its pool from free memory, gpu_memory_utilization=0.3) on main's kernels (baseline/), to
# tell whether call 3's failure was kv_before_wait.diff's. Call 4 ran the base once; call 5
# (this script) base twice and the new tree once, printing the error lines.
cp tests/test_pdl_metadata.py baseline/tests/ && cd baseline
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
for i in 1 2; do
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pdl_metadata.py -k eagle 2>&1 | tail -1 | sed "s/^/[base $i] /" | tee -a $OUT/log
done
cd .. && python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pdl_metadata.py -k eagle 2>&1 | grep -E "^E " | head -12 | sed "s/^/[new] /" | tee -a $OUT/log
