import sys, os, time, torch
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import reject_all_drafts
M = "/work/main/demo-cache/demo-llama-v1"
spec = {"method": "eagle", "num_speculative_tokens": 3, "model": "/work/main/eagle-demo", "max_backoff_steps": int(os.environ.get("MAXB", "32"))}
bs = int(os.environ.get("BS", "1"))
llm = LLM(M, max_model_len=1024, speculative_config=spec if os.environ.get("SPEC", "1") == "1" else None)
if os.environ.get("REJECT") == "1":
    reject_all_drafts(llm, llm.engine.core.runner.vocab_size)
g = torch.Generator().manual_seed(0)
ps = [{"prompt_token_ids": torch.randint(10, 2000, (128,), generator=g).tolist()} for _ in range(bs)]
sp = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
llm.generate(ps, sp, use_tqdm=False)
if sys.argv[1:] == ["cprof"]:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable(); llm.generate(ps, sp, use_tqdm=False); pr.disable()
    pstats.Stats(pr).sort_stats(os.environ.get("SORT", "cumtime")).print_stats(int(os.environ.get("N", "45")))
else:
    for _ in range(3):
        t = time.process_time(); llm.generate(ps, sp, use_tqdm=False); print("%.3f s" % (time.process_time() - t))
st = llm.engine.core.runner.spec.proposer
print("drafted", getattr(llm.engine.core, "spec_stats", None))
