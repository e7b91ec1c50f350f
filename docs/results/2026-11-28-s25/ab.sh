#!/bin/bash
# Session 25: session 21's ab.sh with the model at /tmp/s25/demo_shaped and one more variant:
# `pagelmold` = this tree with the sampler's CPU path put back to the exponential race
# (site/sitecustomize.py on PYTHONPATH, S25_OLD_SAMPLER=1), i.e. the code before 8742d55.
# Set 1: ORDER="pagelm vllm pagelmold pagelmold vllm pagelm pagelm vllm pagelmold pagelmold vllm pagelm" GREEDY=1
# Set 2: R=.../ab2 ORDER="vllm pagelm pagelm vllm vllm pagelm pagelm vllm" WL=b
# Alternate servers; same client (vllm bench serve) for all. ORDER: pagelm1 pagelm2 vllm ...
set -u
M=/tmp/s25/demo_shaped
R=${R:-/tmp/s25/ab}; mkdir -p $R
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_TARGET_DEVICE=cpu
bench() { # name conc in out n
  /tmp/vllmcpu/bin/vllm bench serve --backend openai --base-url http://127.0.0.1:$PORT --model $M \
    --dataset-name random --random-input-len $3 --random-output-len $4 --num-prompts $5 \
    --max-concurrency $2 --ignore-eos --num-warmups 2 --seed 0 --percentile-metrics ttft,tpot,itl \
    --save-result --result-dir $R --result-filename $1.json > $R/$1.log 2>&1
}
round=${ROUND0:-0}
for srv in ${ORDER}; do
  round=$((round+1)); PORT=$((8740+round)); tag=r${round}_$srv
  echo "$(date +%T) start $tag load $(cut -d' ' -f1-3 /proc/loadavg)"
  case $srv in
    pagelmold) PYTHONPATH=/tmp/s25/site S25_OLD_SAMPLER=1 pagelm serve $M --port $PORT --attention-backend torch --max-model-len 1024 --max-num-seqs 16 --no-access-log > $R/$tag.server.log 2>&1 & ;;
    pagelm*) env ${PAGELM_ENV:-} $( [ $srv = pagelm2 ] && echo OMP_NUM_THREADS=2 ) pagelm serve $M --port $PORT --attention-backend torch --max-model-len 1024 --max-num-seqs 16 --no-access-log > $R/$tag.server.log 2>&1 & ;;
    vllm) /tmp/vllmcpu/bin/vllm serve $M --port $PORT --dtype float32 --max-model-len 1024 --max-num-seqs 16 --disable-uvicorn-access-log > $R/$tag.server.log 2>&1 & ;;
  esac
  SP=$!
  for i in $(seq 1 120); do sleep 2; curl -s localhost:$PORT/v1/models >/dev/null && break; done
  echo "$(date +%T) up $tag"
  if [ $srv = pagelmpin ]; then taskset -pc 0 $(pgrep -f pagelm.engine.core_proc) > /dev/null; taskset -apc 1 $(pgrep -f "pagelm serve") > /dev/null; fi
  [ -n "${GREEDY:-}" ] && python3 /tmp/s25/greedy.py $PORT $R/greedy_$tag.json > $R/greedy_$tag.log 2>&1
  for w in ${WL:-a b c}; do
    case $w in a) bench ${tag}_a 1 64 128 64;; b) bench ${tag}_b 16 64 128 256;; c) bench ${tag}_c 16 768 32 128;; esac
  done
  echo "$(date +%T) done $tag load $(cut -d' ' -f1-3 /proc/loadavg)"
  kill $SP; wait $SP 2>/dev/null; sleep 3
  pgrep -f "EngineCore|pagelm serve|vllm serve" >/dev/null && { echo "leftover:"; pgrep -af "EngineCore|pagelm serve|vllm serve"; }
done
echo ALLDONE
