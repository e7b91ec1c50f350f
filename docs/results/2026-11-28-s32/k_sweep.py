"""EAGLE at several draft lengths (and heads) against plain decoding, one process, generates
alternated (issue 21, session 32). RUNS: comma-separated NAME=K:HEAD (HEAD a directory
relative to the checkout); each an engine beside the plain one. Greedy tokens are checked
equal to plain's every round. BS, OUTLEN, ROUNDS from the environment."""
import os, statistics
import torch
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.workload import TokenWorkload
from transformers import AutoTokenizer

M = os.path.join(os.environ["PAGELM_CACHE_DIR"], "demo-llama-v1")
bs = int(os.environ.get("BS", "1")); outlen = int(os.environ.get("OUTLEN", "256")); rounds = int(os.environ.get("ROUNDS", "24"))
runs = [r.split("=") for r in os.environ.get("RUNS", "k3=3:eagle-long,k4=4:eagle-long,k5=5:eagle-long").split(",")]
engines = {"plain": LLM(M, max_model_len=1024, gpu_memory_utilization=0.15)}
for i, (name, spec) in enumerate(runs):
    k, head = spec.split(":")
    config = {"method": "eagle", "num_speculative_tokens": int(k), "model": os.path.abspath(head)}
    engines[name] = LLM(M, max_model_len=1024, gpu_memory_utilization=0.15 * (i + 2), speculative_config=config)
tok = AutoTokenizer.from_pretrained(M)
prompts = [[{"prompt_token_ids": p} for p in TokenWorkload.code(tok, bs, 128, outlen, seed=f"s32/{r}").prompt_token_ids] for r in range(rounds + 1)]
sp = SamplingParams(max_tokens=outlen, temperature=0, ignore_eos=True)
for llm in engines.values():
    llm.generate(prompts[0], sp, use_tqdm=False)
tpot = {n: [] for n in engines}
for r in range(1, rounds + 1):
    toks = {}
    for name in (list(engines) if r % 2 else list(engines)[::-1]):
        outs = engines[name].generate(prompts[r], sp, use_tqdm=False)
        toks[name] = [o.outputs[0].token_ids for o in outs]
        tpot[name].append(statistics.median((o.metrics.finished_time - o.metrics.first_token_time) / (outlen - 1) for o in outs))
    assert all(t == toks["plain"] for t in toks.values()), f"round {r}: tokens differ"
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
print(f"batch {bs}, {outlen} tokens, {rounds} rounds; {device}; greedy tokens equal to plain's in every engine")
t = {n: statistics.median(v) for n, v in tpot.items()}
for name, spec in runs:
    st = engines[name].engine.core.scheduler.spec_decoding_stats
    ratios = [p / q for p, q in zip(tpot["plain"], tpot[name])]
    print(f"{name:6s} ({spec}) acceptance length {st.mean_acceptance_length or 0:.2f}; TPOT median {1e3 * t[name]:.3f} ms "
          f"(plain {1e3 * t['plain']:.3f}): median per-round speedup {statistics.median(ratios):.2f}x, of medians "
          f"{t['plain'] / t[name]:.2f}x")
