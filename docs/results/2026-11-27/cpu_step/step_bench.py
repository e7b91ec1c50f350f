"""Time the CPU engine on the demo model's shapes (issue 22 item 5).

Three workloads through ``LLM.generate`` (greedy, one torch thread):
  decode64:  16 prompts x 64 tokens, 64 out  (batch-16 decode at context ~64-128)
  decode800: 16 prompts x 768 tokens, 32 out (batch-16 decode at context ~800, plus prefill)
  prefill:   16 prompts x 768 tokens, 1 out  (prefill only)
Run: python step_bench.py MODEL_DIR [--profile]
"""
import sys, time, json, os
import torch

torch.set_num_threads(1)
from pagelm import LLM, SamplingParams
from pagelm.models.testing import build_tiny_model

model_dir = sys.argv[1]
if not os.path.exists(os.path.join(model_dir, "config.json")):
    build_tiny_model(model_dir, vocab_size=2048, hidden_size=256, intermediate_size=688,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     tokenizer_vocab_size=2048, max_position_embeddings=2048)
extra = json.loads(os.environ.get("BENCH_LLM_ARGS", "{}"))
llm = LLM(model_dir, max_model_len=1024, max_num_seqs=16, enable_prefix_caching=False, **extra)
if os.environ.get("BENCH_COMPILE"):
    import gc
    from pagelm.models.llama import LlamaModel
    from pagelm.attention import Attention
    Attention.forward = torch.compiler.disable(Attention.forward)
    for m in [o for o in gc.get_objects() if isinstance(o, LlamaModel)]:
        m.stage_layers = tuple(torch.compile(l, dynamic=True) for l in m.stage_layers)
g = torch.Generator().manual_seed(0)
def prompts(n, length):
    return [{"prompt_token_ids": torch.randint(10, 2000, (length,), generator=g).tolist()} for _ in range(n)]
work = {"decode64": (prompts(16, 64), 64), "decode800": (prompts(16, 768), 32), "prefill": (prompts(16, 768), 1)}
out = {}
for name, (ps, n_out) in work.items():
    sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    llm.generate(ps, sp)  # warm: every batch size and shape once (compiles, if compiling)
    times = []
    for _ in range(int(os.environ.get("BENCH_REPEATS", "3"))):
        t = time.perf_counter()
        res = llm.generate(ps, sp)
        times.append(time.perf_counter() - t)
    out[name] = sorted(times)[len(times) // 2]
    out[name + "_ids"] = hash(tuple(tuple(r.outputs[0].token_ids) for r in res))
print(json.dumps(out))
