import sys, time, os, torch
torch.set_num_threads(1)
from pagelm import LLM, SamplingParams
import pagelm.sample.sampler as S
new = S.sample_from_probs
old = lambda probs, gens, gen, q=None: S.exponential_race(probs, gens, gen, q)
llm = LLM("/tmp/s25/demo_shaped", max_model_len=1024, max_num_seqs=16, attention_backend="torch")
g = torch.Generator().manual_seed(0)
ps = [{"prompt_token_ids": torch.randint(10, 2000, (64,), generator=g).tolist()} for _ in range(16)]
sp = SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True)
llm.generate(ps, sp, use_tqdm=False)
res = {"old": [], "new": []}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for name, f in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
        S.sample_from_probs = f
        t = time.process_time(); llm.generate(ps, sp, use_tqdm=False); dt = time.process_time() - t
        res[name].append(dt * 1000 / 128)
for k, v in res.items():
    v.sort(); print(k, "ms/step (cpu) median %.3f min %.3f" % (v[len(v)//2], v[0]), [round(x, 2) for x in v])
