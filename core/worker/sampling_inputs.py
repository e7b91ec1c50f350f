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


def build_sampling_metadata(states, eos_token_ids: frozenset[int], vocab_size: int, device) -> SamplingMetadata:
    params = [s.sampling_params for s in states]
    n = len(params)

    def column(values, dtype, default):
        if all(v == default for v in values):
            return None
        return to_device(values, dtype, device)

    temperature = to_device([p.temperature for p in params], torch.float32, device)
    greedy = [p.temperature < SAMPLING_EPS for p in params]
    generators = {}
    for i, s in enumerate(states):
        if s.sampling_params.seed is not None and not greedy[i]:
            g = torch.Generator(device=device)
            g.manual_seed(step_seed(s.sampling_params.seed, len(s.output_token_ids)))
            generators[i] = g

    presence = column([p.presence_penalty for p in params], torch.float32, 0.0)
    frequency = column([p.frequency_penalty for p in params], torch.float32, 0.0)
    repetition = column([p.repetition_penalty for p in params], torch.float32, 1.0)
    prompt_ids = None
    if repetition is not None:
        width = max(s.num_prompt_tokens for s in states)
        prompt_ids = torch.full((n, width), vocab_size, dtype=torch.long)
        for i, s in enumerate(states):
            prompt_ids[i, : s.num_prompt_tokens] = torch.tensor(s.token_ids[: s.num_prompt_tokens])
        prompt_ids = prompt_ids.to(device, non_blocking=True)

    banned_token_ids = {}
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

    wanted = [num_logprobs(p.logprobs, vocab_size) for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        # A top_k beyond the vocabulary keeps every token: clamped, it stays a small number.
        top_k=column([min(p.top_k, vocab_size) for p in params], torch.long, 0),
        max_top_k=min(max(p.top_k for p in params), vocab_size) or None,  # top_k >= 0; 0 = off
        top_p=column([p.top_p for p in params], torch.float32, 1.0),
        min_p=column([p.min_p for p in params], torch.float32, 0.0),
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
