"""Issue 21: does the Triton backend's nano-vllm figure include Triton compiling kernels inside
the timed run? Logs every in-process kernel-cache miss (a compile, or a load from Triton's disk
cache) with its time, during (1) an engine's warm-up and timed run on a fresh process, then (2)
a second engine in the same process (every kernel already built) on the same workload.
Run: python3 jit_during_run.py BACKEND [key=value engine kwargs ...]"""
import collections
import sys
import time

import triton

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.bench.workload import TokenWorkload

EVENTS = []  # (phase, name, constexprs summary, seconds)
_phase = ["start"]
_t0 = {}


def pre(**kw):
    key = kw.get("key")
    _t0[str(key)] = time.perf_counter()
    return False


def post(**kw):
    key, fn, compile = kw.get("key"), kw.get("fn"), kw.get("compile") or {}
    sig = kw.get("repr", "")
    sig = sig[sig.find("("):]  # the arguments' types and specializations
    EVENTS.append((_phase[0], getattr(fn, "name", str(fn)), sig[:700], time.perf_counter() - _t0.pop(str(key), time.perf_counter())))


triton.knobs.runtime.jit_cache_hook = pre
triton.knobs.runtime.jit_post_compile_hook = post


def one_engine(tag, model, engine_kw):
    _phase[0] = f"{tag}: engine build"
    t = time.perf_counter()
    llm = LLM(model, **engine_kw)
    build = time.perf_counter() - t
    _phase[0] = f"{tag}: warm-up"
    warm = TokenWorkload.fixed(8, 128, 16, 151936, 1)
    llm.generate([{"prompt_token_ids": p} for p in warm.prompt_token_ids],
                 SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    _phase[0] = f"{tag}: timed run"
    w = TokenWorkload.nano_vllm(seed=0)
    prompts = [{"prompt_token_ids": p} for p in w.prompt_token_ids]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in w.output_lens]
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    el = time.perf_counter() - t
    print(f"[{tag}] build {build:.1f} s; timed run {el:.2f} s, {w.num_output_tokens / el:,.0f} output tok/s", flush=True)
    llm.shutdown()


def main():
    backend = sys.argv[1]
    kw = dict(a.split("=", 1) for a in sys.argv[2:])
    model, engine_kw = resolve_bench_model("qwen3-0.6b", {"attention_backend": backend, "max_model_len": 4096, **kw})
    one_engine(f"{backend} first", model, engine_kw)
    one_engine(f"{backend} second", model, engine_kw)
    per_phase = collections.defaultdict(lambda: [0, 0.0])
    for phase, name, consts, s in EVENTS:
        per_phase[phase][0] += 1
        per_phase[phase][1] += s
        if "timed" in phase:
            print(f"[{backend}]   {phase}: {s:6.2f} s {name} {consts}")
    for phase, (n, s) in per_phase.items():
        print(f"[{backend}] {phase}: {n} kernel builds/loads, {s:.2f} s")


if __name__ == "__main__":
    main()
