#!/bin/bash
# Two GPUs (issue 18, session 24): batch-1 decode at TP=2 with the row-parallel all-reduce
# inside the GEMV (`gemv(all_reduce=...)`) against the all-reduce as a kernel of its own
# (PAGELM_FUSED_ALL_REDUCE=0), alternated on one warm machine; TP=1 on the same machine.
#   run_far.sh [TESTS=...] ORDER...   e.g. `run_far.sh fused kernel fused kernel tp1`
#   (`nccl`: the all-reduce by NCCL, --disable-custom-all-reduce; `bnN`: fused with BLOCK_N=N, through
#   PAGELM_GEMV_ALL_REDUCE_BLOCK_N, an experiment knob of call 2 that was taken out again)
#   (`flags`: fused, the exchange by per-tile flags, not the 64-bit words of call 5's default;
#   PAGELM_EXCHANGE_PROTOCOL existed only at 06daa05, the tree of call 5)
#   A `tests` entry in ORDER runs $TESTS there (else they run first).
# TESTS: pytest node ids run first (GPU tests). Logs and JSON under $OUT; `log` is the summary.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
run_tests() {
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider -m gpu -s $TESTS > $OUT/gpu_tests.log 2>&1
  echo "[tests] rc=$? $(date +%T)" | tee -a $OUT/log; tail -4 $OUT/gpu_tests.log | tee -a $OUT/log
}
[ -n "$TESTS" ] && [[ " $* " != *" tests "* ]] && run_tests
run=0
for what in "$@"; do
  [ "$what" = tests ] && { run_tests; continue; }
  run=$((run+1))
  extra=(); envs=(PAGELM_FUSED_ALL_REDUCE=1); tp=2
  case $what in
    fused) ;; kernel) envs=(PAGELM_FUSED_ALL_REDUCE=0);; tp1) tp=1;; nccl) extra=(--disable-custom-all-reduce);;
    flags) envs=(PAGELM_FUSED_ALL_REDUCE=1 PAGELM_EXCHANGE_PROTOCOL=flags);;
    bn*) envs=(PAGELM_FUSED_ALL_REDUCE=1 PAGELM_GEMV_ALL_REDUCE_BLOCK_N=${what#bn});;
  esac
  name=$run-$what
  ( cd /tmp && env "${envs[@]}" timeout ${BENCH_TIMEOUT:-200} pagelm bench latency --model llama-3.1-8b --batch-sizes 1 --input-len 128 --output-len 512 \
      --iters 2 --max-model-len 4096 --tensor-parallel-size $tp "${extra[@]}" --json $OUT/$name.json 2>&1 ) > $OUT/$name.log
  rc=$?
  echo "[$name] rc=$rc $(date +%T)" | tee -a $OUT/log
  grep -v "^WARNING\|it/s\]\|step/s" $OUT/$name.log | tail -2 | sed "s/^/[$name] /" | tee -a $OUT/log
  [ $rc = 0 ] && rm -f $OUT/$name.log
done
