"""Builds the sampler's batched inputs from per-request state, skipping what nobody uses."""

from __future__ import annotations

import hashlib

import torch

from pagelm.sample import SamplingMetadata
from pagelm.sample.request_logits import bad_word_bans
from pagelm.sampling_params import SAMPLING_EPS, num_logprobs


def step_seed(seed: int, step: int) -> int:
    """A seeded request's draw for its ``step``-th output token depends on (seed, step) alone:
    reproducible whatever else is in the batch, and after preemption and recompute."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a stream sync (``torch.tensor(..., device=cuda)``
    would wait for the GPU to drain)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def argmax_only(params, logits_row) -> bool:
    """Whether a request's every token is the argmax of its raw logits: greedy, with nothing
    that changes the logits before the argmax (penalties, min_tokens, bad words, its logits
    row of logit_bias / allowed_token_ids) and no logprobs to gather. Its rows then need no
    ``SamplingMetadata``."""
    return (
        params.temperature < SAMPLING_EPS and logits_row is None and params.logprobs is None
        and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
        and params.min_tokens == 0 and not params.bad_words_token_ids
    )


class ArgmaxMetadata:
    """The ``SamplingMetadata`` of a batch whose every row is ``argmax_only``: all greedy,
    nothing else set, so the same for every such batch of a size. Made once per batch size
    and handed out again (nothing changes a metadata once built): building it afresh, a
    temperature column uploaded per step, cost ~35 us of host time a step at 32 requests on
    the CPU machine, and a small model's GPU step is all host time."""

    def __init__(self, device) -> None:
        self.device = device
        self._by_size: dict[int, SamplingMetadata] = {}

    def get(self, num_rows: int) -> SamplingMetadata:
        md = self._by_size.get(num_rows)
        if md is None:
            temperature = torch.zeros(num_rows, dtype=torch.float32, device=self.device)
            md = self._by_size[num_rows] = SamplingMetadata(temperature=temperature, all_greedy=True, all_random=False)
        return md


def build_sampling_metadata(states, eos_token_ids: frozenset[int], vocab_size: int, device) -> SamplingMetadata:
    """The sampler's inputs for one row per state. Which knobs are in use is decided over
    the distinct ``SamplingParams`` objects (a verification step's rows of one request share
    theirs, and a batch often shares one): the per-row loops run only for knobs someone sets."""
    params = [s.sampling_params for s in states]
    n = len(params)
    distinct = list({id(p): p for p in params}.values())
    # Which knobs anyone sets, in one pass.
    presence = frequency = repetition = top_k = top_p = min_p = seeded = banning = False
    for p in distinct:
        presence |= p.presence_penalty != 0.0
        frequency |= p.frequency_penalty != 0.0
        repetition |= p.repetition_penalty != 1.0
        top_k |= p.top_k != 0
        top_p |= p.top_p != 1.0
        min_p |= p.min_p != 0.0
        seeded |= p.seed is not None and p.temperature >= SAMPLING_EPS
        banning |= p.min_tokens > 0 or bool(p.bad_words_token_ids)

    def column(used, get, dtype):
        return to_device([get(p) for p in params], dtype, device) if used else None

    temperature = to_device([p.temperature for p in params], torch.float32, device)
    greedy = [p.temperature < SAMPLING_EPS for p in params]
    generators = {}
    if seeded:
        for i, s in enumerate(states):
            if s.sampling_params.seed is not None and not greedy[i]:
                g = torch.Generator(device=device)
                g.manual_seed(step_seed(s.sampling_params.seed, len(s.output_token_ids)))
                generators[i] = g

    presence = column(presence, lambda p: p.presence_penalty, torch.float32)
    frequency = column(frequency, lambda p: p.frequency_penalty, torch.float32)
    repetition = column(repetition, lambda p: p.repetition_penalty, torch.float32)
    prompt_ids = None
    if repetition is not None:
        width = max(s.num_prompt_tokens for s in states)
        prompt_ids = torch.full((n, width), vocab_size, dtype=torch.long)
        for i, s in enumerate(states):
            prompt_ids[i, : s.num_prompt_tokens] = torch.tensor(s.token_ids[: s.num_prompt_tokens])
        prompt_ids = prompt_ids.to(device, non_blocking=True)

    banned_token_ids = {}
    if banning:
        for i, s in enumerate(states):
            p = s.sampling_params
            banned = set()
            if len(s.output_token_ids) < p.min_tokens:
                banned = set(p.all_stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            if p.bad_words_token_ids:  # its multi-token words: this step runs with its outputs known
                banned |= bad_word_bans(p.bad_word_prefixes, s.output_token_ids)
            if banned:
                banned_token_ids[i] = banned
    rows = [(i, s.logits_row) for i, s in enumerate(states) if s.logits_row is not None]

    wanted = [num_logprobs(p.logprobs, vocab_size) for p in distinct if p.logprobs is not None]
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        # A top_k beyond the vocabulary keeps every token: clamped, it stays a small number.
        top_k=column(top_k, lambda p: min(p.top_k, vocab_size), torch.long),
        max_top_k=min(max(p.top_k for p in distinct), vocab_size) or None,  # top_k >= 0; 0 = off
        top_p=column(top_p, lambda p: p.top_p, torch.float32),
        min_p=column(min_p, lambda p: p.min_p, torch.float32),
        generators=generators,
        max_num_logprobs=max(wanted) if wanted else None,
        prompt_token_ids=prompt_ids,
        output_token_ids=[s.output_token_ids for s in states],
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        banned_token_ids=banned_token_ids,
        allowed_token_mask=None,
        logits_rows_index=to_device([i for i, _ in rows], torch.long, device) if rows else None,
        logits_rows=torch.stack([row for _, row in rows]) if rows else None,
    )
