"""Per-step times in one process: plain and EAGLE (every draft rejected) engines alternated
step by step is not possible; instead run each engine's generate many times and take the
per-step-index median, then sum the per-index excess of EAGLE over plain."""
import os, sys, time, torch, numpy as np
sys.path.insert(0, "/tmp/s26/site"); import sitecustomize  # noqa
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import reject_all_drafts
M = "/work/main/demo-cache/demo-llama-v1"
spec = {"method": "eagle", "num_speculative_tokens": 3, "model": "/work/main/eagle-demo", "max_backoff_steps": int(os.environ.get("MAXB", "32"))}
bs = int(os.environ.get("BS", "1")); outlen = int(os.environ.get("OUTLEN", "256"))
plain = LLM(M, max_model_len=1024)
eagle = LLM(M, max_model_len=1024, speculative_config=spec)
reject_all_drafts(eagle, eagle.engine.core.runner.vocab_size)
g = torch.Generator().manual_seed(0)
ps = [{"prompt_token_ids": torch.randint(10, 2000, (128,), generator=g).tolist()} for _ in range(bs)]
sp = SamplingParams(max_tokens=outlen, temperature=0, ignore_eos=True)
rec = {}
for name, llm in (("plain", plain), ("eagle", eagle)):
    core = llm.engine.core; orig = core.step; rec[name] = []
    def step(*a, _o=orig, _n=name, **k):
        t = time.perf_counter(); r = _o(*a, **k); rec[_n][-1].append(time.perf_counter() - t); return r
    core.step = step
import gc; gc.collect(); gc.freeze(); gc.disable()
for r in range(int(os.environ.get("ROUNDS", "10"))):
    for name, llm in (("plain", plain), ("eagle", eagle)) if r % 2 == 0 else (("eagle", eagle), ("plain", plain)):
        rec[name].append([]); llm.generate(ps, sp, use_tqdm=False)
P = np.median(np.array(rec["plain"][1:]), axis=0); E = np.median(np.array(rec["eagle"][1:]), axis=0)
print("per-step medians summed: plain %.1f ms eagle %.1f ms ratio %.3f" % (1e3 * P.sum(), 1e3 * E.sum(), P.sum() / E.sum()))
d = (E - P) * 1e3
big = np.flatnonzero(d > 0.4)
print("excess at steps", {int(i): round(float(d[i]), 2) for i in big})
rest = np.setdiff1d(np.arange(len(d)), big)
print("excess elsewhere: median %.3f ms/step, sum %.1f ms over %d steps; big sum %.1f ms" % (np.median(d[rest]), d[rest].sum(), len(rest), d[big].sum()))
