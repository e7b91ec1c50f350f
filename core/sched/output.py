"""What the scheduler tells the model runner each step. Plain data, no tensors: the whole
decision is "which requests, how many tokens each, which new blocks", and, for guided
requests, where their allowed-token bitmask comes from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagelm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagelm.multimodal import MultiModalFeature


@dataclass
class NewRequestData:
    """A request the runner has not seen (first admission, or resumed after preemption,
    in which case ``output_token_ids`` is not empty and must be recomputed too)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    need_prompt_logprobs: bool
    mm_features: list[MultiModalFeature] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """A request already running on the runner: only its new blocks."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class KVTransfers:
    """One step's block copies, queued before its forward pass in this order::

        swap_out: GPU block -> tier block    (victims' blocks, spilled prefix blocks)
        swap_in:  tier block -> GPU block    (resumed requests, prefix hits in the tier)

    Out first: a GPU block freed by a swap-out may be the destination of a swap-in.

    Loads (swap-ins) are asynchronous: ``loads`` names the request each run of ``swap_in``
    pairs is for, and no forward pass waits for them until the scheduler, told by the runner
    that a request's load is done (``ModelRunnerOutput.finished_loads``), lists the request in
    a later step's ``waits``: every rank's forward pass of that step waits for its own copy of
    that load (the first rank's copy being done says nothing of the others'). A load given up
    (its request aborted) is listed in ``waits`` too: its blocks may be reused."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block_id, tier_block_id)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (tier_block_id, gpu_block_id)
    loads: list[tuple[str, int]] = field(default_factory=list)  # (req_id, its swap_in pairs), in order
    waits: list[str] = field(default_factory=list)  # req_ids whose loads this step's forward reads

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.waits)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # {req_id: num_tokens}: the whole scheduling decision, in batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests whose runner-side state must be dropped before this step.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests under a grammar (guided decoding) that sample a token this step, and how the
    # runner gets their allowed-token bitmask: ``grammar_bitmask(req_ids, drafts=None)``
    # (StructuredOutputManager.grammar_bitmask; None when no request is guided). A call, not a
    # tensor: the runner makes it once the forward pass is queued, so that the grammar work of
    # the previous step overlaps the pass rather than delaying it.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Callable[[list[str], Sequence[Sequence[int]] | None], Any] | None = None
    # Some request's sampling reads its previous tokens on the host (penalties): with async
    # scheduling this step waits for the one in flight and runs synchronously. (Grammars need
    # them too, but only for the bitmask: that step's forward pass still runs ahead.)
    needs_previous_tokens: bool = False
    # Speculative decoding: {req_id: draft token ids} verified this step. They are the last
    # tokens of the request's ``num_scheduled_tokens``, after its known tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Block copies between the GPU pool and the second KV tier, run before the forward pass
    # (None: none, always without a tier; see pagelm.kv_offload).
    kv_transfers: KVTransfers | None = None
    # Multimodal: {req_id: indices into its mm_features} the runner encodes this step (each
    # image once, whoever else needs it), and the identifiers whose embeddings it may drop
    # (evicted from the encoder cache), dropped before this step's encoding.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_identifiers: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
