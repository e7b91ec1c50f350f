"""Logits processors one request asks for: ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
as one dense ``[vocab]`` row built on the device when the request joins the model runner, plus
the host check of multi-token bad words (what each costs, and why: ``docs/sampling.md``)."""

from __future__ import annotations

import torch

from pagelm.sampling_params import SamplingParams


def build_logits_row(params: SamplingParams, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """``[vocab_size]`` float32 on ``device``, or None when the request uses none of the three.
    Small index uploads and fills on the device: no host sync."""
    bias, allowed = params.logit_bias, params.allowed_token_ids
    banned = [w[0] for w in params.bad_words_token_ids or () if len(w) == 1]
    if not bias and allowed is None and not banned:
        return None
    if allowed is None:
        row = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    else:
        row = torch.full((vocab_size,), float("-inf"), dtype=torch.float32, device=device)
        row.index_fill_(0, _ids(allowed, device), 0.0)
    if bias:
        row.index_add_(0, _ids(list(bias), device), _values(list(bias.values()), device))  # ids unique: dict keys
    if banned:
        row.index_fill_(0, _ids(banned, device), float("-inf"))
    return row


def bad_word_bans(prefixed_words: list[list[int]], output_token_ids: list[int]) -> set[int]:
    """The last tokens of the bad words (of two tokens or more) whose other tokens end
    ``output_token_ids``: sampling one of them would complete the word."""
    banned = set()
    for word in prefixed_words:
        n = len(word) - 1
        if n <= len(output_token_ids) and output_token_ids[len(output_token_ids) - n :] == word[:n]:
            banned.add(word[-1])
    return banned


def _ids(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)


def _values(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
