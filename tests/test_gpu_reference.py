"""The torch reference backend on CUDA: same greedy tokens as transformers, bf16 and fp32."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagelm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_float32_greedy_matches_transformers(make_model, arch):
    model_dir = make_model(f"gpu_{arch}", arch)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 17)]
    llm = LLM(str(model_dir), device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(p):].tolist()
    core = llm.engine.core
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


def test_cuda_bfloat16_runs_and_agrees_mostly(make_model):
    model_dir = make_model("gpu_llama_bf16", "llama")
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    prompt = list(range(5, 60))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1]
    assert out[0].outputs[0].token_ids[0] == int(logits.argmax())
