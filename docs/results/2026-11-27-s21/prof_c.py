import sys, time, os, torch
torch.set_num_threads(int(os.environ.get("NT","1")))
from pagelm import LLM, SamplingParams
from pagelm.models.testing import build_tiny_model
d = "/tmp/s21/demo_shaped"
if not os.path.exists(d + "/config.json"):
    build_tiny_model(d, "llama", tokenizer_vocab_size=2048, vocab_size=2048, hidden_size=256, intermediate_size=688,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=1024, tie_word_embeddings=True)
llm = LLM(d, max_model_len=1024, max_num_seqs=16, attention_backend="torch")
g = torch.Generator().manual_seed(0)
ps = [{"prompt_token_ids": torch.randint(10, 2000, (768,), generator=g).tolist()} for _ in range(64)]
sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
llm.generate(ps[:16], sp)
mode = sys.argv[1] if len(sys.argv) > 1 else "time"
if mode == "prof":
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        llm.generate(ps, sp)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
else:
    for _ in range(3):
        t = time.perf_counter(); r = llm.generate(ps, sp); dt = time.perf_counter() - t
        print(f"{64*32/dt:.1f} out tok/s  {dt:.2f}s", hash(tuple(tuple(x.outputs[0].token_ids) for x in r)))
