#!/bin/bash
# One GPU (issue 21, session 27): is the demo model's run-to-run spread on the GPU machine the
# host's? Plain batch-1 runs alternated unpinned / pinned to one core (taskset), then EAGLE with
# the trained head and with every draft rejected, pinned. eagle-demo/ and demo-cache/ carried.
export PYTHONUNBUFFERED=1 PAGELM_CACHE_DIR=$PWD/demo-cache
root=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/log
echo "nproc $(nproc); $(grep -m1 'model name' /proc/cpuinfo); loadavg $(cat /proc/loadavg)" | tee -a $OUT/log
steal() { awk '/^cpu /{print "cpu: user "$2" sys "$4" idle "$5" steal "$9}' /proc/stat; }
steal | tee -a $OUT/log
python3 -m pip install -q --no-deps --no-build-isolation -e $root > /tmp/pip.log 2>&1 || { tail -3 /tmp/pip.log; exit 1; }
summ() { python3 - "$1" <<'PY'
import json,sys
for r in json.load(open(sys.argv[1]))["results"]:
    if r.get("spec_off"):
        s, p = r["decode_tokens_per_s"], r["spec_off"]["decode_tokens_per_s"]
        print(f"  batch {r['batch_size']}: plain {p:.0f} eagle {s:.0f} = {s/p:.2f}x, acc len {r['spec']['mean_acceptance_length']:.2f}")
    else:
        print(f"  batch {r['batch_size']}: plain {r['decode_tokens_per_s']:.0f} tok/s, tpot {1000*r['tpot_s']:.3f} ms")
PY
}
i=0
for pin in no yes no yes no yes; do
  i=$((i+1)); name=$i-plain-pin$pin; pre=(); [ $pin = yes ] && pre=(taskset -c 3)
  ( cd /tmp && timeout 100 "${pre[@]}" pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
      --batch-sizes 1 --iters 5 --json $OUT/$name.json > /tmp/$name.log 2>&1 )
  echo "[$name] rc=$? $(date +%T)" | tee -a $OUT/log; summ $OUT/$name.json | tee -a $OUT/log
done
steal | tee -a $OUT/log
EAGLE="{\"method\": \"eagle\", \"num_speculative_tokens\": 3, \"model\": \"$root/eagle-demo\"}"
for kind in trained reject trained reject; do
  i=$((i+1)); name=$i-eagle-$kind; extra=(); [ $kind = reject ] && extra=(--spec-reject-all)
  ( cd /tmp && timeout 150 taskset -c 3 pagelm bench latency --model demo --workload code --input-len 128 --output-len 256 \
      --batch-sizes 1,32 --iters 3 --speculative-config "$EAGLE" --compare spec-off "${extra[@]}" --json $OUT/$name.json > /tmp/$name.log 2>&1 )
  echo "[$name] rc=$? $(date +%T)" | tee -a $OUT/log; summ $OUT/$name.json | tee -a $OUT/log
done
steal | tee -a $OUT/log
