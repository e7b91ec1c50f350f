import os, sys, torch, numpy as np
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import TokenWorkload
M = "/work/main/demo-cache/demo-llama-v1"
spec = {"method": "eagle", "num_speculative_tokens": 3, "model": "/work/main/eagle-demo", "adaptive": False}
llm = LLM(M, max_model_len=1024, speculative_config=spec)
ps = [TokenWorkload.code(llm.get_tokenizer(), 1, 128, 256, f"0/1/{run}").prompt_token_ids[0] for run in range(6)]
sp = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
prop = llm.engine.core.runner.spec.proposer
seqs = []
orig = prop.propose_step
def ps_(step):
    if step.num_drafts.any(): seqs.append(int(step.num_sampled[0]) - 1)
    return orig(step)
prop.propose_step = ps_
for p in ps:
    seqs.append(None); llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
s = "".join("|" if a is None else str(a) for a in seqs)
print(s)
a = np.array([x for x in seqs if x is not None]); print("mean acc %.2f, P(0) %.2f" % (a.mean(), (a == 0).mean()))
# after a zero, P(next zero); after two zeros
z = [(seqs[i], seqs[i+1], seqs[i+2]) for i in range(len(seqs)-2) if None not in seqs[i:i+3]]
for cond in [(0,), (0, 0)]:
    nxt = [t[len(cond)] for t in z if t[:len(cond)] == cond]
    print(cond, "next mean acc %.2f n=%d" % (np.mean(nxt), len(nxt)))
