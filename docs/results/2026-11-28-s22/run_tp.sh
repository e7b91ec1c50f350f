#!/bin/bash
# Two GPUs (issue 18, session 22): batch-1 decode at TP=2 with the other rank keeping a step
# run ahead in flight (ae833ff), against the tree before it (baseline/ = 585c7db, carried),
# alternated on one warm machine; then TP=1 once on the same machine.
#   run_tp.sh ORDER...   e.g. `run_tp.sh new base new tp1`; also `rotary` (this tree with
#                        PAGELM_ROTARY_KV_FUSION=1) and `nccl` (this tree, --disable-custom-all-reduce)
# Logs and JSON under $OUT; `log` is the summary.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
inst() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" > /tmp/pip.log 2>&1 || { echo "install $1 failed"; tail -5 /tmp/pip.log; exit 1; }; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
run=0
for what in "$@"; do
  run=$((run+1))
  extra=(); envs=()
  case $what in
    base) inst baseline; tp=2;; new) inst .; tp=2;; tp1) inst .; tp=1;;
    rotary) inst .; tp=2; envs=(PAGELM_ROTARY_KV_FUSION=1);; nccl) inst .; tp=2; extra=(--disable-custom-all-reduce);;
  esac
  name=$run-$what
  ( cd /tmp && env "${envs[@]}" timeout 200 pagelm bench latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 512 \
      --iters 2 --max-model-len 4096 --tensor-parallel-size $tp "${extra[@]}" --json $OUT/$name.json 2>&1 ) > $OUT/$name.log
  echo "[$name] rc=$? $(date +%T)" | tee -a $OUT/log
  grep -v "^WARNING\|it/s\]\|step/s" $OUT/$name.log | tail -3 | sed "s/^/[$name] /" | tee -a $OUT/log
done
