"""A model runner's place in a pipeline (``pipeline_parallel_size > 1``): its stage's part of
each forward pass, between the previous stage's output and the next stage's input, and the
step's sampled ids shared from the last stage to every rank.

Every rank runs every step (the same ``SchedulerOutput``) one stage after the other::

    stage 0: embed, layers [0, k)  --send-->  stage 1: layers [k, n), norm, LM head, sample
       ^                                                                   |
       +---------------- broadcast of the sampled ids to every rank -------+

The last stage's ids reach rank 0's scheduler and keep each runner's copy of the requests'
tokens in step. One batch is in flight at a time: the stages run in turn, they do not yet
overlap on micro-batches.
"""

from __future__ import annotations

import torch
from torch import nn

from pagelm.distributed import (
    broadcast_from_last_stage,
    parallel_state,
    recv_from_previous_stage,
    send_to_next_stage,
)


class PipelineStage:
    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        if not getattr(model, "supports_pipeline_parallel", False):
            raise ValueError(
                f"{type(model).__name__} does not split into pipeline stages; use pipeline_parallel_size=1"
            )
        state = parallel_state()
        self.is_first, self.is_last = state.is_first_stage, state.is_last_stage
        self.dtype, self.device = dtype, device

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """This stage's part of the forward pass: the hidden states on the last stage, None on
        the others (their output went to the next stage)."""
        intermediate = None
        if not self.is_first:
            empty = model.make_empty_intermediate_tensors(positions.shape[0], self.dtype, self.device)
            intermediate = recv_from_previous_stage(empty)
        out = model(input_ids, positions, intermediate)
        if self.is_last:
            return out
        send_to_next_stage(out)
        return None

    def share_samples(self, sampled: torch.Tensor | None, num_reqs: int) -> torch.Tensor:
        """The last stage's sampled ids (``sampled`` there, None elsewhere) on every rank."""
        if sampled is None:
            sampled = torch.empty(num_reqs, dtype=torch.long, device=self.device)
        return broadcast_from_last_stage(sampled.long())
