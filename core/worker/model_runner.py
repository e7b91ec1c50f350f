"""The model runner: turns a ``SchedulerOutput`` into one flattened forward pass and samples.

It keeps per-request token ids and block ids between steps (the scheduler sends only what
changed), builds ``input_ids``, ``positions``, ``slot_mapping``, ``query_start_loc``,
``seq_lens`` and the block table, runs the model inside a forward context, samples the last
token of every request, and returns plain lists. ``.tolist()`` on the sampled ids is the one
host sync per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagelm.attention import (
    AttentionBackend,
    CommonAttentionMetadata,
    ForwardContext,
    attention_layers,
    forward_context,
)
from pagelm.config import EngineConfig
from pagelm.sample import Sampler
from pagelm.sampling_params import SamplingParams
from pagelm.sched.output import SchedulerOutput
from pagelm.worker.output import LogprobsLists, ModelRunnerOutput
from pagelm.worker.sampling_inputs import build_sampling_metadata


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs known so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    need_prompt_logprobs: bool
    output_token_ids: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        backend: type[AttentionBackend],
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        eos_token_ids: frozenset[int],
        vocab_size: int,
    ) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches = self._bind_attention(backend, num_blocks, dtype)
        self.metadata_builder = backend.make_metadata_builder(device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device).manual_seed(config.seed)

    def _bind_attention(self, backend: type[AttentionBackend], num_blocks: int, dtype: torch.dtype):
        caches = []
        for idx, layer in enumerate(attention_layers(self.model)):
            spec = layer.spec
            shape = backend.get_kv_cache_shape(num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
            cache = torch.zeros(shape, dtype=dtype, device=self.device)
            layer.layer_idx, layer.impl, layer.kv_cache = idx, backend.make_impl(spec), cache
            caches.append(cache)
        return caches

    # ---- request state -------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                need_prompt_logprobs=new.need_prompt_logprobs,
                output_token_ids=list(new.output_token_ids),
            )
        for cached in sched.scheduled_cached_reqs:
            self.requests[cached.req_id].block_ids.extend(cached.new_block_ids)

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        req_ids = list(sched.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        num_computed = {r.req_id: r.num_computed_tokens for r in sched.scheduled_new_reqs}
        num_computed.update({r.req_id: r.num_computed_tokens for r in sched.scheduled_cached_reqs})
        states = [self.requests[r] for r in req_ids]
        starts = [num_computed[r] for r in req_ids]
        counts = [sched.num_scheduled_tokens[r] for r in req_ids]

        input_ids, positions, common = self._prepare_inputs(states, starts, counts)
        attn_metadata = self.metadata_builder.build(common)
        with forward_context(ForwardContext(attn_metadata=attn_metadata)):
            hidden = self.model(input_ids, positions)

        last = common.query_start_loc[1:].long() - 1
        logits = self.model.compute_logits(hidden[last])
        md = build_sampling_metadata(states, self.eos_token_ids, self.vocab_size, self.device)
        sampled = self.sampler(logits, md, self.generator)

        prompt_logprobs = self._prompt_logprobs(states, starts, counts, hidden, common)
        sampled_ids = sampled.sampled_token_ids.tolist()  # the one host sync per step
        logprobs = _split_logprobs(sampled.logprobs, states)

        out_ids: list[list[int]] = []
        for state, start, count, token in zip(states, starts, counts, sampled_ids):
            if start + count >= len(state.token_ids):  # reached the end: the sample is real
                state.token_ids.append(token)
                state.output_token_ids.append(token)
                out_ids.append([token])
            else:  # a prefill chunk that stops short: nothing to sample yet
                out_ids.append([])
        return ModelRunnerOutput(req_ids, out_ids, logprobs, prompt_logprobs)

    def _prepare_inputs(self, states, starts, counts):
        """Flatten the batch::

            input_ids     | r0: tokens[c0:c0+n0] | r1: tokens[c1:c1+n1] | ...
            positions     | c0 ... c0+n0-1       | c1 ... c1+n1-1       | ...
            slot_mapping  block_table[r][pos // block_size] * block_size + pos % block_size
        """
        bs = self.block_size
        num_reqs = len(states)
        counts_np = np.asarray(counts, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(counts_np, out=query_start_loc[1:])
        seq_lens = (starts_np + counts_np).astype(np.int32)
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        for i, s in enumerate(states):
            block_table[i, : len(s.block_ids)] = s.block_ids

        req_index = np.repeat(np.arange(num_reqs), counts_np)
        positions = np.arange(int(query_start_loc[-1]), dtype=np.int64) - np.repeat(
            query_start_loc[:-1].astype(np.int64) - starts_np, counts_np
        )
        slot_mapping = block_table[req_index, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = np.fromiter(
            (t for s, c, n in zip(states, starts, counts) for t in s.token_ids[c : c + n]),
            dtype=np.int64,
            count=int(query_start_loc[-1]),
        )

        dev = self.device
        qsl_cpu = torch.from_numpy(query_start_loc)
        seq_lens_cpu = torch.from_numpy(seq_lens)
        common = CommonAttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(counts_np.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            seq_lens=seq_lens_cpu.to(dev, non_blocking=True),
            block_table=torch.from_numpy(block_table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            block_size=bs,
        )
        return (
            torch.from_numpy(input_ids).to(dev, non_blocking=True),
            torch.from_numpy(positions).to(dev, non_blocking=True),
            common,
        )

    def _prompt_logprobs(self, states, starts, counts, hidden, common) -> dict[str, LogprobsLists]:
        """Logits at position ``p`` score prompt token ``p + 1``; a chunk ``[c, c+n)`` scores
        prompt tokens ``c+1 .. min(c+n, P-1)``."""
        out = {}
        qsl = common.query_start_loc_cpu.tolist()
        for i, (state, start, count) in enumerate(zip(states, starts, counts)):
            if not state.need_prompt_logprobs:
                continue
            num = min(start + count, state.num_prompt_tokens - 1) - start
            if num <= 0:
                continue
            k = state.sampling_params.prompt_logprobs
            logits = self.model.compute_logits(hidden[qsl[i] : qsl[i] + num])
            targets = torch.tensor(
                state.token_ids[start + 1 : start + 1 + num], device=logits.device, dtype=torch.long
            )
            out[state.req_id] = logprobs_lists(torch.log_softmax(logits.float(), dim=-1), targets, k)
        return out


def logprobs_lists(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobsLists:
    """Chosen token first, then the top ``k``; rank = 1 + count of strictly likelier tokens."""
    chosen_lp = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=1) if k > 0 else (logprobs[:, :0], chosen[:, None][:, :0])
    ids = torch.cat([chosen[:, None], top_ids], dim=1)
    lps = torch.cat([chosen_lp, top_lp], dim=1)
    return LogprobsLists(ids.tolist(), lps.tolist(), ranks.tolist())


def _split_logprobs(tensors, states) -> list[LogprobsLists | None]:
    if tensors is None:
        return [None] * len(states)
    ids, lps, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    out = []
    for i, s in enumerate(states):
        k = s.sampling_params.logprobs
        out.append(None if k is None else LogprobsLists([ids[i][: k + 1]], [lps[i][: k + 1]], [ranks[i]]))
    return out
