"""Integer sampling parameters fit a signed 64-bit integer (they cross the engine-core wire
and become torch.long tensors); a top_k beyond the vocabulary keeps every token."""

import pytest

from pagelm import LLM, SamplingParams


@pytest.mark.parametrize("name, value", [
    ("top_k", 2**63), ("seed", 2**64 - 1), ("seed", -(2**63) - 1), ("max_tokens", 2**63),
    ("n", True), ("logprobs", 2**70),
])
def test_integers_outside_int64_are_rejected_naming_the_parameter(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SamplingParams(**{name: value})


def test_top_k_at_the_int64_limit_samples_like_no_top_k(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu")
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]

    def sample(top_k):
        params = SamplingParams(temperature=1.0, seed=1234, top_k=top_k, max_tokens=8, ignore_eos=True)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    assert sample(2**63 - 1) == sample(0) == sample(llm.engine.vocab_size)
