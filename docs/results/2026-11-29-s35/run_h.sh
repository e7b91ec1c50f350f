#!/bin/bash
# One GPU (issue 21, session 35, branch wip/gemv-whole-k, its rule before the default). run_g.sh found 16 KB whole-K chunks
# +2% on llama-3.2-1b (qkv, o: K=2048) and -9% on qwen3-0.6b (o: K=2048, down: K=3072 padded
# to 4096). Which of the 0.6B's two does it: 8 KB (o only), and 16 KB with only unpadded K.
export PYTHONUNBUFFERED=1
source <(sed -n '/^bench()/,/^}/p' "$(dirname "$0")/run_g.sh")
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log
for round in 1 2; do
  bench new qwen3-0.6b q-off-r$round PAGELM_GEMV_WHOLE_K_BYTES=0
  bench new qwen3-0.6b q-8k-r$round PAGELM_GEMV_WHOLE_K_BYTES=8192
  bench new qwen3-0.6b q-16k-unpadded-r$round PAGELM_GEMV_WHOLE_K_BYTES=16384 PAGELM_GEMV_WHOLE_K_UNPADDED=1
  bench new llama-3.2-1b l-off-r$round PAGELM_GEMV_WHOLE_K_BYTES=0
  bench new llama-3.2-1b l-16k-unpadded-r$round PAGELM_GEMV_WHOLE_K_BYTES=16384 PAGELM_GEMV_WHOLE_K_UNPADDED=1
done
