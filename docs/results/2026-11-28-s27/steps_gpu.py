"""Per-step host times of plain decoding and EAGLE on the demo model, on the GPU (issue 21,
session 27): where a speculative engine's extra time per token goes when the step is
host-bound. Three engines in one process (plain, EAGLE with every draft rejected, EAGLE with
its trained head), their generates alternated round by round; every engine step is timed and
classed: 'verify' (the step schedules drafts), 'sync' (the step in flight was finished before
scheduling, because the proposal after it may draft), 'async' (the rest). Then a cProfile of
one generate of each engine. BS, OUTLEN, ROUNDS from the environment."""
import cProfile, io, os, pstats, statistics, sys, time
import torch
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import reject_all_drafts
from pagelm.plugins.bench.workload import TokenWorkload
from transformers import AutoTokenizer

M = os.path.join(os.environ["PAGELM_CACHE_DIR"], "demo-llama-v1")
HEAD = os.environ.get("HEAD", os.path.abspath("eagle-demo"))
OUT = os.environ.get("OUT", "/tmp")
bs = int(os.environ.get("BS", "1")); outlen = int(os.environ.get("OUTLEN", "256")); rounds = int(os.environ.get("ROUNDS", "8"))
spec = {"method": "eagle", "num_speculative_tokens": 3, "model": HEAD}
engines = {
    "plain": LLM(M, max_model_len=1024, gpu_memory_utilization=0.25),
    "reject": LLM(M, max_model_len=1024, gpu_memory_utilization=0.5, speculative_config=spec),
    "trained": LLM(M, max_model_len=1024, gpu_memory_utilization=0.75, speculative_config=spec),
}
reject_all_drafts(engines["reject"], engines["reject"].engine.core.runner.vocab_size)
tok = AutoTokenizer.from_pretrained(M)
prompts = [[{"prompt_token_ids": p} for p in TokenWorkload.code(tok, bs, 128, outlen, seed=f"s27/{r}").prompt_token_ids] for r in range(rounds + 1)]
sp = SamplingParams(max_tokens=outlen, temperature=0, ignore_eos=True)
rec = {n: [] for n in engines}
for name, llm in engines.items():
    core = llm.engine.core
    orig_step, orig_sched, orig_fif = core.step, core.scheduler.schedule, core._finish_in_flight
    flags = {}
    def schedule(_o=orig_sched, _f=flags):
        out = _o(); _f["verify"] = bool(out.scheduled_spec_decode_tokens); return out
    def fif(_o=orig_fif, _f=flags):
        _f["sync"] = True; return _o()
    def step(_o=orig_step, _n=name, _f=flags):
        _f.clear(); t = time.perf_counter(); r = _o(); dt = time.perf_counter() - t
        kind = "verify" if _f.get("verify") else "sync" if _f.get("sync") else "async"
        rec[_n][-1].append((kind, dt)); return r
    core.scheduler.schedule, core._finish_in_flight, core.step = schedule, fif, step
for name, llm in engines.items():  # warm-up
    rec[name].append([]); llm.generate(prompts[0], sp, use_tqdm=False)
tpot = {n: [] for n in engines}
for r in range(1, rounds + 1):
    order = list(engines) if r % 2 else list(engines)[::-1]
    for name in order:
        rec[name].append([]); outs = engines[name].generate(prompts[r], sp, use_tqdm=False)
        tpot[name].append(statistics.median((o.metrics.finished_time - o.metrics.first_token_time) / (outlen - 1) for o in outs))
print(f"batch {bs}, {outlen} tokens, {rounds} rounds; {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
for name in engines:
    runs = rec[name][1:]
    total = statistics.median(sum(dt for _, dt in run) for run in runs)
    line = f"{name:8s} TPOT median {1e3 * statistics.median(tpot[name]):.3f} ms; steps' sum per run {1e3 * total:.1f} ms;"
    for kind in ("async", "sync", "verify"):
        per_run = [[dt for k, dt in run if k == kind] for run in runs]
        n = statistics.median(len(p) for p in per_run)
        allv = [dt for p in per_run for dt in p]
        if allv:
            line += f"  {kind}: {n:.0f}/run, median {1e3 * statistics.median(allv):.3f} ms, sum/run {1e3 * sum(allv) / len(runs):.1f} ms"
    print(line, flush=True)
for name, llm in engines.items():
    pr = cProfile.Profile(); pr.enable(); llm.generate(prompts[1], sp, use_tqdm=False); pr.disable()
    s = io.StringIO(); st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(70)
    st.print_callees(r"spec_decode.py:\d+\((propose|execute|_graph_step)\)")
    open(os.path.join(OUT, f"prof-{name}-bs{bs}.txt"), "w").write(s.getvalue())
