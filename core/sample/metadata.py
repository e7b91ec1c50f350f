"""SamplingMetadata: the per-step, batched view of every running request's SamplingParams.

Row ``i`` of every tensor belongs to the ``i``-th request in the step's batch. Knobs nobody in
the batch uses are ``None`` so the sampler skips their work entirely (for example, no vocab
sort unless some row has top-k or top-p). Building it is the input batch's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingMetadata:
    # [N] float32; rows below pagelm.sampling_params.SAMPLING_EPS decode greedily.
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [N] int, 0 = off for that row
    # The largest top_k, known on the host: top-k alone with a small one skips the vocab sort.
    max_top_k: int | None = None
    top_p: torch.Tensor | None = None  # [N] float32, 1.0 = off
    min_p: torch.Tensor | None = None  # [N] float32, 0.0 = off
    # Row -> that request's own generator (seeded requests), so its draws never depend on
    # which other requests share the batch. Other random rows use the step's default generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # None: nobody wants logprobs; k >= 0: every row gets the sampled token plus its top-k.
    max_num_logprobs: int | None = None
    # [N, max_prompt_len] int64 padded with vocab_size; only needed by repetition penalty.
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: list[list[int]] = field(default_factory=list)
    presence_penalties: torch.Tensor | None = None  # [N] float32, None if all 0
    frequency_penalties: torch.Tensor | None = None  # [N] float32, None if all 0
    repetition_penalties: torch.Tensor | None = None  # [N] float32, None if all 1
    # Row -> token ids forbidden this step: EOS / stop ids while below min_tokens, the last
    # token of a bad word whose other tokens end the output.
    banned_token_ids: dict[int, set[int]] = field(default_factory=dict)
    # Requests' own logits rows (logit_bias, allowed_token_ids, one-token bad_words; see
    # pagelm.sample.request_logits): [k] batch rows and [k, V] float32 added to them.
    # None when no request in the batch has one.
    logits_rows_index: torch.Tensor | None = None
    logits_rows: torch.Tensor | None = None
    # [N, vocab] bool, the guided-decoding seam: False -> logit set to -inf.
    allowed_token_mask: torch.Tensor | None = None

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalties is None
            and self.frequency_penalties is None
            and self.repetition_penalties is None
        )
