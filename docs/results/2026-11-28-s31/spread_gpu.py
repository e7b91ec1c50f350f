"""Issue 21, session 31: is a useless drafter's cost at batch 32 in its code, or in which engine runs?
Engines in one process, generates alternated (BS, OUTLEN, ROUNDS, K, HEAD from the environment):
  plain, plain2   two plain engines (the spread between engines that run the same code)
  reject          EAGLE, every draft rejected (``reject_all_drafts``)
  reject_off      the same engine object as ``reject`` with speculation switched off for the
                  generate (runner.spec None, no lookahead slots): plain decoding on that engine
  reject_s5       that engine again, with new requests starting at backoff level 5 (a 64-step
                  pause before the first probe) in place of SLUMP_LEVEL's 3
reject/reject_off is the cost of the speculative code alone; plain/plain2 and plain/reject_off
are what the engines' placement costs. WRAP=1: per-step phase timers in quiet steps too."""
import collections, functools, os, statistics, sys, time
import torch
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.workload import TokenWorkload
from pagelm.plugins.bench.latency import reject_all_drafts
from transformers import AutoTokenizer

M = os.path.join(os.environ["PAGELM_CACHE_DIR"], "demo-llama-v1")
HEAD = os.environ.get("HEAD", os.path.abspath("eagle-long"))
bs = int(os.environ.get("BS", "32")); outlen = int(os.environ.get("OUTLEN", "256")); rounds = int(os.environ.get("ROUNDS", "12"))
spec = {"method": "eagle", "num_speculative_tokens": int(os.environ.get("K", "3")), "model": HEAD}
# gpu_memory_utilization counts what the engines before took: each gets a fifth.
engines = {
    "plain": LLM(M, max_model_len=1024, gpu_memory_utilization=0.2),
    "reject": LLM(M, max_model_len=1024, gpu_memory_utilization=0.4, speculative_config=spec),
    "plain2": LLM(M, max_model_len=1024, gpu_memory_utilization=0.6),
}
reject_all_drafts(engines["reject"], engines["reject"].engine.core.runner.vocab_size)
core_r = engines["reject"].engine.core
SPEC = (core_r.runner.spec, core_r.scheduler.num_lookahead_tokens)


def switch(on: bool) -> None:
    core_r.runner.spec = SPEC[0] if on else None
    core_r.scheduler.num_lookahead_tokens = SPEC[1] if on else 0


import pagelm.plugins.spec_decode.backoff as backoff_mod
SLUMP = backoff_mod.SLUMP_LEVEL
runs = {"plain": "plain", "reject": "reject", "reject_off": "reject", "plain2": "plain2", "reject_s5": "reject"}
if os.environ.get("RUNS"):  # a subset, e.g. RUNS=plain,reject,reject_off
    runs = {n: runs[n] for n in os.environ["RUNS"].split(",")}
acc = collections.defaultdict(float); steps = collections.defaultdict(list); cur = {"name": None}
WRAP = os.environ.get("WRAP", "0") == "1"


def timed(obj, attr, phase):
    orig = getattr(obj, attr)
    @functools.wraps(orig)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            acc[phase] += time.perf_counter() - t
    setattr(obj, attr, w)


if WRAP:
    for name, llm in engines.items():
        core, runner = llm.engine.core, llm.engine.core.runner
        for o, a in ((core, "_schedule"), (core.scheduler, "update_from_output"), (runner, "launch"), (runner, "finish"),
                     (runner, "may_draft_next"), (runner, "prepare_inputs"), (runner, "sample"), (runner, "_collect")):
            timed(o, a, a)
        orig = core.step
        def step(_o=orig, _c=core):
            acc.clear(); t = time.perf_counter(); r = _o(); dt = time.perf_counter() - t
            rec = dict(acc); rec["step"] = dt
            steps[(cur["name"], "verify" if _c.scheduler.spec_decoding_stats.num_drafts != cur.get("nd") else "quiet")].append(rec)
            cur["nd"] = _c.scheduler.spec_decoding_stats.num_drafts
            return r
        core.step = step

tok = AutoTokenizer.from_pretrained(M)
prompts = [[{"prompt_token_ids": p} for p in TokenWorkload.code(tok, bs, 128, outlen, seed=f"s29/{r}").prompt_token_ids] for r in range(rounds + 1)]
sp = SamplingParams(max_tokens=outlen, temperature=0, ignore_eos=True)


def run(name, batch):
    switch(name != "reject_off")
    backoff_mod.SLUMP_LEVEL = 5 if name == "reject_s5" else SLUMP
    cur["name"] = name; cur["nd"] = engines[runs[name]].engine.core.scheduler.spec_decoding_stats.num_drafts
    outs = engines[runs[name]].generate(batch, sp, use_tqdm=False)
    switch(True)
    return outs


ref = None
for name in runs:
    outs = run(name, prompts[0])
    toks = [o.outputs[0].token_ids for o in outs]
    assert ref is None or toks == ref, f"{name}: outputs differ from plain"
    ref = ref or toks
steps.clear()
tpot = {n: [] for n in runs}
order = list(runs)
for r in range(1, rounds + 1):
    for name in (order if r % 2 else order[::-1]):
        outs = run(name, prompts[r])
        tpot[name].append(statistics.median((o.metrics.finished_time - o.metrics.first_token_time) / (outlen - 1) for o in outs))
st = core_r.scheduler.spec_decoding_stats
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
print(f"batch {bs}, {outlen} tokens, {rounds} rounds, {dev}; reject: {st.num_drafts / (rounds + 1) / bs:.1f} verifications a request")
ratio = lambda a, b: statistics.median(x / y for x, y in zip(tpot[a], tpot[b]))
for n in runs:
    print(f"  {n:11s} TPOT median {1e3 * statistics.median(tpot[n]):.3f} ms   per round: {' '.join(f'{1e3 * x:.3f}' for x in tpot[n])}")
for a, b in (("plain", "reject"), ("plain", "plain2"), ("plain", "reject_off"), ("reject_off", "reject"), ("plain2", "reject"),
             ("plain", "reject_s5"), ("reject_off", "reject_s5")):
    if a not in runs or b not in runs:
        continue
    print(f"  {b} against {a}: median of per-round ratios {ratio(a, b):.3f}x")
for (name, kind), recs in sorted(steps.items()):
    print(f"== {name} {kind}: {len(recs) / rounds:.0f} steps/run")
    for p in sorted({p for r in recs for p in r}, key=lambda p: -statistics.mean(r.get(p, 0) for r in recs)):
        v = [r.get(p, 0.0) for r in recs]
        print(f"   {p:22s} mean {1e3 * statistics.mean(v):.4f} ms  median {1e3 * statistics.median(v):.4f} ms")
sys.stdout.flush()
