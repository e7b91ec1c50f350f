#!/bin/bash
# Two GPUs (issue 18): PP=2 throughput on the nano-vllm workload with each stage's forward
# passes timed (PAGELM_PP_PROFILE=1: CUDA events around every stage's part of a step, busy
# fraction logged per stage at shutdown), then the same run untimed for the tok/s figure, and
# whether shutdown still hits NCCL's 10 s teardown timeout. Under 4 minutes.
# Look for: "pagelm pp profile: stage N: ... busy X of Y = Z%": both stages should be busy
# most of the time (~80%+) with the last stage sampling the oldest micro-batch before running
# the next one; "output tok/s" vs TP=1's 9,543 (2 x H200, s14) / 0.59x before; the shutdown
# seconds and no "destroy_process_group did not return" line.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
nvidia-smi -L | tee $OUT/gpus
run() {  # name, timeout, env..., then the bench's flags
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s%N)
  env "$@" timeout $limit pagelm bench throughput --model llama-3.1-8b --workload nano-vllm --max-model-len 4096 \
    --pipeline-parallel-size 2 > $OUT/log-$name 2>&1
  local rc=$? t1=$(date +%s%N)
  echo "== $name: rc=$rc, whole process $(( (t1 - t0) / 1000000 )) ms"
  grep -E "tok/s|pp profile|destroy_process_group|Error|error" $OUT/log-$name | tail -8
}
run pp2-profiled 110 PAGELM_PP_PROFILE=1
run pp2-plain 100 PAGELM_PP_PROFILE=0
