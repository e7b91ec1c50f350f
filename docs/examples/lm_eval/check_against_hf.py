"""python check_against_hf.py OUTPUT_PATH MODEL_DIR: every loglikelihood lm-eval logged for
pystdlib_next_line (``--log_samples``) against Hugging Face transformers on the same tokens.

lm-eval scores a choice as its context's tokens followed by the rest of the whole text's
tokens (the two do not always split where the text does), so that is what is recomputed here.
"""

import glob
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

out_dir, model_dir = sys.argv[1], sys.argv[2]
path = glob.glob(f"{out_dir}/**/samples_pystdlib_next_line_*.jsonl", recursive=True)[0]
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
worst, n, greedy_agrees = 0.0, 0, 0
for line in open(path):
    sample = json.loads(line)
    for arg, resp in zip(sample["arguments"].values(), sample["resps"]):
        context, continuation = arg["arg_0"], arg["arg_1"]
        spaces = len(context) - len(context.rstrip())  # lm-eval moves them to the continuation
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = tok.encode(context, add_special_tokens=False)
        ids = ctx + tok.encode(context + continuation, add_special_tokens=False)[len(ctx):]
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        ref = sum(lp[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
        greedy = all(lp[i - 1].argmax().item() == ids[i] for i in range(len(ctx), len(ids)))
        got, got_greedy = float(resp[0][0]), resp[0][1] == "True"
        worst, n = max(worst, abs(got - ref)), n + 1
        greedy_agrees += greedy == got_greedy
print(f"{n} pairs, max |lm-eval loglikelihood - HF| = {worst:.2e}, is_greedy agrees {greedy_agrees}/{n}")
