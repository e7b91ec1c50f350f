#!/bin/bash
# Two GPUs (issue 18, session 22): nano-vllm workload throughput at TP=2, this tree then
# baseline/ (585c7db), one run each on the same machine. Logs and JSON under $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
inst() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" > /tmp/pip.log 2>&1 || { echo "install $1 failed"; exit 1; }; }
for what in "$@"; do
  case $what in base) inst baseline;; new) inst .;; esac
  ( cd /tmp && timeout 200 pagelm bench throughput --model llama-3.1-8b --workload nano-vllm --max-model-len 4096 \
      --tensor-parallel-size 2 --json $OUT/tput-tp2-$what.json 2>&1 ) > $OUT/tput-tp2-$what.log
  echo "[$what] rc=$? $(date +%T)" | tee -a $OUT/log
  grep -vi "warn\|it/s\]" $OUT/tput-tp2-$what.log | tail -2 | sed "s/^/[$what] /" | tee -a $OUT/log
done
