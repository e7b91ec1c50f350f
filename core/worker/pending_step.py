"""A launched step: what ``ModelRunner.launch`` leaves in flight and ``ModelRunner.finish``
completes. Launching queues the inputs, the forward pass, the sampler and the copy of the
sampled ids into host memory of the step's own; finishing waits for that copy. With async
scheduling the engine launches step N before it finishes step N-1, so that the host work
between two steps overlaps the device::

    host:    | launch N | finish N-1: wait, outputs | schedule N+1 | launch N+1 | finish N | ...
    device:  ... step N-1 ...|.............. step N ...............|....... step N+1 .......

Until a step is finished its samples stand as placeholders (token 0) in the runner's token
lists. A decode launched right after the step that sampled its input gets that input device
to device: ``feeds`` lists them, the runner copies them from ``sampled`` into its input ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagelm.sample.sampler import LogprobsTensors
from pagelm.sched.output import SchedulerOutput
from pagelm.worker.output import LogprobsLists, ModelRunnerOutput

if TYPE_CHECKING:
    from pagelm.worker.step_state import CachedRequestState, StepInputs

# Stands in a token list for a sample still on the device; never read as a real token.
PLACEHOLDER_TOKEN = 0


@dataclass
class PendingStep:
    sched: SchedulerOutput
    req_ids: list[str]
    # Each request's runner state, kept even after the runner drops it (finished, preempted):
    # its sample still replaces the placeholder there, and the scheduler discards it.
    states: list["CachedRequestState"]
    # Per request: where in its token list this step's sample goes (its placeholder), or -1
    # when the step samples nothing for it (a prefill chunk that stops short).
    sample_positions: list[int] = field(default_factory=list)
    sampled: torch.Tensor | None = None  # [num_reqs] int64, on the device
    # Host copies (pinned, one set per step, so a later step never overwrites them before
    # they are read) and the event recorded once they are written.
    sampled_host: torch.Tensor | None = None
    logprobs_host: LogprobsTensors | None = None
    prompt_logprobs_host: dict[str, LogprobsTensors] = field(default_factory=dict)
    copied: torch.cuda.Event | None = None
    # The step's inputs, kept until it is sampled, and for the speculative proposer, which
    # runs once the samples are known (``ModelRunner.finish``).
    inputs: "StepInputs | None" = None
    hidden: torch.Tensor | None = None
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    # Set when the step completed inside ``launch`` (nothing scheduled; speculative steps).
    output: ModelRunnerOutput | None = None
    # Between ``launch(defer_sampling=True)`` and ``sample``: the forward pass's logits and
    # the sampling parameters of the step.
    logits: torch.Tensor | None = None
    sampling_metadata: Any = None
    # The sampler's random draws for the step (``Sampler.draw_noise``), queued at launch (CUDA).
    noise: torch.Tensor | None = None
    # Speculative decoding: the proposer skips this step's proposal (``Proposer.skip_ahead``).
    skip_proposal: bool = False

    @property
    def awaits_sampling(self) -> bool:
        """Launched with ``defer_sampling`` and not sampled yet (``ModelRunner.sample``)."""
        return self.logits is not None

    @classmethod
    def done(cls, sched: SchedulerOutput, output: ModelRunnerOutput) -> "PendingStep":
        return cls(sched, output.req_ids, [], output=output)

    def copy_to_host(
        self, sampled: torch.Tensor, logprobs: LogprobsTensors | None, prompt_logprobs: dict[str, LogprobsTensors],
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Queue the device-to-host copies of the step's results and record ``copied`` (on
        ``stream``, the runner's: the current one when None)."""
        self.sampled = sampled
        self.sampled_host = to_host(sampled)
        self.logprobs_host = None if logprobs is None else logprobs_to_host(logprobs)
        self.prompt_logprobs_host = {r: logprobs_to_host(t) for r, t in prompt_logprobs.items()}
        if sampled.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record(stream)

    def wait(self) -> None:
        """Block until the host copies are written (a host sync on CUDA; nothing on CPU)."""
        if self.copied is not None:
            self.copied.synchronize()

    def feeds(self, states: list[Any], starts: list[int], counts: list[int]) -> tuple[list[int], list[int]]:
        """For the next step's batch (``states``, ``starts``, ``counts``): the flat indices of
        its input tokens that are this step's samples, and their rows of ``sampled``."""
        rows = {s.req_id: i for i, (s, p) in enumerate(zip(self.states, self.sample_positions)) if p >= 0}
        dst, src, offset = [], [], 0
        for state, start, count in zip(states, starts, counts):
            i = rows.get(state.req_id)
            # The same state, not one made anew for a request that was dropped and came back.
            if i is not None and self.states[i] is state and start <= self.sample_positions[i] < start + count:
                dst.append(offset + self.sample_positions[i] - start)
                src.append(i)
            offset += count
        return dst, src


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: on CUDA a non-blocking copy into pinned memory of its own, valid
    once the step's ``copied`` event has completed; on the CPU ``t`` itself."""
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def logprobs_to_host(t: LogprobsTensors) -> LogprobsTensors:
    return LogprobsTensors(to_host(t.token_ids), to_host(t.logprobs), to_host(t.ranks))


def logprobs_lists(t: LogprobsTensors) -> LogprobsLists:
    return LogprobsLists(t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist())
