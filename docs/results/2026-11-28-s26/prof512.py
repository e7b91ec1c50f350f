import os, sys, torch, cProfile, pstats
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import reject_all_drafts
M = "/work/main/demo-cache/demo-llama-v1"
spec = {"method": "eagle", "num_speculative_tokens": 3, "model": "/work/main/eagle-demo"}
llm = LLM(M, max_model_len=1024, speculative_config=spec if os.environ.get("SPEC") == "1" else None)
if os.environ.get("SPEC") == "1": reject_all_drafts(llm, llm.engine.core.runner.vocab_size)
g = torch.Generator().manual_seed(0)
ps = [{"prompt_token_ids": torch.randint(10, 2000, (128,), generator=g).tolist()}]
sp = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
llm.generate(ps, sp, use_tqdm=False)
pr = cProfile.Profile(); pr.enable(); llm.generate(ps, sp, use_tqdm=False); pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime")
d = {f"{k[0].split('/')[-1]}:{k[2]}": (v[1], v[2]) for k, v in st.stats.items()}
import json; json.dump(d, open(f"/tmp/s26/prof_{os.environ.get('SPEC','0')}.json", "w"))
