"""Where a speculative verification step's host time goes on the GPU (issue 21, session 28; copied for sessions 29-30).
Session 30: K (drafts a step, default 3); COLD=1 adds a fourth engine, every draft rejected with the
proposer's record cleared before each generate (a cold engine's first batch).
Plain decoding and EAGLE with its trained head on the demo model, in one process, generates
alternated. Every engine step is timed, and inside it the phases below (inclusive wall time,
perf_counter wrappers, no profiler), per step of each kind ('verify': drafts scheduled).
Then torch.profiler (CPU activity only) over one generate of each engine: the torch ops a
step issues, by count. BS, OUTLEN, ROUNDS from the environment."""
import collections, functools, os, statistics, sys, time
import torch
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.workload import TokenWorkload
import pagelm.worker.spec_decode as spec_mod
from transformers import AutoTokenizer

M = os.path.join(os.environ["PAGELM_CACHE_DIR"], "demo-llama-v1")
HEAD = os.environ.get("HEAD", os.path.abspath("eagle-demo"))
OUT = os.environ.get("OUT", "/tmp")
bs = int(os.environ.get("BS", "1")); outlen = int(os.environ.get("OUTLEN", "256")); rounds = int(os.environ.get("ROUNDS", "6"))
spec = {"method": "eagle", "num_speculative_tokens": int(os.environ.get("K", "3")), "model": HEAD}
REJECT = os.environ.get("REJECT", "0") == "1"  # a third engine: EAGLE with every draft rejected
engines = {
    "plain": LLM(M, max_model_len=1024, gpu_memory_utilization=0.2),
    "trained": LLM(M, max_model_len=1024, gpu_memory_utilization=0.4, speculative_config=spec),
}
COLD = os.environ.get("COLD", "0") == "1"
if REJECT:
    from pagelm.plugins.bench.latency import reject_all_drafts
    engines["reject"] = LLM(M, max_model_len=1024, gpu_memory_utilization=0.6, speculative_config=spec)
    reject_all_drafts(engines["reject"], engines["reject"].engine.core.runner.vocab_size)
    if COLD:
        engines["cold"] = LLM(M, max_model_len=1024, gpu_memory_utilization=0.8, speculative_config=spec)
        reject_all_drafts(engines["cold"], engines["cold"].engine.core.runner.vocab_size)


def forget(name):
    """The cold engine's proposer forgets its record (a tree without one: nothing to clear)."""
    if name == "cold":
        b = engines[name].engine.core.runner.spec.proposer.backoff
        b.record_accepted = b.record_verifications = 0.0
tok = AutoTokenizer.from_pretrained(M)
prompts = [[{"prompt_token_ids": p} for p in TokenWorkload.code(tok, bs, 128, outlen, seed=f"s29/{r}").prompt_token_ids] for r in range(rounds + 1)]
sp = SamplingParams(max_tokens=outlen, temperature=0, ignore_eos=True)

acc = collections.defaultdict(float)   # (engine, kind, phase) -> seconds, this step
steps = collections.defaultdict(list)  # (engine, kind) -> [{phase: s}]
cur = {"engine": None}

WRAP = os.environ.get("WRAP", "1") == "1"  # 0: no phase timers (clean TPOT)


def timed(obj, attr, phase):
    orig = getattr(obj, attr, None)
    if orig is None or not WRAP:
        return
    @functools.wraps(orig)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            acc[phase] += time.perf_counter() - t
    setattr(obj, attr, wrapper)

for name, llm in engines.items():
    core = llm.engine.core
    runner = core.runner
    timed(core, "_schedule", "schedule")
    timed(core.scheduler, "update_from_output", "update_from_output")
    timed(runner, "launch", "runner.launch")
    timed(runner, "finish", "runner.finish")
    timed(runner, "prepare_inputs", "prepare_inputs")
    timed(runner, "compute_logits", "compute_logits")
    timed(runner, "sample", "runner.sample")
    if runner.spec is not None:
        s = runner.spec
        timed(s, "execute", "spec.execute")
        timed(s, "_graph_step", "spec._graph_step")
        timed(s, "propose", "spec.propose")
        timed(s.proposer, "propose_step", "proposer.propose_step")
        timed(type(s.rejection_sampler), "verify_argmax", "rejection_sampler.verify_argmax")
        timed(type(s.rejection_sampler), "__call__", "rejection_sampler")
        if s.graphs is not None and WRAP:
            timed(s.graphs, "replay", "verify_graph.replay")
            timed(s.graphs, "load", "verify_graph.load")
    if not WRAP:
        continue
    orig_step = core.step
    def step(_o=orig_step, _n=name, _c=core):
        acc.clear(); t = time.perf_counter(); r = _o(); dt = time.perf_counter() - t
        verify = acc.get("spec.execute", 0.0) > 0
        rec = dict(acc); rec["step"] = dt
        steps[(_n, "verify" if verify else "other")].append(rec); return r
    core.step = step
timed(spec_mod, "build_sampling_metadata", "build_sampling_metadata")
from pagelm.plugins.spec_decode.eagle import EagleProposer
from pagelm.plugins.spec_decode.eagle_graphs import EagleDraftGraphs
from pagelm.worker.draft_store import DraftStore
for cls, attrs in (
    (EagleProposer, ("propose", "_replay_proposal")),
    (EagleDraftGraphs, ("load_step", "replay", "_stage")),
    (DraftStore, ("keep", "resolve", "gather")),
    (spec_mod.SpecDecodeRunner if hasattr(spec_mod, "SpecDecodeRunner") else type(engines["trained"].engine.core.runner.spec), ("_target_pass", "_deferred_inputs")),
):
    for a in attrs:
        timed(cls, a, f"{cls.__name__}.{a}")

for name, llm in engines.items():
    forget(name)
    llm.generate(prompts[0], sp, use_tqdm=False)
steps.clear()
tpot = {n: [] for n in engines}
for r in range(1, rounds + 1):
    for name in (list(engines) if r % 2 else list(engines)[::-1]):
        forget(name)
        outs = engines[name].generate(prompts[r], sp, use_tqdm=False)
        tpot[name].append(statistics.median((o.metrics.finished_time - o.metrics.first_token_time) / (outlen - 1) for o in outs))
for name in ("reject", "cold"):
    if name in engines:
        st = engines[name].engine.core.scheduler.spec_decoding_stats
        print(f"{name}: {st.num_drafts / (rounds + 1) / bs:.1f} verifications a request")
stats = engines["trained"].engine.core.scheduler.spec_decoding_stats
print(f"batch {bs}, {outlen} tokens, {rounds} rounds; {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}; "
      f"EAGLE acceptance length {stats.mean_acceptance_length or 0:.2f} over {stats.num_drafts} verifications")
t = {n: statistics.median(v) for n, v in tpot.items()}
per_round = lambda name: statistics.median(p / q for p, q in zip(tpot["plain"], tpot[name]))
print("median of the per-round ratios: " + ", ".join(f"{n} {per_round(n):.2f}x" for n in engines if n != "plain"))
print(f"TPOT median: plain {1e3 * t['plain']:.3f} ms, trained {1e3 * t['trained']:.3f} ms: speedup {t['plain'] / t['trained']:.2f}x"
      f" (per round: {', '.join(f'{p / q:.2f}' for p, q in zip(tpot['plain'], tpot['trained']))})")
for name, label in (("reject", "every draft rejected"), ("cold", "every draft rejected, cold record")):
    if name not in t:
        continue
    print(f"TPOT median: {label} {1e3 * t[name]:.3f} ms: {t['plain'] / t[name]:.2f}x of plain"
          f" (per round: {', '.join(f'{p / q:.2f}' for p, q in zip(tpot['plain'], tpot[name]))})")
for (name, kind), recs in sorted(steps.items()):
    phases = sorted({p for r in recs for p in r}, key=lambda p: -statistics.mean(r.get(p, 0) for r in recs))
    print(f"== {name} {kind}: {len(recs) / rounds:.0f} steps/run")
    for p in phases:
        vals = [r.get(p, 0.0) for r in recs]
        print(f"   {p:28s} mean {1e3 * statistics.mean(vals):.3f} ms  median {1e3 * statistics.median(vals):.3f} ms")
sys.stdout.flush()

from torch.profiler import profile, ProfilerActivity
for name, llm in engines.items() if WRAP else ():
    n0 = sum(len(v) for (n, _), v in steps.items() if n == name)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts[1], sp, use_tqdm=False)
    n = sum(len(v) for (nm, _), v in steps.items() if nm == name) - n0
    ka = prof.key_averages()
    table = ka.table(sort_by="count", row_limit=60) + "\n" + ka.table(sort_by="self_cpu_time_total", row_limit=40)
    open(os.path.join(OUT, f"ops-{name}-bs{bs}.txt"), "w").write(f"{n} engine steps\n" + table)
    print(f"{name}: {n} steps profiled")
