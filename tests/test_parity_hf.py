"""Token-for-token parity with Hugging Face transformers greedy decoding, float32, on CPU."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagelm import LLM, SamplingParams

MAX_TOKENS = 12

ARCHS = {
    "llama": dict(arch="llama"),
    "llama_sharded_tied_llama3rope": dict(
        arch="llama",
        sharded=True,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "mistral": dict(arch="mistral"),
}


def prompts(vocab_size, seed=0):
    """Mixed lengths, including one spanning several 16-token blocks."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab_size, (n,), generator=gen).tolist() for n in (3, 17, 70, 9, 33)]


def hf_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_tokens_and_logprobs_match_transformers(make_model, name):
    spec = dict(ARCHS[name])
    model_dir = make_model(name, spec.pop("arch"), **spec)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = prompts(hf.config.vocab_size)

    llm = LLM(str(model_dir), dtype="float32", block_size=16)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2),
        use_tqdm=False,
    )
    for prompt, out in zip(batch, outs):
        completion = out.outputs[0]
        with torch.no_grad():
            expected = hf_greedy(hf, prompt, MAX_TOKENS)
            assert completion.token_ids == expected
            full = torch.tensor([prompt + expected])
            ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        for i, (tok, entry) in enumerate(zip(expected, completion.logprobs)):
            ref_lp = ref[len(prompt) - 1 + i, tok].item()
            assert entry[tok].logprob == pytest.approx(ref_lp, abs=1e-4)
            assert entry[tok].rank == 1
    assert llm.engine.core.kv_cache_manager.num_free_blocks == llm.engine.core.num_kv_blocks
