"""EAGLE with and without the speculative graphs' fused bookkeeping kernels (issue 21, session 32).
Three engines in one process, generates alternated: plain decoding, EAGLE (head HEAD, k=K)
with the 2.25 kernels (draft_step_inputs, draft_pass_inputs, gather_drafts), and EAGLE with
them looked up as None while its graphs are captured (the torch ops, as before). Greedy tokens
of the two EAGLE engines are checked equal. BS, OUTLEN, ROUNDS from the environment."""
import os, statistics
import torch
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.workload import TokenWorkload
import pagelm.plugins.spec_decode.eagle_graphs as eg
import pagelm.worker.cuda_graphs as cg
from transformers import AutoTokenizer

M = os.path.join(os.environ["PAGELM_CACHE_DIR"], "demo-llama-v1")
HEAD = os.environ.get("HEAD", os.path.abspath("eagle-long"))
bs = int(os.environ.get("BS", "1")); outlen = int(os.environ.get("OUTLEN", "256")); rounds = int(os.environ.get("ROUNDS", "24"))
spec = {"method": "eagle", "num_speculative_tokens": int(os.environ.get("K", "3")), "model": HEAD}
NEW = ("draft_step_inputs", "draft_pass_inputs", "gather_drafts")
engines = {"plain": LLM(M, max_model_len=1024, gpu_memory_utilization=0.2),
           "fused": LLM(M, max_model_len=1024, gpu_memory_utilization=0.4, speculative_config=spec)}
orig = (eg.fused_kernel, cg.fused_kernel)
eg.fused_kernel = cg.fused_kernel = lambda name: None if name in NEW else orig[0](name)
engines["torch_ops"] = LLM(M, max_model_len=1024, gpu_memory_utilization=0.6, speculative_config=spec)
eg.fused_kernel, cg.fused_kernel = orig
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
    assert toks["fused"] == toks["torch_ops"] == toks["plain"], f"round {r}: tokens differ"
st = engines["fused"].engine.core.scheduler.spec_decoding_stats
print(f"batch {bs}, {outlen} tokens, {rounds} rounds; {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}; acceptance length (fused engine) "
      f"{st.mean_acceptance_length or 0:.2f}; greedy tokens equal across the three engines")
t = {n: statistics.median(v) for n, v in tpot.items()}
for name in ("fused", "torch_ops"):
    ratios = [p / q for p, q in zip(tpot["plain"], tpot[name])]
    print(f"{name:10s} TPOT median {1e3 * t[name]:.3f} ms (plain {1e3 * t['plain']:.3f}): median per-round speedup "
          f"{statistics.median(ratios):.2f}x, of medians {t['plain'] / t[name]:.2f}x")
ab = [q / p for p, q in zip(tpot["fused"], tpot["torch_ops"])]
print(f"fused against torch_ops: median per-round {statistics.median(ab):.3f}x faster")
