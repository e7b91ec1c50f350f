import sys, time, os, torch
torch.set_num_threads(1)
from pagelm import LLM, SamplingParams
d = "/tmp/s21/demo_shaped"
llm = LLM(d, max_model_len=1024, max_num_seqs=16, attention_backend="torch")
g = torch.Generator().manual_seed(0)
ps = [{"prompt_token_ids": torch.randint(10, 2000, (64,), generator=g).tolist()} for _ in range(16)]
sp = SamplingParams(max_tokens=128, temperature=float(os.environ.get("TEMP", "0")), ignore_eos=True)
llm.generate(ps, sp, use_tqdm=False)
mode = sys.argv[1] if len(sys.argv) > 1 else "time"
if mode == "cprof":
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable(); llm.generate(ps, sp, use_tqdm=False); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(35)
elif mode == "prof":
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        llm.generate(ps, sp, use_tqdm=False)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
else:
    for _ in range(5):
        t = time.perf_counter(); r = llm.generate(ps, sp, use_tqdm=False); dt = time.perf_counter() - t
        print(f"{16*128/dt:.1f} out tok/s  {dt*1000/128:.2f} ms/step", hash(tuple(tuple(x.outputs[0].token_ids) for x in r)))
