"""Issue 18 parity: greedy token ids at TP=2 (and PP=2 when the engine has it) against TP=1 on
the same prompts and seed. (1) a small Llama in float32: identical expected. (2) Llama-3.1-8B's
shapes in bfloat16 with random N(0, 0.02) weights written as a safetensors checkpoint (the
engine's dummy loader draws each rank's slice separately, so it cannot serve a parity run):
the first position where each prompt's ids diverge, if any.
Each engine runs in a fresh process (on two H100s a TP=2 engine built in the process that had
just shut a TP=1 engine down did not finish within 70 s, while a fresh process's did).
Run: python3 parity.py small|8b [extra LLM kwargs as key=value ...]"""
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagelm import LLM, SamplingParams

ROOT = Path("/tmp/parity")


def run(model_dir, prompts, max_tokens, **kw):
    """The greedy ids of ``prompts`` from an engine in a fresh Python process."""
    import subprocess, tempfile

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"model": str(model_dir), "prompts": prompts, "max_tokens": max_tokens, "kw": kw}))
        try:
            subprocess.run([sys.executable, __file__, "engine", str(job)], timeout=240)
        except subprocess.TimeoutExpired:
            print("  (the engine process did not exit; its ids were written before shutdown)", flush=True)
        return json.loads((Path(tmp) / "ids.json").read_text())


def engine(job_path):
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)  # a hang shows where it is
    job = json.loads(Path(job_path).read_text())
    _generate(job["model"], job["prompts"], job["max_tokens"], Path(job_path).parent / "ids.json", **job["kw"])


def _generate(model_dir, prompts, max_tokens, ids_path, **kw):
    """Writes the ids before the engine shuts down (a shutdown that hangs still gives them)."""
    t = time.time()
    llm = LLM(str(model_dir), seed=0, **kw)
    print(f"  {kw}: engine built in {time.time() - t:.1f} s", flush=True)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        print(f"  {kw}: generated at {time.time() - t:.1f} s", flush=True)
        ids_path.write_text(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    finally:
        llm.shutdown()
    print(f"  {kw}: shut down at {time.time() - t:.1f} s", flush=True)


def compare(name, ref, other):
    firsts = []
    for a, b in zip(ref, other):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        firsts.append(first)
    same = sum(f is None for f in firsts)
    print(f"{name}: {same}/{len(ref)} prompts identical over {len(ref[0])} tokens; first divergence per prompt: {firsts}", flush=True)
    return firsts


def small(extra):
    from pagelm.models.testing import build_tiny_model

    d = build_tiny_model(ROOT / "small", "llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (5, 17, 64, 200, 333, 9, 128, 40)]
    ref = run(d, prompts, 128, dtype="float32")
    compare("small fp32 TP=2 vs TP=1", ref, run(d, prompts, 128, dtype="float32", tensor_parallel_size=2))
    for kw in extra:
        compare(f"small fp32 {kw} vs TP=1", ref, run(d, prompts, 128, dtype="float32", **kw))


def write_8b():
    d = ROOT / "llama-3.1-8b"
    if (d / "done").exists():
        return d
    from pagelm.plugins.bench.presets import PRESETS

    cfg = dict(PRESETS["llama-3.1-8b"])
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    h, inter, L, nh, nkv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    index = {}
    first = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h), "lm_head.weight": rnd(cfg["vocab_size"], h),
             "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(first, str(d / "embed.safetensors"))
    index.update({k: "embed.safetensors" for k in first})
    for i in range(L):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_proj.weight": rnd(nh * hd, h), p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
             p + "self_attn.v_proj.weight": rnd(nkv * hd, h), p + "self_attn.o_proj.weight": rnd(h, nh * hd),
             p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
             p + "mlp.down_proj.weight": rnd(h, inter),
             p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        save_file(t, str(d / f"layer{i}.safetensors"))
        index.update({k: f"layer{i}.safetensors" for k in t})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (d / "done").write_text("")
    return d


def big(extra):
    t = time.time()
    d = write_8b()
    print(f"8b checkpoint ready in {time.time() - t:.1f} s", flush=True)
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(10, 128000, (n,), generator=g).tolist()} for n in (128, 128, 512, 31)]
    kw = dict(dtype="bfloat16", max_model_len=4096, skip_tokenizer_init=True)
    ref = run(d, prompts, 256, **kw)
    compare("llama-3.1-8b bf16 TP=2 vs TP=1", ref, run(d, prompts, 256, tensor_parallel_size=2, **kw))
    for e in extra:
        compare(f"llama-3.1-8b bf16 {e} vs TP=1", ref, run(d, prompts, 256, **e, **kw))


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        sys.exit(engine(sys.argv[2]))
    extra = [dict([kv.split("=")]) for kv in sys.argv[2:]]
    extra = [{k: int(v) for k, v in e.items()} for e in extra]
    {"small": small, "8b": big}[sys.argv[1]](extra)
