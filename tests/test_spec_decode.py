"""Speculative decoding through the engine: it never changes what comes out (greedy tokens on
every model family, seeded samples, stop strings), it speeds up where drafts are good (n-gram
on repetitive text, a trained EAGLE head), and it is configured and reported like the rest."""

import json
import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.config import EngineConfig
from pagelm.engine.core_loop import SchedulerStats
from pagelm.plugins.engine_args import add_engine_args, engine_kwargs
from pagelm.plugins.metrics.prometheus import PrometheusStatLogger
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.spec_decode import DraftProposer
from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head
from pagelm.testing.conformance import check_proposer

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# The engine tests need a working head, not a good one: the trainer's initialisation (the
# target's first layer) without training.
UNTRAINED = EagleTrainConfig(steps=0)


@pytest.fixture(scope="module")
def eagle_head(make_model, tmp_path_factory):
    """eagle_head(arch) -> (target dir, head dir), trained once per module."""
    heads = {}

    def get(arch):
        if arch not in heads:
            target = make_model(f"spec_{arch}", arch)
            out = tmp_path_factory.mktemp(f"eagle_{arch}")
            train_eagle_head(target, out, UNTRAINED, log=lambda *_: None)
            heads[arch] = (target, out)
        return heads[arch]

    return get


def run(model_dir, prompts, params=GREEDY, **kw):
    llm = LLM(str(model_dir), dtype="float32", block_size=8, **kw)
    return llm, llm.generate(prompts, params, use_tqdm=False)


# ---- never changes the output ---------------------------------------------------------------


@pytest.mark.parametrize("arch", FAMILIES)
def test_ngram_greedy_output_is_identical_on_every_family(make_model, arch):
    stats = check_proposer("ngram", make_model(f"spec_{arch}", arch), NGRAM)
    assert stats["num_accepted_tokens"] > 0


@pytest.mark.parametrize("arch", FAMILIES)
def test_eagle_greedy_output_is_identical_on_every_family(eagle_head, arch):
    target, head = eagle_head(arch)
    check_proposer("eagle", target, {"model": str(head)})


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(make_model):
    model = make_model("spec_llama", "llama")
    # The second prompt holds most of the vocabulary, so that the n-gram proposer (one token
    # of match) finds drafts after most sampled tokens, whatever the seeds draw.
    prompts = [{"prompt_token_ids": [11, 12, 13] * 6}, {"prompt_token_ids": list(range(30, 330))}]
    params = [
        SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, frequency_penalty=0.5, repetition_penalty=1.2,
                       min_tokens=6, seed=3, max_tokens=24),
    ]
    _, want = run(model, prompts, params)
    llm, got = run(model, prompts, params, speculative_config=NGRAM)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.core.scheduler.spec_decoding_stats.num_drafts > 0


def test_logprobs_come_per_accepted_token(make_model):
    model = make_model("spec_llama", "llama")
    prompts = [{"prompt_token_ids": [11, 12, 13] * 6}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    _, want = run(model, prompts, params)
    _, got = run(model, prompts, params, speculative_config=NGRAM)
    want_lps, got_lps = want[0].outputs[0].logprobs, got[0].outputs[0].logprobs
    assert len(got_lps) == len(got[0].outputs[0].token_ids) == 16
    for w, g in zip(want_lps, got_lps):
        assert list(w) == list(g)
        assert all(abs(w[t].logprob - g[t].logprob) < 1e-4 for t in w)


def test_a_stop_string_inside_an_accepted_run_ends_the_request_there(make_model):
    model = str(make_model("spec_llama", "llama"))
    prompt = [{"prompt_token_ids": [11, 12, 13] * 6}]
    plain = LLM(model, dtype="float32", block_size=8)
    spec = LLM(model, dtype="float32", block_size=8, speculative_config=NGRAM)
    emitted = []  # tokens the engine core sent, before the stop string cut them
    core_step = spec.engine.core.step
    spec.engine.core.step = lambda: [emitted.extend(o.new_token_ids) or o for o in core_step()]
    text = plain.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
    cut_inside_a_run = 0
    for offset in range(2, len(text) - 3, 3):
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[text[offset : offset + 3]])
        want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        emitted.clear()
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason
        )
        cut_inside_a_run += len(emitted) > len(got.token_ids)
    assert cut_inside_a_run > 0, "no stop string landed inside a run of accepted drafts"


# ---- speeds up where drafts are good --------------------------------------------------------


def test_ngram_accepts_drafts_on_a_repetitive_prompt_and_reports_them(make_model):
    model = make_model("spec_llama", "llama")
    prompt = {"prompt_token_ids": [40, 41, 42, 43, 44] * 8}
    llm, outs = run(model, [prompt], speculative_config=NGRAM)
    m = outs[0].metrics
    assert m.spec_num_drafts > 0 and m.spec_num_draft_tokens >= m.spec_num_drafts
    assert m.spec_num_accepted_tokens > 0
    assert m.spec_mean_acceptance_length == pytest.approx(1 + m.spec_num_accepted_tokens / m.spec_num_drafts)
    # Fewer verification steps than tokens: speculation saved target passes.
    assert m.spec_num_drafts < len(outs[0].outputs[0].token_ids) - 1


def test_a_trained_eagle_head_accepts_more_than_half_a_token_per_draft(make_model, tmp_path):
    target = make_model("spec_llama_1layer", "llama", num_hidden_layers=1)
    cfg = EagleTrainConfig(num_prompts=16, prompt_len=12, gen_len=24, steps=10, eval_every=5)
    report = train_eagle_head(target, tmp_path / "head", cfg, log=lambda *_: None)
    assert report["agreement"] >= report["initial_agreement"]
    prompts = [{"prompt_token_ids": list(range(20 + 9 * i, 36 + 9 * i))} for i in range(4)]
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head")}
    llm, outs = run(target, prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                    speculative_config=spec)
    stats = llm.engine.core.scheduler.spec_decoding_stats
    assert stats.mean_acceptance_length > 1.5, stats


# ---- configured and reported like the rest --------------------------------------------------


def test_unknown_method_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match=r"'lookahead' is not a registered proposer; registered: .*eagle.*medusa.*ngram"):
        LLM(str(llama_dir), speculative_config={"method": "lookahead", "num_speculative_tokens": 2})


def test_eagle_without_a_model_is_a_clear_error(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="eagle needs 'model'"):
        LLM(str(llama_dir), speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="is not an EAGLE head directory"):
        LLM(str(llama_dir), speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path)})


@pytest.mark.parametrize("bad,message", [
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": 2}, "method must name a proposer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ("ngram", "must be a mapping"),
])
def test_malformed_speculative_config_is_rejected_before_loading(llama_dir, bad, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), speculative_config=bad)


def test_ngram_lookup_range_is_checked(llama_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"):
        LLM(str(llama_dir), speculative_config=spec)


def test_speculative_config_is_a_json_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert engine_kwargs(args)["speculative_config"] == NGRAM


def test_prometheus_exposes_acceptance_counters():
    m = PrometheusStatLogger(EngineConfig(model="tiny"), "tiny", 512, SchedulerStats(num_kv_blocks=8))
    m.record(SchedulerStats(num_kv_blocks=8, spec_num_drafts=2, spec_num_draft_tokens=6,
                            spec_num_accepted_tokens=3, spec_num_accepted_tokens_per_pos=[2, 1, 0]))
    m.record(SchedulerStats(num_kv_blocks=8, spec_num_drafts=3, spec_num_draft_tokens=9,
                            spec_num_accepted_tokens=5, spec_num_accepted_tokens_per_pos=[3, 2, 0]))
    text = generate_latest(m.registry).decode()
    samples = {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == 3
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == 9
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == 5
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "1")] == 2


class RepeatLastToken(DraftProposer):
    """Drafts the last token again, k times: right on runs of one token, wrong elsewhere."""

    name = "repeat_last"

    def propose(self, batch):
        return [[int(batch.token_ids[i, n - 1])] * int(m) for i, (n, m) in enumerate(zip(batch.num_tokens, batch.max_num_drafts))]


def test_hook_pagelm_register_proposers(llama_dir):
    class P:
        @hookimpl
        def pagelm_register_proposers(self, registry):
            registry.add(RepeatLastToken.name, RepeatLastToken)

    get_plugin_manager().register(P(), name="test-repeat-last")
    try:
        stats = check_proposer("repeat_last", llama_dir)
    finally:
        get_plugin_manager().unregister("test-repeat-last")
    assert stats["num_drafts"] > 0


def test_guided_requests_verify_drafts_next_to_plain_ones_and_keep_their_grammar(make_model):
    from pagelm import GuidedDecodingParams

    model = make_model("spec_llama", "llama")
    repetitive = {"prompt_token_ids": [40, 41, 42, 43, 44] * 8}
    guided = SamplingParams(temperature=1.0, seed=1, max_tokens=64, guided_decoding=GuidedDecodingParams(regex=r"[ab]{3,9}c"))
    llm = LLM(str(model), dtype="float32", block_size=8, speculative_config=NGRAM)
    outs = llm.generate([repetitive, repetitive], [GREEDY, guided], use_tqdm=False)
    assert outs[0].metrics.spec_num_accepted_tokens > 0  # drafts verified next to the guided rows
    assert outs[1].outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"[ab]{3,9}c", outs[1].outputs[0].text)
