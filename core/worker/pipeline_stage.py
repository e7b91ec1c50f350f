"""A model runner's place in a pipeline (``pipeline_parallel_size > 1``): its stage's part of
each forward pass, between the previous stage's output and the next stage's input, and the
step's sampled ids shared from the last stage to every rank.

Every rank runs every step (the same ``SchedulerOutput``) one stage after the other::

    stage 0: embed, layers [0, k)  --send-->  stage 1: layers [k, n), norm, LM head, sample
       ^                                                                   |
       +---------------- broadcast of the sampled ids to every rank -------+

The last stage's ids reach rank 0's scheduler and keep each runner's copy of the requests'
tokens in step. Up to ``pipeline_parallel_size`` steps (micro-batches, each over requests of
its own) are in flight, so the stages work at once::

    stage 0:  | A | B | A'| B'|          every rank launches and finishes steps in rank 0's
    stage 1:      | A | B | A'| B'|      order ("step", "finish" messages): sends are
                                          non-blocking, the broadcast of A's ids comes after B
                                          is launched everywhere

A request takes part in one step at a time (the scheduler's ``await_samples``): its next
token's input is the id the last stage samples. The last stage samples the oldest step
(``before_forward``) between receiving the next step's input and running it: then A's ids
reach rank 0 as stage 0 finishes B, and rank 0 schedules A' while stage 1 runs B.

``PAGELM_PP_PROFILE=1`` times each stage's part of every forward pass (CUDA events on a GPU)
and logs, when the stage is closed, its busy fraction of the time from its first forward
pass to its last; off (the default) it costs one attribute test per step.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
from torch import nn

from pagelm.distributed import (
    broadcast_from_last_stage,
    last_stage_to_rank0,
    parallel_state,
    recv_from_previous_stage,
    send_to_next_stage,
)
from pagelm.sample.sampler import LogprobsTensors

logger = logging.getLogger(__name__)

# How long ``close`` waits for one send still in flight (a live peer takes it at once).
_CLOSE_WAIT_S = 5.0


class PipelineStage:
    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        if not getattr(model, "supports_pipeline_parallel", False):
            raise ValueError(
                f"{type(model).__name__} does not split into pipeline stages; use pipeline_parallel_size=1"
            )
        state = parallel_state()
        self.is_first, self.is_last = state.is_first_stage, state.is_last_stage
        self.dtype, self.device = dtype, device
        # Sends to the next stage not yet known complete, oldest step first.
        self._sends: list[list] = []
        # Run on the last stage after the receive, before the forward pass (set per launch).
        self.before_forward = None
        self.stage_index = state.pp_rank
        self._profile = _StageProfile(device) if os.environ.get("PAGELM_PP_PROFILE") == "1" else None

    def _received(self) -> None:
        """This step's input is here: the oldest step's sampling first (last stage), then the
        forward pass (timed under ``PAGELM_PP_PROFILE``)."""
        if self.before_forward is not None:
            hook, self.before_forward = self.before_forward, None
            hook()
        if self._profile is not None:
            self._profile.start()

    def _ran(self) -> None:
        if self._profile is not None:
            self._profile.stop()

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """This stage's part of the forward pass: the hidden states on the last stage, None on
        the others (their output went to the next stage)."""
        intermediate = None
        if not self.is_first:
            empty = model.make_empty_intermediate_tensors(positions.shape[0], self.dtype, self.device)
            intermediate = recv_from_previous_stage(empty)
        self._received()
        out = model(input_ids, positions, intermediate)
        self._ran()
        if self.is_last:
            return out
        self._sends.append(send_to_next_stage(out))
        return None

    def replay(self, graphs, size: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step through this stage's captured graph of ``size`` (``CudaGraphRunner``
        with this stage; inputs loaded): the previous stage's ``num_tokens`` real rows
        received into the graph's persistent input first, its own output's real rows sent on
        after. The graph's ``(hidden, logits)`` on the last stage, None on the others."""
        if not self.is_first:
            recv_from_previous_stage({name: t[:num_tokens] for name, t in graphs.intermediate.items()})
        self._received()
        hidden, logits = graphs.replay(size)
        self._ran()
        if self.is_last:
            # Copies: the step is sampled when the engine finishes it, after later steps'
            # replays have overwritten the graph's outputs.
            return hidden[:num_tokens].clone(), logits[:num_tokens].clone()
        # A copy: the graph's output buffers are overwritten by the next replay while the
        # send may still be reading them.
        self._sends.append(send_to_next_stage({name: t[:num_tokens].clone() for name, t in hidden.items()}))
        return None

    def share_samples(self, sampled: torch.Tensor | None, num_reqs: int) -> torch.Tensor:
        """The last stage's sampled ids of the oldest step in flight (``sampled`` there, None
        elsewhere) on every rank."""
        if self._sends:  # that step's output has reached the next stage by now
            for work, _ in self._sends.pop(0):
                work.wait()
        if sampled is None:
            sampled = torch.empty(num_reqs, dtype=torch.long, device=self.device)
        return broadcast_from_last_stage(sampled.long())

    def share_verified(self, token_ids: list[list[int]] | None, num_drafts: list[int]) -> list[list[int]]:
        """The last stage's verified tokens of a step verifying drafts (``token_ids`` there,
        None elsewhere: per request its accepted drafts then the target's token) on every
        rank. They travel as ``[requests, 1 + most drafts]`` padded with -1, a shape every
        rank knows from the step's drafts. The step is launched and verified at once, so its
        send (the last one queued) has reached the next stage once the broadcast is back."""
        width = 1 + max(num_drafts, default=0)
        rows = torch.full((len(num_drafts), width), -1, dtype=torch.long)
        if token_ids is not None:
            for i, tokens in enumerate(token_ids):
                rows[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        rows = broadcast_from_last_stage(rows.to(self.device)).tolist()
        if self._sends:
            for work, _ in self._sends.pop():
                work.wait()
        return [[t for t in row if t >= 0] for row in rows]

    def share_drafts(self, drafts: list[list[int]] | None, num_reqs: int, k: int) -> list[list[int]]:
        """The last stage's proposal (``drafts`` there, None elsewhere: a proposer that reads
        the target's pass lives on the last stage alone) on rank 0, whose scheduler keeps it.
        It travels as ``[requests, k]`` padded with -1; the ranks that neither propose nor
        schedule get no drafts."""
        rows = torch.full((num_reqs, k), -1, dtype=torch.long)
        if drafts is not None:
            for i, tokens in enumerate(drafts):
                rows[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        (rows,) = last_stage_to_rank0([rows.to(self.device)])
        if drafts is not None:
            return drafts
        if parallel_state().rank != 0:
            return [[] for _ in range(num_reqs)]
        return [[t for t in row if t >= 0] for row in rows.tolist()]

    def share_logprobs(
        self, logprobs: LogprobsTensors | None, num_reqs: int, k: int | None,
        prompt_logprobs: dict[str, LogprobsTensors], prompt_rows: list[tuple[str, int, int]],
    ) -> tuple[LogprobsTensors | None, dict[str, LogprobsTensors]]:
        """The last stage's logprobs of a step (``k`` top tokens for ``num_reqs`` samples, None:
        nobody asked) and prompt logprobs (``prompt_rows``: request, positions, top tokens) on
        rank 0, the one rank that reads them; every rank knows the shapes from the step."""
        if not self.is_last:
            logprobs = None if k is None else _empty_logprobs(num_reqs, k, self.device)
            prompt_logprobs = {r: _empty_logprobs(n, kp, self.device) for r, n, kp in prompt_rows}
        parts = [] if logprobs is None else [logprobs]
        parts += [prompt_logprobs[r] for r, _, _ in prompt_rows]
        for t in parts:  # the sender's dtypes are the receiver's
            t.token_ids, t.logprobs, t.ranks = t.token_ids.long(), t.logprobs.float(), t.ranks.long()
        last_stage_to_rank0([x for t in parts for x in (t.token_ids, t.logprobs, t.ranks)])
        return logprobs, prompt_logprobs

    def reset(self) -> None:
        """Forget the sends of failed steps."""
        self._sends.clear()
        self.before_forward = None

    def close(self) -> None:
        """Before leaving the process group: wait for the sends still in flight (NCCL's
        teardown waits for outstanding point-to-point work, and a send's tensor must outlive
        it), and log the profile (``PAGELM_PP_PROFILE``)."""
        self.before_forward = None
        sends, self._sends = self._sends, []
        try:
            for step in sends:
                for work, _ in step:
                    if not work.is_completed():
                        work.wait(timedelta(seconds=_CLOSE_WAIT_S))
        except Exception as e:  # the next stage is gone (a rank failed): nothing will take them
            logger.warning("pipeline stage %d: sends still in flight at shutdown dropped (%s)", self.stage_index, e)
        if self._profile is not None:
            self._profile.report(self.stage_index)
            self._profile = None


class _StageProfile:
    """Busy time of one stage: its forward passes' spans, host clock on CPU, CUDA events on
    a GPU (read once, at ``report``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list = []
        self._open = None

    def start(self) -> None:
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.spans.append((self._open, end))

    def report(self, stage: int) -> None:
        if not self.spans:
            return
        if self.cuda:
            torch.cuda.synchronize()
            first = self.spans[0][0]
            spans = [(first.elapsed_time(a) / 1e3, first.elapsed_time(b) / 1e3) for a, b in self.spans]
        else:
            spans = [(a - self.spans[0][0], b - self.spans[0][0]) for a, b in self.spans]
        wall = spans[-1][1] - spans[0][0]
        busy = sum(b - a for a, b in spans)
        share = busy / wall if wall > 0 else 0.0
        logger.warning("pagelm pp profile: stage %d: %d forward passes, busy %.3f s of %.3f s = %.1f%% (idle %.1f%%)",
                       stage, len(spans), busy, wall, 100 * share, 100 * (1 - share))


def _empty_logprobs(n: int, k: int, device: torch.device) -> LogprobsTensors:
    return LogprobsTensors(
        torch.empty((n, k + 1), dtype=torch.long, device=device),
        torch.empty((n, k + 1), dtype=torch.float32, device=device),
        torch.empty(n, dtype=torch.long, device=device),
    )
