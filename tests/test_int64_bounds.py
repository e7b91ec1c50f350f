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


def test_n_children_of_a_seed_at_the_int64_limit_all_run(llama_dir):
    """seed = 2**63 - 1 with n = 2 once gave the second child 2**63, which failed on its way to
    the engine core while the first kept generating for nobody."""
    llm = LLM(str(llama_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=1.0, seed=2**63 - 1, n=3, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [4, 4, 4]
    kv = llm.engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_an_n_request_is_queued_whole_or_not_at_all(llama_dir):
    """A child the engine core refuses takes its queued siblings back out: nothing keeps
    generating for a request that failed."""
    llm = LLM(str(llama_dir), dtype="float32", device="cpu")
    engine = llm.engine
    real_add = engine.core.add_request
    calls = []

    def refuse_third(request):
        calls.append(request.request_id)
        if len(calls) == 3:
            raise RuntimeError("the wire refused it")
        real_add(request)

    engine.core.add_request = refuse_third
    params = SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=1)
    with pytest.raises(RuntimeError, match="refused"):
        engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    engine.core.add_request = real_add
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.states and not engine.output_processor.parent_children
    # The id is free again and the engine serves the next request whole.
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4


def test_logprobs_beyond_max_logprobs_are_rejected_naming_the_parameter(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", max_logprobs=3)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name} must be at most 3"):
            llm.generate(prompt, SamplingParams(max_tokens=2, **{name: 4}), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)[0]
    assert all(len(lp) >= 3 for lp in out.outputs[0].logprobs)
