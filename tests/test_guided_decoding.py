"""Guided decoding: outputs follow their JSON schema, regex, choice or grammar even from a tiny
random model that knows nothing about JSON; grammars compile off the step loop, are cached,
time out and fail alone; unconstrained requests in the same batch are untouched."""

import ast
import json
import re
import threading

import jsonschema
import pytest
import torch

from pagelm import LLM, GuidedDecodingParams, SamplingParams, hookimpl
from pagelm.engine.core_loop import decode_request, encode_request
from pagelm.plugin_manager import get_plugin_manager
from pagelm.registry import PluginError, UnknownNameError
from pagelm.request import Request, RequestStatus
from pagelm.sample.bitmask import unpack_bitmask
from pagelm.plugins.structured_output import CompiledGrammar, GrammarBackend, GrammarCache, StructuredOutputGrammar

SAMPLES = 20
# The random model would happily emit whitespace between JSON tokens for ever.
ENGINE_ARGS = dict(dtype="float32", plugin_config={"xgrammar": {"any_whitespace": False}})
PROMPT = {"prompt_token_ids": [5, 6, 7]}
EOS = 1  # the tiny tokenizer's <|eos|>


def guided(**constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=256, guided_decoding=GuidedDecodingParams(**constraint))


def texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), **ENGINE_ARGS)


# ---- outputs follow their constraint ----------------------------------------------------------

# Short keys: every forced character is a decoding step for a model that knows no words.
# Strings are ASCII patterns: xgrammar 0.2.8 lets overlong UTF-8 (e0 9d a9) through, which a
# random model emits and which decodes to U+FFFD characters (breaking maxLength counts).
SCHEMAS = {
    "nested_objects_required_fields": {
        "type": "object",
        "properties": {
            "u": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "nm": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
                "required": ["id", "nm"],
            },
            "ok": {"type": "boolean"},
            "note": {"type": "string", "pattern": "^[A-Z][a-z]?$"},
        },
        "required": ["u", "ok"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "s": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1, "maxItems": 3},
            "p": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}, "maxItems": 2},
        },
        "required": ["s", "p"],
    },
    "enums": {
        "type": "object",
        "properties": {"c": {"enum": ["red", "blue"]}, "s": {"type": "string", "enum": ["S", "XL"]}, "k": {"enum": [1, 2.5, None]}},
        "required": ["c", "s", "k"],
    },
    "numbers_with_bounds": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
            "m": {"type": "integer", "minimum": -5, "exclusiveMaximum": 5},
        },
        "required": ["x", "n", "m"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "pattern": "^[a-z0-9]{1,3}$"}, "v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_parses_and_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    outs = llm.generate([PROMPT] * SAMPLES, guided(json=schema), use_tqdm=False)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        # The grammar completed: EOS was allowed only there, and ended the request.
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].token_ids[-1] == EOS and EOS not in out.outputs[0].token_ids[:-1]


def test_json_object_output_is_an_object(llm):
    # Unbounded strings rarely end in a random model: check what was written is an object so far.
    outs = llm.generate([PROMPT] * 4, guided(json_object=True), use_tqdm=False)
    for text, out in zip(texts(outs), outs):
        assert text.startswith("{")
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_regex_outputs_match_fully(llm):
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    outs = llm.generate([PROMPT] * SAMPLES, guided(regex=pattern), use_tqdm=False)
    assert all(re.fullmatch(pattern, t) for t in texts(outs)), texts(outs)


def test_choice_outputs_are_in_the_set(llm):
    choices = ["yes", "no", "maybe so", 'say "hi"\n']
    outs = llm.generate([PROMPT] * SAMPLES, guided(choice=choices), use_tqdm=False)
    assert set(texts(outs)) <= set(choices)
    assert len(set(texts(outs))) > 1  # sampled, not stuck on one


# Parentheses nest one level deep: a random model would otherwise open them for ever.
ARITHMETIC = r"""
root   ::= expr
expr   ::= term (ws ("+" | "-") ws term){0,2}
term   ::= factor (ws ("*" | "/") ws factor){0,2}
factor ::= number | "(" inner ")"
inner  ::= number (ws ("+" | "-" | "*" | "/") ws number){0,2}
number ::= [1-9] [0-9]{0,2}
ws     ::= " "?
"""


def test_ebnf_arithmetic_outputs_parse(llm):
    outs = llm.generate([PROMPT] * SAMPLES, guided(grammar=ARITHMETIC), use_tqdm=False)
    for text in texts(outs):
        tree = ast.parse(text, mode="eval")
        assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.operator)) for n in ast.walk(tree)), text


def test_max_tokens_mid_structure_finishes_with_length(llm):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 50}
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, guided_decoding=GuidedDecodingParams(json=schema)), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 5


def test_n_samples_each_follow_the_grammar(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=64, guided_decoding=GuidedDecodingParams(regex=r"[0-9]{3}-[a-z]{2}"))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text) for c in out.outputs)


# ---- unconstrained requests pay nothing and see nothing --------------------------------------


def test_unconstrained_outputs_are_identical_with_constrained_requests_in_the_batch(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2
    plain += [SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)]
    prompts = [{"prompt_token_ids": [5 + i, 9, 11]} for i in range(3)]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = [guided(json=SCHEMAS["arrays"]), guided(regex=r"[a-z]{5}"), guided(choice=["a", "b"])]
    mixed = llm.generate(prompts + [PROMPT] * 3, plain + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]


def test_unconstrained_steps_ask_for_no_bitmask(llm):
    scheduled = []
    scheduler = llm.engine.core.scheduler
    original = scheduler.schedule

    def spy():
        out = original()
        scheduled.append(list(out.structured_output_request_ids))
        return out

    scheduler.schedule = spy
    try:
        llm.generate([PROMPT] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        del scheduler.schedule
    assert scheduled and all(ids == [] for ids in scheduled)


# ---- bad constraints fail alone, with a clear error --------------------------------------------

BAD = [
    (dict(json={"type": "objekt"}), r"guided_decoding\.json: invalid JSON schema: .*objekt"),
    (dict(json='{"type": "object",'), r"guided_decoding\.json is not valid JSON"),
    (dict(regex="(ab"), r"guided_decoding\.regex: invalid regex: .*parenthesis"),
    (dict(grammar="root ::= foo"), r"guided_decoding\.grammar: invalid EBNF grammar: .*foo"),
]


@pytest.mark.parametrize("constraint, message", BAD)
def test_invalid_constraint_raises_before_anything_is_queued(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4), guided(**constraint)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.core.scheduler.requests


def test_guided_decoding_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="guided_decoding.choice"):
        GuidedDecodingParams(choice=[])


def test_a_constraint_that_fails_to_compile_fails_only_its_request(llm, monkeypatch):
    from pagelm.plugins.structured_output.xgrammar_backend import XgrammarBackend

    # Let the bad schema past the arrival check, so the engine core's compile meets it.
    monkeypatch.setattr(XgrammarBackend, "validate_request", classmethod(lambda cls, params: None))
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPT], plain, use_tqdm=False)
    outs = llm.generate([PROMPT, PROMPT, PROMPT], [guided(json={"type": "objekt"}), plain, guided(regex="[0-9]{2}")], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert re.search(r"guided_decoding\.json: invalid JSON schema: .*objekt", outs[0].error)
    assert outs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert re.fullmatch(r"[0-9]{2}", outs[2].outputs[0].text) and outs[2].error is None
    core = llm.engine.core
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


def big_schema(tag: str) -> dict:
    props = {
        f"{tag}{i}": {
            "type": "object",
            "properties": {f"g{j}": {"type": "string", "pattern": "[a-z]{3,9}[0-9]+"} for j in range(20)},
            "required": [f"g{j}" for j in range(20)],
        }
        for i in range(30)
    }
    return {"type": "object", "properties": props, "required": list(props)}


def test_a_compile_past_the_time_limit_fails_its_request_and_is_cached_when_done(llm, monkeypatch):
    manager = llm.engine.core.structured_output
    schema = big_schema("slow")
    monkeypatch.setattr(manager, "timeout", 0.001)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    slow, fine = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(json=schema)), plain], use_tqdm=False)
    assert slow.outputs[0].finish_reason == "error" and "structured_output_compile_timeout" in slow.error
    assert len(fine.outputs[0].token_ids) == 8
    monkeypatch.setattr(manager, "timeout", 60.0)
    again = llm.generate([PROMPT], SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(json=schema)), use_tqdm=False)[0]
    assert again.outputs[0].finish_reason == "length" and again.outputs[0].text.startswith('{"slow0": {"g0": "'[:4])


# ---- asynchronous compile and the cache --------------------------------------------------------


def test_a_schema_seen_before_is_served_from_the_cache(llm, monkeypatch):
    manager = llm.engine.core.structured_output
    compiled = []
    compile_ = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda params: compiled.append(params.kind) or compile_(params))
    params = guided(json={"type": "object", "properties": {"cached_once": {"type": "boolean"}}, "required": ["cached_once"]})
    first = llm.generate([PROMPT] * 3, params, use_tqdm=False)  # three requests, one compile
    second = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert compiled == ["json"]
    assert all(json.loads(t)["cached_once"] in (True, False) for t in texts(first) + texts(second))


class _Sized(CompiledGrammar):
    def __init__(self, nbytes):
        self.nbytes = nbytes

    @property
    def memory_size_bytes(self):
        return self.nbytes

    def new_grammar(self):
        raise NotImplementedError


def test_grammar_cache_is_bounded_by_bytes_evicting_least_recently_used():
    cache = GrammarCache(max_bytes=100)
    cache.put(("json", "a"), _Sized(40))
    cache.put(("json", "b"), _Sized(40))
    assert cache.get(("json", "a")) is not None  # a is now the most recently used
    cache.put(("json", "c"), _Sized(40))
    assert ("json", "b") not in cache and ("json", "a") in cache and ("json", "c") in cache
    assert cache.nbytes == 80
    cache.put(("json", "huge"), _Sized(500))  # larger than the bound: not kept
    assert ("json", "huge") not in cache and cache.nbytes <= 100


class ScriptedGrammar(StructuredOutputGrammar):
    """Allows exactly ``script`` then EOS."""

    def __init__(self, script):
        self.script, self.accepted = script + [EOS], []

    def accept_tokens(self, token_ids):
        want = self.script[len(self.accepted) : len(self.accepted) + len(token_ids)]
        if list(token_ids) != want:
            return False
        self.accepted += token_ids
        return True

    def rollback(self, num_tokens):
        del self.accepted[len(self.accepted) - num_tokens :]

    def fill_bitmask(self, bitmask, row):
        token = self.script[len(self.accepted)]
        bitmask[row] = 0
        bitmask[row, token // 32] = 1 << (token % 32)

    def is_terminated(self):
        return len(self.accepted) == len(self.script)


class ScriptedCompiled(CompiledGrammar):
    def __init__(self, script):
        self.script = script

    @property
    def memory_size_bytes(self):
        return 8 * len(self.script)

    def new_grammar(self):
        return ScriptedGrammar(list(self.script))


class ScriptedBackend(GrammarBackend):
    """Test backend: ``grammar="7 8 9"`` forces those token ids; compiles wait for ``release``."""

    name = "scripted"
    release = threading.Event()

    def compile(self, params):
        assert self.release.wait(30)
        return ScriptedCompiled([int(t) for t in params.grammar.split()])


@pytest.fixture
def scripted(llama_dir):
    class Plugin:
        @hookimpl
        def pagelm_register_structured_output_backends(self, registry):
            registry.add(ScriptedBackend.name, ScriptedBackend)

    get_plugin_manager().register(Plugin(), name="test-scripted-backend")
    ScriptedBackend.release.clear()
    try:
        yield LLM(str(llama_dir), dtype="float32", structured_output_backend="scripted")
    finally:
        ScriptedBackend.release.set()
        get_plugin_manager().unregister("test-scripted-backend")


def test_hook_pagelm_register_structured_output_backends(scripted):
    ScriptedBackend.release.set()
    params = SamplingParams(max_tokens=10, guided_decoding=GuidedDecodingParams(grammar="7 8 9"))
    out = scripted.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [7, 8, 9, EOS]
    assert out.outputs[0].finish_reason == "stop"


def test_a_token_the_grammar_rejects_fails_the_request_with_an_error(scripted, monkeypatch):
    def lying_fill(self, bitmask, row):  # a backend bug: allows 10 where the script wants 7
        bitmask[row] = 0
        bitmask[row, 0] = 1 << 10

    monkeypatch.setattr(ScriptedGrammar, "fill_bitmask", lying_fill)
    ScriptedBackend.release.set()
    params = SamplingParams(max_tokens=10, guided_decoding=GuidedDecodingParams(grammar="7 8 9"))
    out = scripted.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    assert "sampled token(s) [10] are not allowed by the grammar" in out.error


def test_a_compiling_request_waits_without_blocking_the_others(scripted):
    engine = scripted.engine
    scheduler = engine.core.scheduler
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("guided", PROMPT, SamplingParams(max_tokens=10, guided_decoding=GuidedDecodingParams(grammar="7 8")))
    assert scheduler.requests["guided"].status == RequestStatus.WAITING_FOR_GRAMMAR
    finished = {}
    for _ in range(6):  # the plain request runs to the end while the grammar compiles
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if "plain" in finished:  # 3 steps, or 4 when async scheduling reports a step late (CUDA)
            break
    assert "plain" in finished and len(finished["plain"].outputs[0].token_ids) == 3
    assert scheduler.requests["guided"].status == RequestStatus.WAITING_FOR_GRAMMAR
    ScriptedBackend.release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["guided"].outputs[0].token_ids == [7, 8, EOS]


def test_aborting_a_request_that_waits_for_its_grammar_frees_it(scripted):
    engine = scripted.engine
    engine.add_request("guided", PROMPT, SamplingParams(guided_decoding=GuidedDecodingParams(grammar="7")))
    engine.step()
    engine.abort_request(["guided"])
    core = engine.core
    assert not core.scheduler.requests and not core.structured_output.requests
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


def test_a_backend_written_for_the_version_1_contract_is_refused_naming_make_manager():
    from pagelm import StructuredOutputBackend

    class OldStyle(StructuredOutputBackend):  # compile() on the core's class, no make_manager
        name = "old-style"

        def compile(self, params):
            return ScriptedCompiled([7])

    class Plugin:
        @hookimpl
        def pagelm_register_structured_output_backends(self, registry):
            registry.add(OldStyle.name, OldStyle)

    get_plugin_manager().register(Plugin(), name="test-old-style-backend")
    try:
        with pytest.raises(PluginError, match=r"registers structured output backend 'old-style' .*does not implement make_manager"):
            get_plugin_manager().collect("structured output backend")
    finally:
        get_plugin_manager().unregister("test-old-style-backend")


def test_an_unknown_backend_name_lists_the_registered_ones(llama_dir):
    with pytest.raises(UnknownNameError, match="registered: .*xgrammar"):
        LLM(str(llama_dir), dtype="float32", structured_output_backend="nope")


def test_missing_xgrammar_is_a_clear_error_for_guided_requests_only(monkeypatch):
    import importlib.util

    from pagelm import EngineConfig
    from pagelm.plugins.structured_output.xgrammar_backend import XgrammarBackend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xgrammar" else real(name, *a))
    problems = XgrammarBackend.validate(EngineConfig(model="m"))
    assert problems == ["xgrammar is not installed (pip install 'pagelm[xgrammar]')"]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"fill_threads": 0}, "plugin_config.xgrammar.fill_threads must be >= 1, got 0"),
        ({"compile_threads": -2}, "plugin_config.xgrammar.compile_threads must be >= 1, got -2"),
        ({"fill_threads": "4"}, "plugin_config.xgrammar.fill_threads must be a int, got '4'"),
    ],
)
def test_xgrammar_thread_settings_are_checked(settings, message):
    from pagelm import EngineConfig
    from pagelm.plugins.structured_output.xgrammar_backend import XgrammarBackend

    assert XgrammarBackend.validate(EngineConfig(model="m", plugin_config={"xgrammar": settings})) == [message]


# ---- the xgrammar backend's pieces -------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(llama_dir):
    from transformers import AutoTokenizer

    from pagelm import EngineConfig
    from pagelm.plugins.structured_output.xgrammar_backend import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    return XgrammarBackend(EngineConfig(model=str(llama_dir), **ENGINE_ARGS), tokenizer, 520, frozenset([EOS])), tokenizer


def allowed(grammar, vocab=520) -> torch.Tensor:
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab)[0]


def test_eos_is_allowed_only_where_the_grammar_is_complete_and_ends_it(backend):
    xgr_backend, tokenizer = backend
    grammar = xgr_backend.compile(GuidedDecodingParams(regex="ab")).new_grammar()
    assert not allowed(grammar)[EOS]
    assert grammar.accept_tokens(tokenizer.encode("ab"))
    mask = allowed(grammar)
    assert mask[EOS] and mask.sum() == 1
    assert grammar.accept_tokens([EOS]) and grammar.is_terminated()


def test_special_tokens_and_padded_vocab_are_never_allowed_inside_text(backend):
    xgr_backend, tokenizer = backend
    grammar = xgr_backend.compile(GuidedDecodingParams(json={"type": "string"})).new_grammar()
    assert grammar.accept_tokens(tokenizer.encode('"'))
    mask = allowed(grammar)
    assert mask[5:512].sum() > 300  # ordinary tokens may appear in a string
    assert not mask[[0, 2, 3, 4]].any()  # <|bos|>, <|pad|>, <|im_start|>, <|im_end|>
    assert not mask[512:].any()  # the model's vocab is wider than the tokenizer's


def test_rejected_tokens_leave_the_grammar_where_it_was_and_rollback_undoes(backend):
    xgr_backend, tokenizer = backend
    grammar = xgr_backend.compile(GuidedDecodingParams(regex="[0-9]{4}")).new_grammar()
    digits = tokenizer.encode("12")
    assert not grammar.accept_tokens(digits + tokenizer.encode("x"))  # all or nothing
    assert grammar.validate_tokens(digits + tokenizer.encode("x")) == len(digits)  # drafts: no move
    assert grammar.accept_tokens(digits)
    grammar.rollback(len(digits))
    assert grammar.accept_tokens(tokenizer.encode("1234")) and allowed(grammar)[EOS]


def test_json_strings_with_length_bounds_hold_no_raw_control_characters(backend):
    xgr_backend, tokenizer = backend
    grammar = xgr_backend.compile(GuidedDecodingParams(json={"type": "string", "maxLength": 5})).new_grammar()
    assert grammar.accept_tokens(tokenizer.encode('"a'))
    assert not grammar.validate_tokens(tokenizer.encode("\t"))  # invalid JSON inside a string
    assert grammar.accept_tokens(tokenizer.encode('bcd"'))


# ---- grammar work done a step ahead, on a worker thread --------------------------------------


@pytest.fixture
def manager(llama_dir):
    from pagelm import EngineConfig
    from pagelm.plugins.structured_output.xgrammar_backend import XgrammarBackend
    from pagelm.plugins.structured_output import GrammarManager

    config = EngineConfig(model=str(llama_dir), max_num_seqs=4, **ENGINE_ARGS)
    manager = GrammarManager(config, XgrammarBackend, 520, frozenset([EOS]))
    yield manager
    manager.shutdown()


def guided_requests(manager, constraints: dict[str, dict]) -> dict[str, Request]:
    requests = {}
    for req_id, constraint in constraints.items():
        requests[req_id] = Request(req_id, [5], guided(**constraint), eos_token_ids=frozenset([EOS]))
        manager.submit(requests[req_id])
    while manager.has_pending:
        manager.poll(1.0)
    assert all(r.grammar is not None for r in requests.values())
    return requests


@pytest.mark.parametrize("threaded", [True, False])
def test_bitmask_rows_prepared_ahead_follow_the_order_each_step_asks_for(manager, monkeypatch, threaded):
    from pagelm.plugins.structured_output import manager as manager_module

    # On the worker thread however few the requests, or always in grammar_bitmask.
    monkeypatch.setattr(manager_module, "_THREADED_MIN_REQUESTS", 1 if threaded else 10**9)
    reqs = guided_requests(manager, {
        "a": dict(regex="[a-c]{8}"), "b": dict(regex="[0-9]{8}"), "c": dict(choice=["yes please", "no thanks"]), "d": dict(regex="x+y"),
    })

    def step(order):  # each row is what that request's grammar allows now; returns a token each
        rows = unpack_bitmask(manager.grammar_bitmask(order).clone(), 520)
        assert [row.tolist() for row in rows] == [allowed(reqs[r].grammar).tolist() for r in order]
        return {r: next(t for t in row.nonzero().flatten().tolist() if t != EOS) for r, row in zip(order, rows)}

    tokens = step(["a", "b", "c"])  # first samples: filled inline
    # Same order plus a newcomer; then shuffled (a preemption); then a subset.
    for order in (["a", "b", "c", "d"], ["c", "a", "d", "b"], ["b", "d"]):
        for r, token in tokens.items():
            manager.accept_tokens(reqs[r], [token])
        manager.prepare_bitmask()  # the grammars move on the worker thread
        tokens = step(order)


def test_grammar_work_moves_to_the_bitmask_worker_thread_from_eight_decoding_requests(llm, monkeypatch):
    from pagelm.plugins.structured_output.xgrammar_backend import XgrammarBackend

    threads = []
    real = XgrammarBackend.batch_accept_tokens

    def spy(self, grammars, token_ids):
        threads.append((len(grammars), threading.current_thread().name))
        return real(self, grammars, token_ids)

    monkeypatch.setattr(XgrammarBackend, "batch_accept_tokens", spy)
    params = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[a-z]{40}"))
    llm.generate([PROMPT] * 8, params, use_tqdm=False)
    llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert {n for n, _ in threads} >= {8, 3}
    assert all(name.startswith("pagelm-bitmask" if n >= 8 else "MainThread") for n, name in threads), threads


def test_outputs_are_the_same_whether_the_bitmask_is_prepared_ahead_or_inline(llm, monkeypatch):
    constraints = [dict(json=SCHEMAS["arrays"]), dict(regex=r"[a-z]{3,9}"), dict(choice=["red", "green"]), dict(grammar=ARITHMETIC)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, guided_decoding=GuidedDecodingParams(**c))
              for i, c in enumerate(constraints * 2)]
    prompts = [{"prompt_token_ids": list(range(5, 5 + 3 * i + 1))} for i in range(len(params))]  # prefills end apart
    ahead = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(llm.engine.core.structured_output, "prepare_bitmask", lambda: None)  # grammar_bitmask does it all
    inline = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in inline]
    assert "error" not in {o.outputs[0].finish_reason for o in ahead}


def test_guided_params_cross_the_engine_core_wire_format():
    params = SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "object", "properties": {"b": {}, "a": {}}}))
    request = decode_request(encode_request(Request("r", [5], params)))
    crossed = request.sampling_params.guided_decoding
    # The schema crosses as its JSON text (msgpack has no integers past 64 bits; JSON has).
    assert (crossed.kind, crossed.spec) == ("json", '{"type":"object","properties":{"b":{},"a":{}}}')
    big = SamplingParams(guided_decoding=GuidedDecodingParams(json={"enum": [10**30]}))
    assert decode_request(encode_request(Request("r", [5], big))).sampling_params.guided_decoding.spec == (
        '{"enum":[1000000000000000000000000000000]}'
    )


def test_json_object_accepts_any_object_and_nothing_else(backend):
    xgr_backend, tokenizer = backend
    compiled = xgr_backend.compile(GuidedDecodingParams(json_object=True))
    grammar = compiled.new_grammar()
    assert grammar.accept_tokens(tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}') + [EOS])
    assert grammar.is_terminated()
    assert not compiled.new_grammar().accept_tokens(tokenizer.encode("[1]"))


def test_bench_structured_reports_tpot_and_ttft(llama_dir, tmp_path, capsys):
    import argparse

    from pagelm.plugins.bench import structured

    parser = argparse.ArgumentParser()
    structured.add_parser(parser.add_subparsers())
    args = parser.parse_args([
        "structured", "--model", str(llama_dir), "--batch-sizes", "1,3", "--input-len", "4", "--output-len", "6",
        "--ttft-trials", "1", "--dtype", "float32", "--json", str(tmp_path / "out.json"),
    ])
    assert args.func(args) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert [r["batch_size"] for r in result["tpot"]] == [1, 3]
    assert all(r["tpot_ms"] > 0 and r["tpot_schema_ms"] > 0 and r["output_tokens_schema"] == 6 for r in result["tpot"])
    assert set(result["ttft"]) == {"ttft_plain_ms", "ttft_new_schema_ms", "ttft_cached_schema_ms"}
    assert "TTFT" in capsys.readouterr().out


def test_bench_standin_tokenizer_covers_the_model_vocab(tmp_path):
    from transformers import AutoTokenizer

    from pagelm.plugins.bench.structured import standin_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 3000, "bos_token_id": 0, "eos_token_id": [7, 9]}))
    tokenizer = AutoTokenizer.from_pretrained(standin_tokenizer(tmp_path, tmp_path / "tok"))
    assert len(tokenizer) == 3000 and tokenizer.eos_token_id == 7
    assert all(tokenizer.added_tokens_decoder[i].special for i in (0, 7, 9))
    assert len(set(tokenizer.convert_ids_to_tokens(list(range(3000))))) == 3000
