#!/bin/bash
# Alternate pagelm and vLLM-CPU servers; same client (vllm bench serve) for both.
set -u
M=/tmp/h9/demo_shaped
R=${R:-/tmp/s16/ab}; mkdir -p $R
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_TARGET_DEVICE=cpu
bench() { # name conc in out n
  /tmp/vllmcpu/bin/vllm bench serve --backend openai --base-url http://127.0.0.1:$PORT --model $M \
    --dataset-name random --random-input-len $3 --random-output-len $4 --num-prompts $5 \
    --max-concurrency $2 --ignore-eos --num-warmups 2 --seed 0 --percentile-metrics ttft,tpot,itl \
    --save-result --result-dir $R --result-filename $1.json > $R/$1.log 2>&1
}
round=${ROUND0:-0}
for srv in ${ORDER:-pagelm vllm pagelm vllm}; do
  round=$((round+1)); PORT=$((8400+round)); tag=r${round}_$srv
  echo "$(date +%T) start $tag load $(cut -d' ' -f1-3 /proc/loadavg)"
  if [ $srv = pagelm ]; then
    pagelm serve $M --port $PORT --attention-backend torch --max-model-len 1024 --max-num-seqs 16 --no-access-log > $R/$tag.server.log 2>&1 &
  else
    /tmp/vllmcpu/bin/vllm serve $M --port $PORT --dtype float32 --max-model-len 1024 --max-num-seqs 16 --disable-uvicorn-access-log > $R/$tag.server.log 2>&1 &
  fi
  SP=$!
  for i in $(seq 1 120); do sleep 2; curl -s localhost:$PORT/v1/models >/dev/null && break; done
  echo "$(date +%T) up $tag"
  [ $round -le 2 ] && /tmp/vllmcpu/bin/python /tmp/h9/greedy.py $PORT $R/greedy_$srv.json > /dev/null 2>&1
  bench ${tag}_a 1 64 128 64
  bench ${tag}_b 16 64 128 256
  bench ${tag}_c 16 768 32 128
  echo "$(date +%T) done $tag load $(cut -d' ' -f1-3 /proc/loadavg)"
  kill $SP; wait $SP 2>/dev/null; sleep 3
  pgrep -f "EngineCore|pagelm serve|vllm serve" >/dev/null && { echo "leftover:"; pgrep -af "EngineCore|pagelm serve|vllm serve"; }
done
echo ALLDONE
