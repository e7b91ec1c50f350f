"""The offline API: outputs' shape, stop handling, logprobs, chat, validation errors."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagelm import LLM, SamplingParams
from pagelm.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", block_size=8)


def free_blocks_back(llm):
    core = llm.engine.core
    return core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


def test_request_output_fields(llm):
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert out.request_id == "0" or out.request_id.isdigit()
    assert out.prompt == "def add(a, b):"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("def add(a, b):")
    assert out.finished
    c = out.outputs[0]
    assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_outputs_come_back_in_prompt_order(llm):
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (30, 2, 11)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]


def test_stop_string_is_cut_and_reported(llm):
    base = llm.generate("x = ", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    stop = text[3:5]
    assert stop.strip(), f"greedy text too short to pick a stop string from: {text!r}"
    out = llm.generate("x = ", SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.find(stop)]
    kept = llm.generate(
        "x = ", SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.find(stop) + len(stop)]
    assert free_blocks_back(llm)


def test_stop_token_ids_end_the_request(llm):
    base = llm.generate("y", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    ids = base[0].outputs[0].token_ids
    out = llm.generate("y", SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[ids[2]]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == ids[: ids.index(ids[2]) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == ids[2]


def test_the_stop_token_text_is_left_out_unless_asked_for(llm):
    """As in vLLM: the token that ended the request (EOS, or one of stop_token_ids) adds no
    text, even with skip_special_tokens=False; include_stop_str_in_output keeps it."""
    tokenizer = llm.get_tokenizer()
    base = llm.generate("y", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    ids = base[0].outputs[0].token_ids
    stop = ids[2]
    kept = ids[: ids.index(stop) + 1]
    left_out = llm.generate("y", SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop]), use_tqdm=False)
    included = llm.generate(
        "y", SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert left_out[0].outputs[0].token_ids == included[0].outputs[0].token_ids == kept
    assert included[0].outputs[0].text == tokenizer.decode(kept)
    assert left_out[0].outputs[0].text == tokenizer.decode(kept[:-1])
    eos = tokenizer.eos_token_id
    for skip in (True, False):
        out = llm.generate(
            "y", SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[eos], skip_special_tokens=skip,
                                logit_bias={eos: 100}),
            use_tqdm=False,
        )
        c = out[0].outputs[0]
        assert c.token_ids == [eos] and c.text == "", (skip, c)


def test_prompt_logprobs_match_transformers(llm, llama_dir):
    prompt = list(range(20, 45))
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=1, prompt_logprobs=3),
        use_tqdm=False,
    )[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert len(entry) >= 3


def test_prompt_logprobs_survive_chunked_prefill(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, max_num_batched_tokens=6)
    prompt = list(range(20, 45))
    chunked = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    whole = LLM(str(llama_dir), dtype="float32", block_size=8).generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    a = [None if e is None else e[t].logprob for e, t in zip(chunked[0].prompt_logprobs, prompt)]
    b = [None if e is None else e[t].logprob for e, t in zip(whole[0].prompt_logprobs, prompt)]
    assert a[0] is None and a[1:] == pytest.approx(b[1:], abs=1e-5)


def test_cumulative_logprob_is_the_sum(llm):
    c = llm.generate("z", SamplingParams(max_tokens=4, logprobs=0, temperature=0), use_tqdm=False)[0].outputs[0]
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert out.prompt.endswith("<|im_start|>assistant\n")


def test_eos_from_generation_config_stops(llm):
    assert llm.engine.core.eos_token_ids == frozenset({llm.get_tokenizer().eos_token_id})


def test_penalties_change_greedy_output(llm):
    prompt = {"prompt_token_ids": [7] * 20}
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    penal = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=2.0,
                               frequency_penalty=2.0), use_tqdm=False,
    )
    assert penal[0].outputs[0].token_ids != plain[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logprobs=-2), "logprobs"),  # -1 is the whole vocabulary
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


def test_prompt_longer_than_max_model_len_is_rejected_and_nothing_is_queued(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": list(range(5, 45))}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_token_ids_outside_vocab_are_rejected(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)


def test_max_model_len_bounds_output(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=20)
    out = llm.generate({"prompt_token_ids": list(range(5, 15))}, SamplingParams(max_tokens=50, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10 and out[0].outputs[0].finish_reason == "length"


def test_pool_smaller_than_max_model_len_is_a_startup_error(llama_dir):
    with pytest.raises(ValueError, match="less than one max_model_len=64 sequence; lower max_model_len"):
        LLM(str(llama_dir), num_kv_blocks=2, block_size=8, max_model_len=64)


def test_unknown_engine_argument_is_named(llama_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(llama_dir), max_num_seq=4)


def test_unknown_backend_lists_registered(llama_dir):
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; registered: .*torch"):
        LLM(str(llama_dir), attention_backend="flash")


def test_incremental_detokenizer_emits_whole_multibyte_characters(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    text = "naïve café — 日本語 😀 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = []
    for t in ids:
        before = detok.output_text
        detok.update([t])
        pieces.append(detok.output_text[len(before):])
    assert detok.output_text == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces), "some token should have held back a partial character"


def test_detokenizer_finds_stop_string_spanning_tokens(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = tok.encode("return value\nEND of it")
    detok = IncrementalDetokenizer(tok, [], stop=["\nEND"])
    hit = None
    for t in ids:
        hit = hit or detok.update([t])
    assert hit == "\nEND" and detok.output_text == "return value"


def test_every_forward_pass_runs_in_inference_mode(llm):
    """No autograd on the serving path: a step's forward pass (prefill and decode) runs under
    torch.inference_mode, so it records no graph and its tensors stay plain inference
    tensors (FlashInfer's plan buffers, for one, must be written in the same mode)."""
    model = llm.engine.core.runner.model
    modes = []
    handle = model.register_forward_hook(lambda m, args, out: modes.append((torch.is_inference_mode_enabled(), out.requires_grad)))
    try:
        llm.generate(["hello there"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        handle.remove()
    assert len(modes) == 3 and all(m == (True, False) for m in modes), modes
