"""cProfile over EAGLE (trained head, k=3) generates on the demo model, per engine step
(issue 21, session 29): which Python functions a speculative engine's steps spend host time
in, against plain decoding in the same process. BS, OUTLEN, TOP from the environment. The
profiler roughly doubles the cost of Python-heavy code: rankings, not absolute times."""
import cProfile, collections, os, pstats, sys
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.workload import TokenWorkload
from transformers import AutoTokenizer

M = os.path.join(os.environ["PAGELM_CACHE_DIR"], "demo-llama-v1")
HEAD = os.environ.get("HEAD", os.path.abspath("eagle-demo"))
bs = int(os.environ.get("BS", "1")); outlen = int(os.environ.get("OUTLEN", "256")); top = int(os.environ.get("TOP", "45"))
spec = {"method": "eagle", "num_speculative_tokens": 3, "model": HEAD}
engines = {
    "plain": LLM(M, max_model_len=1024, gpu_memory_utilization=0.3),
    "trained": LLM(M, max_model_len=1024, gpu_memory_utilization=0.6, speculative_config=spec),
}
tok = AutoTokenizer.from_pretrained(M)
prompts = [[{"prompt_token_ids": p} for p in TokenWorkload.code(tok, bs, 128, outlen, seed=f"s29/{r}").prompt_token_ids] for r in range(2)]
sp = SamplingParams(max_tokens=outlen, temperature=0, ignore_eos=True)
for llm in engines.values():
    llm.generate(prompts[0], sp, use_tqdm=False)
for name, llm in engines.items():
    core = llm.engine.core
    count = collections.Counter()
    orig = core.step
    def step(_o=orig, _c=count):
        _c["steps"] += 1
        return _o()
    core.step = step
    pr = cProfile.Profile()
    pr.enable()
    llm.generate(prompts[1], sp, use_tqdm=False)
    pr.disable()
    core.step = orig
    n = count["steps"]
    st = pstats.Stats(pr).stats
    rows = []
    for (fn, line, func), (cc, nc, tt, ct, _) in st.items():
        where = fn.split("site-packages/")[-1].split("/pagelm/")[-1] if "/" in fn else fn
        rows.append((tt, ct, nc, f"{where}:{line}({func})"))
    total = sum(r[0] for r in rows)
    print(f"== {name}, batch {bs}: {n} engine steps, {1e6 * total / n:.0f} us profiled per step")
    print("  by own time (us/step, calls/step, cumulative us/step):")
    for tt, ct, nc, label in sorted(rows, reverse=True)[:top]:
        print(f"   {1e6 * tt / n:8.1f} {nc / n:6.1f} {1e6 * ct / n:8.1f}  {label[:110]}")
    print("  pagelm functions by cumulative time:")
    mine = [r for r in rows if "pagelm" in r[3] or not r[3].startswith(("<", "{", "~")) and "torch/" not in r[3] and "numpy/" not in r[3]]
    for tt, ct, nc, label in sorted(mine, key=lambda r: -r[1])[:top]:
        print(f"   {1e6 * ct / n:8.1f} {nc / n:6.1f} {1e6 * tt / n:8.1f}  {label[:110]}")
    sys.stdout.flush()
