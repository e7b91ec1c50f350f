#!/bin/bash
# pagelm serve with the model runner in the engine core ("inproc", the default) and in a
# process of its own ("apart": --distributed-executor-backend mp), alternated; the client is
# vLLM's `vllm bench serve`, as in session 9's /tmp/h9/ab.sh (workloads a, b, c).
# ORDER: server variants in run order; "apart2": the same with OMP_NUM_THREADS=2 (every
# process two torch threads instead of share_cpu's one); "apartpin": the runner's process
# pinned to core 0 and the API process and engine core to core 1 (taskset, once it is up),
# as vLLM-CPU places its worker.
# Each server start logs the load average; each server's processes' CPU seconds are logged
# before it is stopped (utime+stime from /proc/PID/stat, engine core and runner separately).
# WL: the workloads to run (default abc).
set -u
M=${M:-/tmp/h9/demo_shaped}
R=${R:-/tmp/ha_results}; mkdir -p $R
PAGELM=${PAGELM:-/work/venv-ha/bin/pagelm}
export VLLM_TARGET_DEVICE=cpu
bench() { # name conc in out n
  /tmp/vllmcpu/bin/vllm bench serve --backend openai --base-url http://127.0.0.1:$PORT --model $M \
    --dataset-name random --random-input-len $3 --random-output-len $4 --num-prompts $5 \
    --max-concurrency $2 --ignore-eos --num-warmups 2 --seed 0 --percentile-metrics ttft,tpot,itl \
    --save-result --result-dir $R --result-filename $1.json > $R/$1.log 2>&1
}
cpu_s() { # pid -> CPU seconds so far
  awk -v hz=$(getconf CLK_TCK) '{printf "%.1f", ($14+$15)/hz}' /proc/$1/stat 2>/dev/null
}
round=${ROUND0:-0}
for srv in ${ORDER:-inproc apart apart inproc}; do
  round=$((round+1)); PORT=$((8600+round)); tag=r${round}_$srv
  echo "$(date +%T) start $tag load $(cut -d' ' -f1-3 /proc/loadavg)"
  extra=""; envs=""
  case $srv in
    apart|apartpin) extra="--distributed-executor-backend mp" ;;
    apart2) extra="--distributed-executor-backend mp"; envs="OMP_NUM_THREADS=2" ;;
    inproc2) envs="OMP_NUM_THREADS=2" ;;
  esac
  env $envs $PAGELM serve $M --port $PORT --attention-backend torch --max-model-len 1024 --max-num-seqs 16 \
    --no-access-log $extra > $R/$tag.server.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do sleep 2; curl -s localhost:$PORT/v1/models >/dev/null && break; done
  echo "$(date +%T) up $tag"
  if [ $srv = apartpin ]; then
    c=$(pgrep -P $SP -f core_proc); r=$(pgrep -P $c -f spawn_main)
    taskset -pc 0 $r >/dev/null; taskset -apc 1 $c >/dev/null; taskset -apc 1 $SP >/dev/null
  fi
  [[ ${WL:-abc} == *a* ]] && bench ${tag}_a 1 64 128 64
  [[ ${WL:-abc} == *b* ]] && bench ${tag}_b 16 64 128 256
  [[ ${WL:-abc} == *c* ]] && bench ${tag}_c 16 768 32 128
  core=$(pgrep -P $SP -f core_proc); runner=$(pgrep -P "${core:-0}" -f spawn_main)
  echo "$(date +%T) done $tag load $(cut -d' ' -f1-3 /proc/loadavg) cpu_s api=$(cpu_s $SP) core=$(cpu_s ${core:-0}) runner=$(cpu_s ${runner:-0})"
  kill $SP; wait $SP 2>/dev/null; sleep 3
  pgrep -f "venv-ha.*(core_proc|spawn_main)" >/dev/null && { echo "leftover:"; pgrep -af "venv-ha.*(core_proc|spawn_main)"; }
done
echo ALLDONE
