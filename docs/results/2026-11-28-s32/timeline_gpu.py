"""Where a decode step's time goes, host against GPU (issue 21, session 32).
Plain decoding and EAGLE (head HEAD, k=K) on the demo model, one process. After warm-up,
torch.profiler (CPU + CUDA) over one generate of each engine at batch BS; from its Chrome
trace: per engine step the wall time, the GPU's busy time (union of kernels, copies and
memsets), kernels launched, and the host's time blocked in synchronising calls. Traces are
written gzipped to OUT."""
import collections, gzip, json, os, statistics, time
import torch
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.workload import TokenWorkload
from torch.profiler import profile, ProfilerActivity
from transformers import AutoTokenizer

M = os.path.join(os.environ["PAGELM_CACHE_DIR"], "demo-llama-v1")
HEAD = os.environ.get("HEAD", os.path.abspath("eagle-long"))
OUT = os.environ.get("OUT", "/tmp")
bs = int(os.environ.get("BS", "1")); outlen = int(os.environ.get("OUTLEN", "128"))
K = int(os.environ.get("K", "3"))
spec = {"method": "eagle", "num_speculative_tokens": K, "model": HEAD}
engines = {
    "plain": LLM(M, max_model_len=1024, gpu_memory_utilization=0.2),
    "trained": LLM(M, max_model_len=1024, gpu_memory_utilization=0.4, speculative_config=spec),
}
tok = AutoTokenizer.from_pretrained(M)
prompts = [[{"prompt_token_ids": p} for p in TokenWorkload.code(tok, bs, 128, outlen, seed=f"s32/{r}").prompt_token_ids] for r in range(3)]
sp = SamplingParams(max_tokens=outlen, temperature=0, ignore_eos=True)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNC = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ", "cudaMemcpy")


def union(intervals):
    total, end = 0.0, -1.0
    for s, e in sorted(intervals):
        if s > end:
            total += e - s; end = e
        elif e > end:
            total += e - end; end = e
    return total


for name, llm in engines.items():
    for p in prompts[:2]:
        llm.generate(p, sp, use_tqdm=False)
    core = llm.engine.core
    nsteps = [0]
    orig = core.step
    def step(_o=orig):
        nsteps[0] += 1
        return _o()
    core.step = step
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts[2], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    core.step = orig
    path = os.path.join(OUT, f"trace-{name}-bs{bs}.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(path)
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS and "dur" in e]
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    runtime = collections.Counter(); runtime_t = collections.Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime":
            runtime[e["name"]] += 1; runtime_t[e["name"]] += e.get("dur", 0)
    steps_ = collections.Counter(); steps_t = collections.Counter()
    n = nsteps[0]
    tpot = statistics.median((o.metrics.finished_time - o.metrics.first_token_time) / (outlen - 1) for o in outs)
    busy = union(gpu) / 1e3
    span = (max(e for _, e in gpu) - min(s for s, _ in gpu)) / 1e3 if gpu else 0
    sync = sum(v for k, v in runtime_t.items() if k.startswith(SYNC)) / 1e3
    print(f"== {name} batch {bs}: {n} engine steps, {outlen} tokens, wall {wall * 1e3:.1f} ms (profiled), TPOT {tpot * 1e3:.3f} ms")
    print(f"   per step: wall {wall * 1e3 / n:.3f} ms, GPU busy {busy / n:.3f} ms (GPU span {span / n:.3f}), "
          f"host blocked in syncs {sync / n:.3f} ms, kernels {kernels / n:.1f}")
    for k, c in runtime.most_common(12):
        print(f"   {k:40s} {c / n:6.2f}/step  {runtime_t[k] / c:8.1f} us each")
    # Kernel time by name (top 15)
    kt = collections.Counter(); kc = collections.Counter()
    for e in events:
        if e.get("cat") == "kernel":
            kt[e["name"][:70]] += e["dur"]; kc[e["name"][:70]] += 1
    for k, v in kt.most_common(15):
        print(f"   K {k:70s} {kc[k] / n:5.2f}/step {v / kc[k]:6.1f} us")
    if name != "plain":
        st = core.scheduler.spec_decoding_stats
        print(f"   acceptance length {st.mean_acceptance_length or 0:.2f}")
