"""Guided decoding with speculative decoding: a guided request's drafts are cut to what its
grammar allows before they are verified, each of its verification rows is masked with what
the grammar allows after the drafts before it, and what comes out is what guided decoding
gives without drafts (greedy, or seeded sampling) and always follows the constraint."""

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from pagelm import LLM, EngineConfig, GuidedDecodingParams, SamplingParams
from pagelm.plugins.structured_output.xgrammar_backend import XgrammarBackend
from pagelm.request import Request
from pagelm.sample.bitmask import unpack_bitmask
from pagelm.plugins.spec_decode import DraftProposer
from pagelm.plugins.structured_output import GrammarManager
from spec_helpers import count_launches, registered_proposer

EOS = 1  # the tiny tokenizer's <|eos|>
VOCAB = 520  # the tiny model's (wider than its tokenizer's 512)
# The random model would happily emit whitespace between JSON tokens for ever.
ENGINE_ARGS = dict(dtype="float32", block_size=8, plugin_config={"xgrammar": {"any_whitespace": False}})
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 8}, "ok": {"type": "boolean"}},
    "required": ["s", "ok"],
}
# Each constraint with a prompt that repeats text like its output: the n-gram proposer drafts
# from the prompt and from the output's own repeats.
CONSTRAINTS = {
    "json": (dict(json=SCHEMA), '{"s": [1, 2, 1, 2, 1, 2], "ok": true}' * 2),
    "regex": (dict(regex=r"(ab|ba){2,8}c"), "abbaab" * 4),
    "choice": (dict(choice=["la la la la la la", "na na na na na", "no"]), "la la na na " * 3),
}


def follows(constraint: dict, text: str) -> bool:
    if "json" in constraint:
        try:
            jsonschema.validate(json.loads(text), constraint["json"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    return text in constraint["choice"]


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(str(llama_dir), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def spec(llama_dir):
    return LLM(str(llama_dir), speculative_config=NGRAM, **ENGINE_ARGS)


def batch(tokenizer, kind: str, temperature: float, n: int = 6) -> tuple[list[dict], list[SamplingParams]]:
    """``n`` requests under ``kind``'s constraint, half on its repetitive prompt, seeded."""
    constraint, text = CONSTRAINTS[kind]
    prompts = [{"prompt_token_ids": tokenizer.encode(text)}, {"prompt_token_ids": [5, 6, 7]}] * (n // 2)
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=96, guided_decoding=GuidedDecodingParams(**constraint))
        for i in range(n)
    ]
    return prompts, params


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- the same output as guided decoding without drafts ------------------------------------------


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_greedy_guided_output_is_identical_with_ngram_drafts(tokenizer, plain, spec, kind):
    prompts, params = batch(tokenizer, kind, temperature=0.0)
    # An unconstrained request drafting in the same steps: its rows are left alone.
    prompts.append({"prompt_token_ids": [40, 41, 42, 43, 44] * 8})
    params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    constraint = CONSTRAINTS[kind][0]
    assert all(follows(constraint, o.outputs[0].text) and o.outputs[0].finish_reason == "stop" for o in got[:-1])
    assert sum(o.metrics.spec_num_accepted_tokens for o in got) > 0  # drafts were verified, and some kept


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_seeded_sampled_guided_output_is_identical_with_ngram_drafts(tokenizer, plain, spec, kind):
    # n-gram drafts have no probabilities: each row is sampled from the masked target
    # distribution, keyed on (seed, output index) as without drafts.
    prompts, params = batch(tokenizer, kind, temperature=1.0)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert sum(o.metrics.spec_num_accepted_tokens for o in got) > 0


def test_sampled_guided_outputs_with_ngram_drafts_all_follow_their_constraint(tokenizer, spec):
    prompts, params, constraints = [], [], []
    for kind, (constraint, _) in sorted(CONSTRAINTS.items()):
        p, s = batch(tokenizer, kind, temperature=1.0, n=8)
        prompts += p
        params += [SamplingParams(temperature=1.0, max_tokens=96, guided_decoding=x.guided_decoding) for x in s]
        constraints += [constraint] * len(p)
    outs = spec.generate(prompts, params, use_tqdm=False)
    for out, constraint in zip(outs, constraints):
        assert follows(constraint, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].token_ids[-1] == EOS and EOS not in out.outputs[0].token_ids[:-1]
    assert sum(o.metrics.spec_num_accepted_tokens for o in outs) > 0


def test_guided_drafts_under_async_scheduling_give_the_same_tokens(tokenizer, llama_dir, plain):
    # Steps in which adaptive drafting has backed everyone off run ahead (guided sampling
    # deferred until the grammars have the previous tokens); steps verifying drafts run
    # synchronously, with the grammars at their requests' last tokens.
    prompts = [{"prompt_token_ids": tokenizer.encode("abbaab" * 4)}] + [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)]
    params = [SamplingParams(temperature=1.0, seed=0, max_tokens=64, guided_decoding=GuidedDecodingParams(regex=r"(ab|ba){8,16}c"))]
    params += [
        SamplingParams(temperature=1.0, seed=i, max_tokens=64, guided_decoding=GuidedDecodingParams(regex=r"[a-z]{30,40}"))
        for i in range(1, 5)
    ]
    llm = LLM(str(llama_dir), speculative_config={**NGRAM, "max_backoff_steps": 8}, async_scheduling=True, **ENGINE_ARGS)
    core = llm.engine.core
    counts = count_launches(core)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(plain.generate(prompts, params, use_tqdm=False))
    assert counts["ahead"] > 0 and counts["verify"] > 0
    assert got[0].metrics.spec_num_accepted_tokens > 0
    assert re.fullmatch(r"(ab|ba){8,16}c", got[0].outputs[0].text)
    assert all(re.fullmatch(r"[a-z]{30,40}", o.outputs[0].text) for o in got[1:])


# ---- drafts cut by the grammar, accepted where it allows them ---------------------------------


@pytest.fixture
def draft_log(spec):
    """(proposed, kept) for every guided request's drafts the scheduler stores."""
    manager = spec.engine.core.structured_output
    calls = []
    validate = manager.validate_drafts

    def spy(request, drafts):
        kept = validate(request, drafts)
        calls.append((list(drafts), kept))
        return kept

    manager.validate_drafts = spy
    yield calls
    del manager.validate_drafts


def test_a_guided_request_verifies_drafts_its_grammar_allows_and_drops_the_rest(tokenizer, spec, draft_log):
    # The prompt repeats "abcabd": after "ab" the n-gram drafts "d" too, which (abc){6} rejects.
    prompt = {"prompt_token_ids": tokenizer.encode("abcabd" * 3)}
    params = SamplingParams(temperature=0.0, max_tokens=64, guided_decoding=GuidedDecodingParams(regex=r"(abc){6}"))
    out = spec.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].text == "abc" * 6
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == EOS
    m = out.metrics
    assert m.spec_num_draft_tokens > 0 and m.spec_num_accepted_tokens > 0
    d = tokenizer.encode("d")[0]
    cut = [(proposed, kept) for proposed, kept in draft_log if len(kept) < len(proposed)]
    assert any(d in proposed for proposed, _ in cut)
    assert all(kept == proposed[: len(kept)] and d not in kept for proposed, kept in draft_log)
    # Only kept drafts are verified: every drafted token is counted from the kept lists.
    assert m.spec_num_draft_tokens <= sum(len(kept) for _, kept in draft_log)


def test_a_grammar_that_ends_inside_the_drafts_ends_the_request_with_its_eos(tokenizer, spec, draft_log):
    # The prompt has "abc" then EOS: after "ab" the n-gram drafts "c", EOS, ...; EOS is cut
    # (it ends the grammar) and sampled by the target in the row after "c".
    abc = tokenizer.encode("abc")
    prompt = {"prompt_token_ids": (abc + [EOS]) * 3}
    params = SamplingParams(temperature=0.0, max_tokens=16, guided_decoding=GuidedDecodingParams(regex="abc"))
    out = spec.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].text == "abc" and out.outputs[0].token_ids == abc + [EOS]
    assert out.outputs[0].finish_reason == "stop"
    assert (abc[1:] + [EOS] + abc[:1], abc[1:]) in draft_log
    assert out.metrics.spec_num_accepted_tokens == len(abc) - 1


def test_max_tokens_ends_a_guided_request_with_drafts_at_the_same_token(tokenizer, plain, spec):
    prompt = {"prompt_token_ids": tokenizer.encode("abcabd" * 3)}
    params = SamplingParams(temperature=0.0, max_tokens=7, guided_decoding=GuidedDecodingParams(regex=r"(abc){6}"))
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = spec.generate([prompt], params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.token_ids and len(want.token_ids) == 7
    assert got.outputs[0].finish_reason == "length"
    assert got.metrics.spec_num_accepted_tokens > 0


# ---- the grammar's side: validating drafts, the rows of a verification step --------------------


@pytest.fixture
def manager(llama_dir):
    config = EngineConfig(model=str(llama_dir), max_num_seqs=4, **ENGINE_ARGS)
    manager = GrammarManager(config, XgrammarBackend, VOCAB, frozenset([EOS]))
    yield manager
    manager.shutdown()


def guided_request(manager, req_id: str, **constraint) -> Request:
    params = SamplingParams(max_tokens=64, guided_decoding=GuidedDecodingParams(**constraint))
    request = Request(req_id, [5], params, eos_token_ids=frozenset([EOS]))
    manager.submit(request)
    while manager.has_pending:
        manager.poll(1.0)
    assert request.grammar is not None
    return request


def allowed(grammar) -> torch.Tensor:
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, VOCAB)[0]


@pytest.mark.parametrize("applied", [False, True])
def test_validate_drafts_keeps_the_longest_prefix_the_grammar_allows(manager, tokenizer, applied):
    request = guided_request(manager, "r", regex="[0-9]{6}")
    manager.accept_tokens(request, tokenizer.encode("1"))  # sampled this step
    if applied:  # the grammar took it already (the step loop's prepare_bitmask)
        manager.prepare_bitmask()
        manager.grammar_bitmask(["r"])
    before = allowed(request.grammar)
    drafts = tokenizer.encode("23") + tokenizer.encode("x") + tokenizer.encode("4")
    assert manager.validate_drafts(request, drafts) == tokenizer.encode("23")
    assert manager.validate_drafts(request, tokenizer.encode("x9")) == []
    assert torch.equal(allowed(request.grammar), before)  # the grammar did not move


def test_validate_drafts_cuts_at_the_stop_token_that_ends_the_grammar(manager, tokenizer):
    request = guided_request(manager, "r", regex="abc")
    ab, c = tokenizer.encode("abc")
    manager.accept_tokens(request, [ab])
    assert manager.validate_drafts(request, [c, EOS, ab]) == [c]
    assert manager.validate_drafts(request, [c, ab]) == [c]


def test_draft_rows_allow_what_follows_each_prefix_of_the_drafts(manager, tokenizer):
    digits = guided_request(manager, "digits", regex="[0-9]{4}")
    obj = guided_request(manager, "obj", json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    word = guided_request(manager, "word", regex="[a-z]{2,3}")
    drafts = [tokenizer.encode("12"), [], tokenizer.encode('{"a')]
    rows = unpack_bitmask(manager.grammar_bitmask(["digits", "word", "obj"], drafts).clone(), VOCAB)
    assert rows.shape[0] == (1 + 2) + 1 + (1 + len(drafts[2]))
    expected = []
    for request, d in zip([digits, word, obj], drafts):
        replay = manager.cache.get(request_key(request)).new_grammar()  # a fresh matcher
        expected.append(allowed(replay))
        for token in d:
            assert replay.accept_tokens([token])
            expected.append(allowed(replay))
    assert [r.tolist() for r in rows] == [e.tolist() for e in expected]
    # Rolled back: each grammar is where it was, at the start.
    assert all(torch.equal(allowed(r.grammar), rows[i]) for r, i in [(digits, 0), (word, 3), (obj, 4)])


def request_key(request: Request) -> tuple[str, str]:
    params = request.sampling_params.guided_decoding
    return params.kind, params.spec


@pytest.mark.parametrize("second", ["x", "<eos>"])
def test_drafts_not_validated_leave_the_rows_after_a_rejected_or_stop_token_unconstrained(manager, tokenizer, second):
    # A bug upstream, not a crash: a rejected draft is ruled out by the row before it (the
    # rejection sampler stops there), a stop token ends the request; the rows after either
    # are never emitted.
    request = guided_request(manager, "r", regex="[0-9]{1,4}")
    one, two = tokenizer.encode("1") + tokenizer.encode("2")
    drafts = [one, EOS if second == "<eos>" else tokenizer.encode("x")[0], two]
    rows = unpack_bitmask(manager.grammar_bitmask(["r"], [drafts]).clone(), VOCAB)
    assert rows[1, drafts[1]] == (second == "<eos>")  # after "1": EOS is allowed, "x" is not
    assert rows[2:].all()
    assert torch.equal(allowed(request.grammar), rows[0])


class AlwaysZ(DraftProposer):
    """Drafts ``z`` k times: a token the test's grammar never allows."""

    name = "always_z"

    def propose(self, batch):
        return [[self.speculative.options["token"]] * int(m) for m in batch.max_num_drafts]


@pytest.fixture()
def always_z():
    with registered_proposer(AlwaysZ):
        yield


def test_drafts_the_grammar_always_cuts_back_the_request_off(tokenizer, llama_dir, always_z):
    """Drafts cut to nothing before verification are misses for adaptive drafting, as
    rejected ones are: the request stops being drafted for (and, under async scheduling,
    stops keeping the engine synchronous)."""
    z = tokenizer.encode("z")[0]
    spec = {"method": "always_z", "num_speculative_tokens": 3, "token": z}
    llm = LLM(str(llama_dir), speculative_config=spec, **ENGINE_ARGS)
    runner = llm.engine.core.runner
    proposals = []
    propose = runner.spec.proposer.propose
    runner.spec.proposer.propose = lambda batch: proposals.append(int(batch.max_num_drafts.sum())) or propose(batch)
    params = SamplingParams(temperature=0.0, max_tokens=100, guided_decoding=GuidedDecodingParams(regex=r"(ab|cd){10,40}x"))
    out = llm.generate([{"prompt_token_ids": tokenizer.encode("abcd" * 3)}], params, use_tqdm=False)[0]
    assert re.fullmatch(r"(ab|cd){10,40}x", out.outputs[0].text)
    assert out.metrics.spec_num_draft_tokens == 0  # every draft was cut, none verified
    steps_with_drafts = sum(1 for n in proposals if n > 0)
    # Two misses, then probes after 2, 4, 8, ... steps: a few of the ~80 steps, not all.
    assert 0 < steps_with_drafts <= 12, proposals
    assert runner.spec.proposer.backoff.num_skipped > 0
