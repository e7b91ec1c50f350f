"""The sampler: one row of logits per request in, one token per request out, in one batched pass.

Processing order (each stage is skipped when no row in the batch uses it)::

    raw logits ──► logprobs (vLLM's "raw_logprobs": before anything below)
        │
        ├─ allowed_token_mask ─ requests' logits rows ─ banned ids ─ penalties ──► greedy: argmax
        │
        └─ temperature ─ min_p ─ top_k ─ top_p ─ softmax ─ exponential race ──► random rows
                                                            (CPU: inverse CDF)

On CUDA the model runner samples a batch of random rows with nothing but a temperature (and
a guided-decoding bitmask) in one Triton kernel instead (the ``exponential_race`` fused kernel,
``Sampler.race_fusable``), with the race's noise drawn at launch (``draw_noise``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagelm.sample.metadata import SamplingMetadata
from pagelm.sampling_params import SAMPLING_EPS


@dataclass(slots=True)
class LogprobsTensors:
    """Column 0 is the sampled token, columns 1..k the distribution's top-k."""

    token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    ranks: torch.Tensor  # [N] int64: 1 + number of tokens strictly more likely than the sampled one


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` [N, V] float32.

        ``generator`` drives the random rows that have no generator of their own in
        ``md.generators``; ``None`` means torch's default generator. ``noise``: the race's
        ``q``, drawn beforehand by ``draw_noise`` (the same draws, queued earlier).
        """
        assert logits.dim() == 2 and logits.dtype == torch.float32, "sampler expects [N, V] float32 logits"
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        logits = process_logits(logits, md)
        sampled = None if md.all_random else logits.argmax(dim=-1)
        if not md.all_greedy:
            random = sample_from_probs(sampling_probs(logits, md), md.generators, generator, noise)
            sampled = random if sampled is None else torch.where(md.temperature < SAMPLING_EPS, sampled, random)
        logprobs = None if raw_logprobs is None else gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def draw_noise(
        logits: torch.Tensor, md: SamplingMetadata, generator: torch.Generator | None
    ) -> torch.Tensor | None:
        """The exponential race's ``q`` for this batch (None: all greedy, nothing to draw),
        drawn now, as ``forward`` would: it depends on no logit, so it can be queued with
        the forward pass, ahead of whatever the sampling waits for (a grammar's bitmask)."""
        if md.all_greedy:
            return None
        return draw_race_noise(logits, md.generators, generator)

    @staticmethod
    def race_fusable(md: SamplingMetadata) -> bool:
        """Whether the ``exponential_race`` fused kernel can sample this batch in one pass: every
        row random, nothing between the (masked) logits and the race but the temperature,
        no logprobs, no per-request generators."""
        return (
            md.all_random and md.top_k is None and md.top_p is None and md.min_p is None and md.no_penalties
            and not md.banned_token_ids and md.allowed_token_mask is None and md.max_num_logprobs is None
            and not md.generators and md.logits_rows is None
        )


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The processors that apply to greedy and random rows alike: the allowed-token mask,
    requests' own logits rows (logit_bias, allowed_token_ids, bad_words), banned ids
    (min_tokens, bad words), penalties."""
    if md.allowed_token_mask is not None:
        logits = logits.masked_fill(~md.allowed_token_mask, float("-inf"))
    if md.logits_rows is not None:
        logits = logits.index_add(0, md.logits_rows_index, md.logits_rows)
    if md.banned_token_ids:
        logits = ban_tokens(logits, md.banned_token_ids)
    if not md.no_penalties:
        logits = apply_penalties(logits, md)
    return logits


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from: temperature, min-p, top-k, top-p, softmax
    over already processed logits (greedy rows come out at temperature 1; callers use argmax)."""
    logits = apply_temperature(logits, md.temperature)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k)
    return logits.softmax(dim=-1)


# --------------------------------------------------------------------------------------------
# Logits processors (all out of place: the caller's logits are never modified)
# --------------------------------------------------------------------------------------------


def ban_tokens(logits: torch.Tensor, stop_ids: dict[int, set[int]]) -> torch.Tensor:
    """Set ``stop_ids[row]`` to -inf in each row: EOS / stop tokens for rows still below their
    ``min_tokens``, bad words' last tokens."""
    rows = [row for row, ids in stop_ids.items() for _ in ids]
    cols = [tok for ids in stop_ids.values() for tok in ids]
    if not rows:
        return logits
    index = (
        torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True),
        torch.tensor(cols, dtype=torch.long).to(logits.device, non_blocking=True),
    )
    # torch.full fills on the device; torch.tensor(..., device=cuda) would be a host sync.
    return logits.index_put(index, torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] ids padded with ``vocab_size`` -> [N, V] occurrence counts (padding dropped)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.long, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def _pad_outputs(output_token_ids: list[list[int]], num_rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    rows = output_token_ids or [[] for _ in range(num_rows)]
    assert len(rows) == num_rows, "output_token_ids needs one list per logits row"
    width = max((len(r) for r in rows), default=0)
    padded = [r + [vocab_size] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.long).reshape(num_rows, width).to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output, HF rule), then frequency and presence (output only)."""
    num_rows, vocab_size = logits.shape
    output_ids = _pad_outputs(md.output_token_ids, num_rows, vocab_size, logits.device)
    output_counts = _bin_counts(output_ids, vocab_size)

    if md.repetition_penalties is not None:
        seen = output_counts > 0
        if md.prompt_token_ids is not None:
            seen |= _bin_counts(md.prompt_token_ids, vocab_size) > 0
        penalty = torch.where(seen, md.repetition_penalties[:, None], 1.0)
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if md.frequency_penalties is not None:
        logits = logits - md.frequency_penalties[:, None] * output_counts.to(logits.dtype)
    if md.presence_penalties is not None:
        logits = logits - md.presence_penalties[:, None] * (output_counts > 0).to(logits.dtype)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    # Greedy rows are sampled too in a mixed batch (then overwritten): keep them finite.
    safe = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    return logits / safe[:, None]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


# Top-k alone with every row's k at most this picks the k-th largest logit with one
# torch.topk instead of sorting the whole vocab (usual k are 20 to 100).
TOP_K_WITHOUT_SORT_MAX = 1024


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Top-k then top-p (nucleus) in one descending sort of the vocab.

    Top-k keeps every token tied with the k-th largest logit. Top-p keeps a token while the
    probability mass strictly before it is still below ``p``: the smallest set reaching ``p``,
    and always the most likely token. ``max_top_k`` is the host's largest ``top_k`` in the
    batch (``None``: not known); with top-k alone and a small one, no sort is needed.
    """
    if top_p is None and max_top_k is not None and max_top_k <= TOP_K_WITHOUT_SORT_MAX:
        return apply_top_k_without_sort(logits, top_k, max_top_k)
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size).long()
        kth_largest = sorted_logits.gather(-1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows at 1.0 are off: rounding in the cumsum must not trim their tails.
        drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_top_k_without_sort(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k as :func:`apply_top_k_top_p` does it (ties with the k-th largest kept, rows at 0
    left whole), reading each row's k-th largest logit off one ``topk`` of ``max_top_k``."""
    largest = logits.topk(min(max_top_k, logits.shape[-1]), dim=-1).values  # [N, max_top_k], descending
    k = top_k.clamp(1, largest.shape[-1]).long()
    kth_largest = largest.gather(-1, (k - 1)[:, None])
    kth_largest = kth_largest.masked_fill((top_k <= 0)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def sample_from_probs(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    generator: torch.Generator | None,
    q: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of ``probs`` (rows need not sum to 1), from its own ``generators[row]``
    if it has one, else from ``generator``.

    With noise ``q`` drawn beforehand, or on CUDA: the exponential race (no cumsum, no host
    sync, and one Triton kernel when fused). On the CPU, where nothing is queued ahead: the
    inverse CDF, one uniform per row against the row's running sum. The race draws a number
    per vocabulary entry; for 16 rows of 2,048 on one core the race took 230 us and the
    inverse CDF 60 us, about 3% of a served decode step of the demo model."""
    if q is None and probs.device.type == "cpu":
        return inverse_cdf(probs, generators, generator)
    return exponential_race(probs, generators, generator, q)


def inverse_cdf(
    probs: torch.Tensor, generators: dict[int, torch.Generator], generator: torch.Generator | None
) -> torch.Tensor:
    """``cdf_index`` of one ``u ~ U[0, 1)`` per row; a seeded row draws its ``u`` from its own
    generator, so its token depends on nothing else in the batch."""
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
    for row, row_generator in generators.items():
        u[row] = torch.rand(1, generator=row_generator, device=probs.device)
    return cdf_index(probs, u)


def cdf_index(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose running sum exceeds ``u * total`` (``u`` [N, 1] in [0,
    1)). The target is kept strictly below the row's total, where rounding could put ``u *
    total`` on it, so the token found always has a non-zero probability: the running sum
    steps over the target at it. A row with no mass at all (a grammar that allows no token:
    the softmax of all -inf is NaN) still gets an id in range, as the race's argmax gives
    one, so that the check after sampling names the cause instead of an index error."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    generator: torch.Generator | None,
    q: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample from each row of ``probs`` as ``argmax(probs / q)`` with ``q ~ Exp(1)``
    (``draw_race_noise``, unless given).

    Equivalent to a categorical draw, but needs no cumsum or host sync.
    """
    if q is None:
        q = draw_race_noise(probs, generators, generator)
    return (probs / q).argmax(dim=-1)


def draw_race_noise(
    like: torch.Tensor, generators: dict[int, torch.Generator], generator: torch.Generator | None
) -> torch.Tensor:
    """``q ~ Exp(1)`` shaped like ``like``, float32, clamped above 0. Seeded rows redraw their
    ``q`` with their own generator, so their token depends only on that generator."""
    q = _exponential(like.shape, like.device, generator)
    for row, row_generator in generators.items():
        q[row] = _exponential(like.shape[1:], like.device, row_generator)
    # Exp(1) can round to 0; a 0/0 would be NaN, which argmax treats as the maximum.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def _exponential(shape: torch.Size, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """``Exp(1)`` draws, float32. On the CPU as ``-log(1 - U)``: torch's CPU ``exponential_``
    transforms one element at a time, and 16 rows of 2,048 took 717 us against ~200 us this
    way (clamp included), a tenth of a decode step of the demo model served on one core."""
    if device.type == "cpu":
        return torch.rand(shape, generator=generator).neg_().log1p_().neg_()
    return torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)


# --------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    sampled_logprobs = raw_logprobs.gather(-1, sampled[:, None])
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
    token_ids, logprobs = sampled[:, None], sampled_logprobs
    if k > 0:
        top_logprobs, top_ids = raw_logprobs.topk(k, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        logprobs = torch.cat([logprobs, top_logprobs], dim=1)
    return LogprobsTensors(token_ids=token_ids, logprobs=logprobs, ranks=ranks)
