"""What the runner keeps per request and builds per step, and the marker of its deliberate
host syncs: shared by the runner, its pending steps and the speculative runner, below all
three so that none of them imports another to get at it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagelm.attention import CommonAttentionMetadata
from pagelm.multimodal import RequestPositions
from pagelm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs so far (a step in flight: PLACEHOLDER_TOKEN)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    need_prompt_logprobs: bool
    output_token_ids: list[int] = field(default_factory=list)
    row: int = -1  # this request's row in the runner's CPU block table
    # Its logit_bias / allowed_token_ids / one-token bad_words as one [vocab] row, built when
    # it joins the runner (pagelm.sample.request_logits); None when it uses none of them.
    logits_row: torch.Tensor | None = None
    # Whether its token is the argmax of the raw logits (``argmax_only``): a verification
    # step of such requests needs no sampling metadata. Set when it joins the runner.
    argmax_only: bool = False
    # Its images (pagelm.multimodal.MultiModalFeature), by offset; empty for text.
    mm_features: list = field(default_factory=list)
    # Its own rotary positions (pagelm.multimodal.RequestPositions; M-RoPE), made when it
    # joins the runner; None: each token's index.
    positions: RequestPositions | None = None


@dataclass
class StepInputs:
    num_reqs: int
    num_tokens: int
    common: CommonAttentionMetadata
    input_ids: torch.Tensor | None  # None: a graph replay reads its own staging
    positions: torch.Tensor | None
    uniform_decode: bool  # one token per request: hidden row i is request i's last token
    graph_size: int | None = None  # replay the CUDA graph of this (padded) batch size
    # Image embeddings at this step's placeholder positions: ``(embeddings [n, hidden],
    # is_multimodal [num_tokens] bool)``; None when the step covers none (text never has them).
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # The requests' whole block-table rows, kept with a copy of the step for a proposer that
    # runs after later launches (``SpecDecodeRunner.keep_inputs``); None: read the runner's.
    block_table_rows: np.ndarray | None = None


class host_sync_point:
    """Marks the step's deliberate device-to-host reads. GPU tests decode under
    ``torch.cuda.set_sync_debug_mode("error")`` to prove that nothing else synchronises.
    A class, not a generator context manager: entered a few times every step, where a
    generator's frames cost more than the check itself."""

    __slots__ = ("mode",)

    # Whether this process sees a GPU (the sync debug mode exists only then): asked at the
    # first use, as before, then kept.
    cuda: bool | None = None

    def __enter__(self) -> None:
        cuda = host_sync_point.cuda
        if cuda is None:
            cuda = host_sync_point.cuda = torch.cuda.is_available()
        self.mode = torch.cuda.get_sync_debug_mode() if cuda else 0
        if self.mode:
            torch.cuda.set_sync_debug_mode(0)

    def __exit__(self, *exc) -> None:
        if self.mode:
            torch.cuda.set_sync_debug_mode(self.mode)
