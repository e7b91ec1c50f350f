"""Conformance checks for plugin authors: plain functions that raise ``AssertionError`` with a
message saying what broke, for scheduling policies, attention backends and speculative
proposers (tool-call parsers have theirs in ``pagelm.plugins.tool_parsers.conformance``). Call
them from your own tests (what each asserts: ``docs/plugins.md``, "Testing: the conformance
kit")::

    from pagelm.testing.conformance import check_scheduling_policy
    def test_my_policy_conforms(tmp_path):
        check_scheduling_policy("my_policy", model_dir=build_tiny_model(tmp_path, "llama"))
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from pagelm.attention import AttentionBackend, AttentionSpec, CommonAttentionMetadata
from pagelm.config import EngineConfig
from pagelm.kv_cache import KVCacheManager, make_block_hasher
from pagelm.plugin_manager import get_plugin_manager
from pagelm.request import Request, RequestStatus
from pagelm.sampling_params import SamplingParams
from pagelm.sched.policy import SchedulingPolicy
from pagelm.sched.request_queue import RequestQueue
from pagelm.sched.scheduler import Scheduler
from pagelm.spec_decode import Proposer
from pagelm.worker.output import ModelRunnerOutput

__all__ = [
    "check_attention_backend",
    "check_attention_engine",
    "check_attention_kernels",
    "check_policy_engine",
    "check_policy_queue",
    "check_policy_scheduling",
    "check_proposer",
    "check_proposer_engine",
    "check_scheduling_policy",
    "paged_metadata",
]

_BLOCK_SIZE = 4


def _registered(plugin_kind: str, name: str, abc: type, kind: str | None = None) -> type:
    """The class registered as ``name``; with ``kind``, its ``name`` attribute must match."""
    cls = get_plugin_manager().collect(plugin_kind).get(name)
    assert isinstance(cls, type) and issubclass(cls, abc), f"{name!r} is not a {abc.__name__}"
    if kind is not None:
        assert cls.name == name, f"{kind} registered as {name!r} but its name attribute is {cls.name!r}"
    return cls


def _problems(name: str, problems: Any) -> list[str]:
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems), (
        f"{name}.validate() must return a list of strings, got {problems!r}"
    )
    return problems


def _greedy_tokens(model_dir: str, prompts: list, params: Any, **kw: Any) -> tuple[list[list[int]], Any]:
    """Greedy generation through ``LLM`` (float32, seed 0); every KV block must come back.
    ``priority`` goes to ``generate``, the rest to ``LLM``."""
    from pagelm import LLM

    priority = kw.pop("priority", None)
    llm = LLM(model_dir, dtype="float32", seed=0, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    core = llm.engine.core
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], core


def _assert_same_tokens(name: str, got: list[list[int]], want: list[list[int]], than: str) -> None:
    diff = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not diff, f"{name}: prompts {diff} gave different greedy tokens {than}"


# =============================================================================================
# scheduling policies
# =============================================================================================


def check_scheduling_policy(
    name: str, model_dir: str | Path | None = None, plugin_config: dict[str, Any] | None = None
) -> None:
    """Every policy check; the engine check only when ``model_dir`` is given."""
    check_policy_queue(name, plugin_config)
    check_policy_scheduling(name, plugin_config)
    if model_dir is not None:
        check_policy_engine(name, model_dir, plugin_config)


def _policy_class(name: str) -> type[SchedulingPolicy]:
    return _registered("scheduling policy", name, SchedulingPolicy)


def _config(name: str, plugin_config: dict[str, Any] | None, **kw: Any) -> EngineConfig:
    return EngineConfig(
        model="(conformance)", scheduling_policy=name, block_size=_BLOCK_SIZE, plugin_config=plugin_config or {}, **kw
    )


def _request(
    req_id: str, prompt_len: int, max_tokens: int, priority: int = 0, arrival: float = 0.0, shared: int = 0
) -> Request:
    """A request whose first ``shared`` prompt tokens are the same for every request (prefix
    cache hits), the rest its own."""
    base = 1000 * (int(req_id) + 1)
    shared = min(shared, prompt_len)
    return Request(
        req_id,
        list(range(1, 1 + shared)) + list(range(base, base + prompt_len - shared)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time=arrival,
        priority=priority,
        block_hasher=make_block_hasher(_BLOCK_SIZE),
    )


def check_policy_queue(name: str, plugin_config: dict[str, Any] | None = None) -> None:
    """The policy's queue (``make_queue``): its methods agree with each other; victims are
    running requests."""
    cls = _policy_class(name)
    config = _config(name, plugin_config)
    problems = _problems(name, cls.validate(config))
    assert not problems, f"{name}.validate() rejects a default config: {problems}"
    policy = cls(config)
    queue = policy.make_queue()
    assert isinstance(queue, RequestQueue), f"{name}.make_queue() must return a RequestQueue, got {queue!r}"
    reqs = [_request(str(i), 3 + 5 * (i % 3), 2 + 7 * (i % 4), priority=i % 3, arrival=float(i)) for i in range(8)]
    for r in reqs:
        queue.add(r)
    assert len(queue) == len(reqs), f"{name}: len() is {len(queue)} after {len(reqs)} add()s"
    order = list(queue)
    assert sorted(r.request_id for r in order) == sorted(r.request_id for r in reqs), (
        f"{name}: iteration must yield every waiting request exactly once, got {[r.request_id for r in order]}"
    )
    assert queue.peek() is order[0], f"{name}: peek() must be the first request of the iteration order"
    first = queue.pop()
    assert first is order[0] and len(queue) == len(reqs) - 1, f"{name}: pop() must remove and return peek()"
    queue.remove(order[-1])
    assert order[-1] not in list(queue) and len(queue) == len(reqs) - 2, f"{name}: remove() did not remove"
    first.status = RequestStatus.PREEMPTED
    queue.prepend(first)
    assert first in list(queue) and len(queue) == len(reqs) - 1, f"{name}: prepend() must re-queue the request"
    running = reqs[:4]
    for r in running:
        r.status = RequestStatus.RUNNING
    victim = policy.select_victim(running)
    assert victim in running, f"{name}: select_victim() returned {victim!r}, not a running request"
    victim = policy.select_victim_for(queue.peek(), running)
    assert victim is None or victim in running, f"{name}: select_victim_for() returned a request that is not running"


def _fake_token(req: Request) -> int:
    """A deterministic 'model': the next token depends only on the tokens so far, so a
    recomputed (preempted) request must come out exactly as an un-preempted one."""
    tail = req.all_token_ids[-4:]
    return 10 + (31 * sum(tail) + 7 * req.num_tokens) % 89


def _workload() -> list[tuple[int, Request]]:
    """(step at which it arrives, request): a burst of mixed priority, then urgent late arrivals
    that land while earlier prompts are part-way through a chunked prefill; half the prompts share
    a 12-token prefix (prefix-cache hits, some within one step)."""
    out = []
    for i in range(12):
        prompt_len = [3, 17, 9, 30, 5, 12][i % 6]
        max_tokens = [12, 3, 20, 6, 9, 15][(i * 5) % 6]
        step = 0 if i < 7 else 4 * (i - 6) - (i % 2)
        shared = 12 if i % 2 else 0
        priority = 1 + i % 2 if i < 7 else 0  # late arrivals are the most urgent
        out.append((step, _request(str(i), prompt_len, max_tokens, priority, float(step + i / 100), shared)))
    return out


class _ShadowKV:
    """What the paged KV cache would hold: each step writes every scheduled token's id into
    its slot (``block_id * block_size + offset``), then checks that every position a request
    attends to holds that request's token. A prefix-cache hit on a block nobody wrote (or
    that was overwritten) fails here, as it would change a real model's output."""

    def __init__(self, num_blocks: int) -> None:
        self.slots: list[int | None] = [None] * (num_blocks * _BLOCK_SIZE)

    def step(self, name: str, sched: Scheduler, out) -> None:
        spans = []
        for req_id, num_new in out.num_scheduled_tokens.items():
            req = sched.requests[req_id]
            end = req.num_computed_tokens  # booked: already counts this step's tokens
            block_ids = sched.kv.get_block_ids(req_id)
            spans.append((req, block_ids, end))
            for pos in range(end - num_new, end):  # every layer writes first ...
                self.slots[self._slot(block_ids, pos)] = req.all_token_ids[pos]
        for req, block_ids, end in spans:  # ... then attends over all of it
            for pos in range(end):
                held = self.slots[self._slot(block_ids, pos)]
                assert held == req.all_token_ids[pos], (
                    f"{name}: request {req.request_id} attends to position {pos} in block "
                    f"{block_ids[pos // _BLOCK_SIZE]}, which holds {held} instead of its token "
                    f"{req.all_token_ids[pos]}: a prefix-cache hit on KV that was never written"
                )

    @staticmethod
    def _slot(block_ids: list[int], pos: int) -> int:
        return block_ids[pos // _BLOCK_SIZE] * _BLOCK_SIZE + pos % _BLOCK_SIZE


def _run_scheduler(
    name: str, plugin_config: dict[str, Any] | None, num_blocks: int, max_steps: int = 3000,
    force_preemption: bool = False, **kw: Any,
):
    """Drive the real scheduler over ``_workload`` with a fake model. ``force_preemption``: a
    waiting request that cannot be admitted always preempts the policy's own victim
    (``select_victim``), whatever the policy's ``select_victim_for`` would say."""
    config = _config(name, plugin_config, **kw)
    kv = KVCacheManager(num_blocks, _BLOCK_SIZE, config.enable_prefix_caching)
    policy = _policy_class(name)(config)
    if force_preemption:
        policy.select_victim_for = lambda request, running: policy.select_victim(running) if running else None
    sched = Scheduler(config, kv, policy, max_model_len=64)
    pending = _workload()
    requests = {r.request_id: r for _, r in pending}
    shadow = _ShadowKV(num_blocks)
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        if not pending and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens, f"{name}: token budget exceeded"
        assert sched.num_running <= config.max_num_seqs, f"{name}: more than max_num_seqs requests running"
        for req_id in out.num_scheduled_tokens:
            assert requests[req_id].status == RequestStatus.RUNNING, f"{name}: scheduled {req_id} is not running"
        shadow.step(name, sched, out)
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(ids, [[_fake_token(requests[i])] for i in ids]))
    else:
        stuck = {r.request_id: r.status.name for r in requests.values() if not r.is_finished}
        raise AssertionError(f"{name}: requests did not finish within {max_steps} steps: {stuck}")
    assert kv.num_free_blocks == kv.num_blocks, (
        f"{name}: {kv.num_blocks - kv.num_free_blocks} KV blocks still held after every request finished"
    )
    assert len(sched.waiting) == 0, f"{name}: the queue still holds {len(sched.waiting)} requests"
    for r in requests.values():
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens, (
            f"{name}: request {r.request_id} ended as {r.status.name} with {r.num_output_tokens}/{r.max_tokens} tokens"
        )
    return {i: list(r.output_token_ids) for i, r in requests.items()}, sched


def check_policy_scheduling(name: str, plugin_config: dict[str, Any] | None = None) -> None:
    """Through the real scheduler: everyone finishes, budgets hold, blocks come back, and
    preemption changes no output."""
    roomy, _ = _run_scheduler(name, plugin_config, num_blocks=256, max_num_batched_tokens=64)
    # 16 blocks of 4 = 64 slots = one max_model_len request: constant preemption.
    tight, sched = _run_scheduler(
        name, plugin_config, num_blocks=16, max_num_batched_tokens=24, long_prefill_token_threshold=8,
        max_num_partial_prefills=2,
    )
    assert sched.num_preemptions > 0, f"{name}: the tight pool never preempted; the check did not exercise preemption"
    few, _ = _run_scheduler(name, plugin_config, num_blocks=256, max_num_seqs=2)
    # Late arrivals find both seats taken by prompts part-way through their prefill and
    # preempt one (forced): in the step that booked the victim's next chunk.
    chunked, sched = _run_scheduler(
        name, plugin_config, num_blocks=256, max_num_seqs=2, long_prefill_token_threshold=4,
        max_num_partial_prefills=2, force_preemption=True,
    )
    assert sched.num_preemptions > 0, f"{name}: forced preemption never happened; the check did not exercise it"
    for label, outs in (
        ("a tight KV pool (preemption)", tight), ("max_num_seqs=2", few), ("max_num_seqs=2, chunked prefill", chunked)
    ):
        diff = [i for i in roomy if outs[i] != roomy[i]]
        assert not diff, f"{name}: with {label} requests {diff} produced different tokens than the roomy run"


_ENGINE_BASELINES: dict[tuple[str, str], list[list[int]]] = {}
_POLICY_ENGINE = dict(block_size=8, max_model_len=64)
_POLICY_PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def _engine_prompts() -> tuple[list[dict], list[int]]:
    """Prompts (every other one opening with the same 16 tokens: prefix-cache hits) and
    their priorities."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 23, 11, 30, 8, 17, 3, 26]
    shared = torch.randint(10, 200, (16,), generator=gen).tolist()
    prompts = []
    for i, n in enumerate(lengths):
        own = torch.randint(10, 200, (n,), generator=gen).tolist()
        prompts.append({"prompt_token_ids": shared + own if i % 2 else own})
    return prompts, [i % 3 for i in range(len(lengths))]


def _engine_tokens(model_dir: str, **kw: Any) -> tuple[list[list[int]], Any]:
    prompts, priorities = _engine_prompts()
    return _greedy_tokens(model_dir, prompts, _POLICY_PARAMS, priority=priorities, **_POLICY_ENGINE, **kw)


def _engine_tokens_staggered(model_dir: str, **kw: Any) -> list[list[int]]:
    """The prompts arriving one per step, the most urgent (priority 0) last, into two seats
    with prompts prefilled a block a step: late arrivals land mid-prefill."""
    from pagelm import LLM

    prompts, priorities = _engine_prompts()
    engine = LLM(
        model_dir, dtype="float32", seed=0, max_num_seqs=2, long_prefill_token_threshold=8,
        max_num_partial_prefills=2, **_POLICY_ENGINE, **kw,
    ).engine
    order = sorted(range(len(prompts)), key=lambda i: -priorities[i])
    done: dict[str, list[int]] = {}
    for step in range(3000):
        if order and step % 2 == 0:
            i = order.pop(0)
            engine.add_request(str(i), prompts[i], _POLICY_PARAMS, priority=priorities[i])
        if not order and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    else:
        raise AssertionError(f"requests did not finish within 3000 steps; finished: {sorted(done)}")
    core = engine.core
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks, "KV blocks leaked"
    return [done[str(i)] for i in range(len(prompts))]


def check_policy_engine(name: str, model_dir: str | Path, plugin_config: dict[str, Any] | None = None) -> None:
    """Through ``LLM``: on a pool of 10 blocks the policy preempts, and with staggered arrivals
    landing mid-prefill it may preempt in the step that booked a chunk; either way the greedy
    tokens equal an FCFS run that never preempts."""
    model_dir, plugin_config = str(model_dir), plugin_config or {}
    key = (model_dir, "fcfs")
    if key not in _ENGINE_BASELINES:
        _ENGINE_BASELINES[key], _ = _engine_tokens(model_dir, scheduling_policy="fcfs", num_kv_blocks=128)
    tokens, core = _engine_tokens(model_dir, scheduling_policy=name, num_kv_blocks=10, plugin_config=plugin_config)
    assert core.scheduler.num_preemptions > 0, f"{name}: a 10-block pool should have forced preemption"
    staggered = _engine_tokens_staggered(model_dir, scheduling_policy=name, num_kv_blocks=64, plugin_config=plugin_config)
    for label, run in (("a 10-block pool", tokens), ("staggered arrivals", staggered)):
        _assert_same_tokens(name, run, _ENGINE_BASELINES[key], f"with {label} than the un-preempted FCFS run")


# =============================================================================================
# attention backends
# =============================================================================================


def check_attention_backend(
    name: str,
    model_dir: str | Path | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    reference: str = "torch",
) -> None:
    """Every attention-backend check; the engine check only when ``model_dir`` is given."""
    check_attention_kernels(name, device=device, dtype=dtype, reference=reference)
    if model_dir is not None:
        check_attention_engine(name, model_dir, device=device, reference=reference)


def _backend_class(name: str) -> type[AttentionBackend]:
    return _registered("attention backend", name, AttentionBackend, kind="backend")


# (block_size, [(num_cached, num_new) per request]): prefills, decodes over cached context, a
# chunk over a cached prefix mixed with a decode, and lengths on block boundaries.
_ATTENTION_CASES = [
    (4, [(0, 1), (0, 7), (0, 33)]),
    (4, [(16, 1), (31, 1), (5, 1)]),
    (8, [(20, 9), (0, 12), (40, 1)]),
    (16, [(15, 1), (16, 1), (0, 16), (0, 17), (33, 3)]),
]


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-3)


def check_attention_kernels(
    name: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, reference: str = "torch"
) -> None:
    """The backend's paged attention equals the reference's on the same batches."""
    cls, ref_cls = _backend_class(name), _backend_class(reference)
    dev = torch.device(device)
    head_dim = cls.supported_head_sizes[0] if cls.supported_head_sizes else 32
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=head_dim, scale=1 / math.sqrt(head_dim))
    problems = _problems(name, cls.validate(_config_for_backend(name), spec, dtype, dev))
    assert not problems, f"{name} rejects {dtype} on {device}: {problems}"
    for block_size, seqs in _ATTENTION_CASES:
        got = _paged_attention(cls, spec, seqs, block_size, dev, dtype)
        want = _paged_attention(ref_cls, spec, seqs, block_size, dev, dtype)
        tol = _tolerance(dtype)
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            err = (got.float() - want.float()).abs().max().item()
            raise AssertionError(
                f"{name}: attention differs from {reference!r} by {err:.2e} (tolerance {tol}) on "
                f"requests (cached, new)={seqs}, block_size={block_size}, dtype={dtype}"
            )


def _config_for_backend(name: str) -> EngineConfig:
    return EngineConfig(model="(conformance)", attention_backend=name)


def _paged_attention(backend, spec: AttentionSpec, seqs, block_size: int, device, dtype) -> torch.Tensor:
    """Write the cached tokens' K/V in a first step, then run the new tokens; blocks are
    handed out in shuffled order so block tables really are indirect."""
    gen = torch.Generator().manual_seed(1234)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qkv = [
        tuple(
            torch.randn(c + n, heads, spec.head_dim, generator=gen)
            for heads in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
        )
        for c, n in seqs
    ]
    impl = backend.make_impl(spec)
    builder = backend.make_metadata_builder(device)
    builder.bind_layers([spec], dtype)
    cache = torch.zeros(
        backend.get_kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim), dtype=dtype, device=device
    )

    def step(ranges: list[tuple[int, int, int]]) -> torch.Tensor:
        """One forward over (request index, first position, end position) ranges."""
        parts: list[list[torch.Tensor]] = [[], [], []]
        for i, lo, hi in ranges:
            for part, t in zip(parts, qkv[i]):
                part.append(t[lo:hi])
        rows = block_table[[i for i, _, _ in ranges]]
        common = paged_metadata(rows, [(lo, hi) for _, lo, hi in ranges], block_size, device)
        q, k, v = (torch.cat(p).flatten(1).to(device=device, dtype=dtype) for p in parts)
        return impl.forward(q, k, v, cache, builder.build(common))

    cached = [(i, 0, c) for i, (c, _) in enumerate(seqs) if c]
    if cached:
        step(cached)
    return step([(i, c, c + n) for i, (c, n) in enumerate(seqs)]).cpu()


def check_attention_engine(
    name: str, model_dir: str | Path, *, device: str = "cpu", reference: str = "torch"
) -> None:
    """Greedy generation with the backend (prefix caching, chunked prefill, a batch of
    different lengths) gives the reference backend's tokens."""
    prompts, _ = _engine_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # Half the prompts repeat an earlier one, so prefix-cache hits go through the backend.
    prompts = prompts + prompts[:4]
    kw = dict(device=device, block_size=8, max_num_batched_tokens=24)
    want, _ = _greedy_tokens(str(model_dir), prompts, params, attention_backend=reference, **kw)
    got, _ = _greedy_tokens(str(model_dir), prompts, params, attention_backend=name, **kw)
    _assert_same_tokens(name, got, want, f"than the {reference!r} backend")


# =============================================================================================
# speculative proposers
# =============================================================================================


def check_proposer(
    name: str, model_dir: str | Path | None = None, speculative_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every proposer check; the engine check only when ``model_dir`` is given (returns its
    acceptance counters, else ``{}``). ``speculative_config``: extra keys your proposer needs
    (``{"model": ...}`` for a draft model)."""
    cls = _registered("speculative proposer", name, Proposer, kind="proposer")
    config = EngineConfig(model=str(model_dir or "(conformance)"), speculative_config=_spec_config(name, speculative_config))
    problems = _problems(name, cls.validate(config))
    lookahead = cls.num_lookahead_slots(config)
    assert isinstance(lookahead, int) and lookahead >= 0, f"{name}: num_lookahead_slots must be an int >= 0"
    if model_dir is None:
        return {}
    assert not problems, f"{name}: validate rejected the engine check's config: {problems}"
    return check_proposer_engine(name, model_dir, speculative_config)


def _spec_config(name: str, extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"method": name, "num_speculative_tokens": 3, **(extra or {})}


def _proposer_prompts() -> list[dict]:
    """Mixed lengths, a shared 20-token prefix (prefix-cache hits), repetitive prompts
    (n-gram matches), and one long prompt that runs into ``max_model_len``."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(10, 200, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(10, 200, (n,), generator=gen).tolist() for n in (3, 9, 14)]
    prompts += [torch.randint(10, 200, (n,), generator=gen).tolist() for n in (6, 27)]
    prompts += [[11, 12, 13, 14] * 5, [21, 22, 23] * 6 + [21]]
    prompts.append(torch.randint(10, 200, (40,), generator=gen).tolist())
    return [{"prompt_token_ids": p} for p in prompts]


def _proposer_run(model_dir: str, **kw: Any) -> tuple[list[list[int]], Any]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = _proposer_prompts()
    # The long prompt runs until max_model_len (its drafts get capped near the end).
    per_prompt = [params] * (len(prompts) - 1) + [SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)]
    return _greedy_tokens(model_dir, prompts, per_prompt, block_size=4, max_model_len=64, **kw)


def check_proposer_engine(
    name: str, model_dir: str | Path, speculative_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Through ``LLM`` with chunked prefill, prefix caching and a KV pool small enough to
    preempt: greedy tokens equal a plain run's (speculation never changes output), and every
    block comes back. Returns the run's acceptance counters."""
    model_dir = str(model_dir)
    key = (model_dir, "no-speculation")
    if key not in _ENGINE_BASELINES:
        _ENGINE_BASELINES[key], _ = _proposer_run(model_dir, enable_prefix_caching=False)
    tokens, core = _proposer_run(
        model_dir,
        speculative_config=_spec_config(name, speculative_config),
        num_kv_blocks=24,
        max_num_batched_tokens=20,
        long_prefill_token_threshold=12,
        max_num_partial_prefills=2,
        enable_prefix_caching=True,
    )
    assert core.scheduler.num_preemptions > 0, f"{name}: a 24-block pool should have forced preemption"
    assert core.kv_cache_manager.prefix_cache_stats.hits > 0, f"{name}: the shared prefix was never hit"
    _assert_same_tokens(name, tokens, _ENGINE_BASELINES[key], "with speculative decoding")
    stats = core.scheduler.spec_decoding_stats
    assert stats.num_drafts > 0, f"{name}: no drafts were ever verified"
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "mean_acceptance_length": stats.mean_acceptance_length,
    }


def paged_metadata(
    block_table: torch.Tensor, ranges: list[tuple[int, int]], block_size: int, device, **extra
) -> CommonAttentionMetadata:
    """The step a test feeds a backend: request ``i`` (row ``i`` of ``block_table``) computes
    positions ``ranges[i] = (lo, hi)`` over ``lo`` cached tokens; ``extra`` sets optional
    fields (e.g. ``block_table_cpu``)."""
    slots, qsl, lens = [], [0], []
    for i, (lo, hi) in enumerate(ranges):
        pos = torch.arange(lo, hi)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
        qsl.append(qsl[-1] + hi - lo)
        lens.append(hi)
    qsl_cpu, lens_cpu = torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        num_reqs=len(ranges), num_actual_tokens=qsl[-1], max_query_len=max(h - l for l, h in ranges),
        max_seq_len=max(lens), query_start_loc=qsl_cpu.to(device), seq_lens=lens_cpu.to(device),
        block_table=block_table.to(device), slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=qsl_cpu, seq_lens_cpu=lens_cpu, block_size=block_size, **extra,
    )
