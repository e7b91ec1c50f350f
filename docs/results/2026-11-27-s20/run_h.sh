#!/bin/bash
# Call 8 (H100/H200): issue 20's pressure workload (swap vs recompute) on this tree, then on
# baseline/ (= 4a15336, before the kernels were built at start-up). The bench runs recompute
# first, swap second in one process: before, the recompute run met the mixed steps' Triton
# variants first and built them inside its timed run.
export PYTHONUNBUFFERED=1
inst() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" > /tmp/pip.log 2>&1 || { echo "install $1 failed"; tail -5 /tmp/pip.log; exit 1; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
run() {
  ( cd /tmp && timeout 270 pagelm bench offload --model llama-3.1-8b --workload pressure --num-seqs 256 --input-len 512 \
      --output-len 512 --max-model-len 2048 --json $OUT/$1.json 2>&1 ) > $OUT/$1.log
  echo "[$1] rc=$?" | tee -a $OUT/log; grep -v "it/s\]" $OUT/$1.log | tail -6 | tee -a $OUT/log
}
inst .; run pressure-new
inst baseline; run pressure-base
