#!/bin/bash
# Two GPUs (issue 18), call 1: where PP=2's shutdown waits (py-spy native stacks 3 s into it,
# eager and with graphs), then llama-3.1-8b bf16 parity: TP=2 and PP=2 greedy ids against TP=1,
# first diverging position per prompt. Under 9 minutes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { echo "install failed"; tail -5 /tmp/pip.log; exit 1; }
python3 -m pip install -q --no-index --no-deps .whl/py_spy-*.whl > /tmp/pip2.log 2>&1 || tail -3 /tmp/pip2.log
nvidia-smi -L | tee $OUT/gpus
S=docs/results/2026-11-27-s16
for v in eager graphs; do
  timeout 100 python3 $S/pp_shutdown.py $v > $OUT/log-ppsd-$v 2>&1; echo "ppsd $v rc=$?"
  grep -E "shutdown took|generated|did not return|Error" $OUT/log-ppsd-$v | tail -5
done
timeout 400 python3 docs/results/2026-11-26-x2/parity.py 8b pipeline_parallel_size=2 > $OUT/log-parity8b 2>&1; echo "parity rc=$?"
grep -E "prompts identical|checkpoint ready|built in|shut down at|did not exit|Error" $OUT/log-parity8b | tail -16
