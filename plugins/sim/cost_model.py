"""A model runner that costs a step instead of computing it.

The step time is linear in what the step does, the usual roofline-style approximation::

    step_s = step_overhead + new_tokens * per_token + context_tokens * per_context_token

``new_tokens`` are this step's prefill-chunk and decode tokens (weight-bound compute),
``context_tokens`` the KV each scheduled request attends over (KV reads). The defaults are
roughly Llama-3-8B in bf16 on one H100.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagelm.request import Request
from pagelm.sched.output import SchedulerOutput
from pagelm.worker.output import ModelRunnerOutput

EOS_TOKEN_ID = 0
OTHER_TOKEN_ID = 1


@dataclass(frozen=True)
class CostModel:
    step_overhead_ms: float = 5.0
    per_token_ms: float = 0.03
    per_context_token_ms: float = 0.00004

    def step_seconds(self, out: SchedulerOutput, requests: dict[str, Request]) -> float:
        # The scheduler books progress when it schedules, so num_computed_tokens is already
        # the post-step sequence length: exactly the context attended over.
        context = sum(requests[req_id].num_computed_tokens for req_id in out.num_scheduled_tokens)
        ms = (
            self.step_overhead_ms
            + self.per_token_ms * out.total_num_scheduled_tokens
            + self.per_context_token_ms * context
        )
        return ms / 1000.0


def simulated_runner_output(
    out: SchedulerOutput, requests: dict[str, Request], output_lens: dict[str, int]
) -> ModelRunnerOutput:
    """What a model would sample: EOS on a request's ``output_len``-th token, else a filler
    token. The scheduler keeps it only for requests whose step reached their last token."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [EOS_TOKEN_ID if requests[r].num_output_tokens + 1 >= output_lens[r] else OTHER_TOKEN_ID] for r in req_ids
    ]
    return ModelRunnerOutput(req_ids, sampled)
