"""An EAGLE head's drafting argmax, over the target's whole vocabulary or over a *draft
vocabulary* (EAGLE-3's reduced vocabulary): a head checkpoint may carry the target token ids
it drafts from, and each drafting pass then reads only those rows of the target's LM head::

    head output g [N, h] --> g @ W[draft_vocab]^T --> argmax i [N] --> draft_vocab[i] [N]
                             (rows gathered at load:           (one index_select on the
                              [V_draft, h], V_draft << V)        device: target token ids)

At llama-3.1-8b shapes the LM head is 128,256 x 4,096 (1 GB in bf16) and a drafting pass
reads it whole only to take an argmax; 32,768 rows read a quarter of that. Output stays
lossless whatever the head drafts, since the target verifies every draft; a draft vocabulary
only bounds what can be accepted (a token outside it is never drafted).

The checkpoint's layout (``pagelm train-eagle --draft-vocab-size N`` writes it): the tensor
``draft_vocab`` (integer target ids, distinct) in its safetensors beside the head's weights,
and ``draft_vocab_size`` in its ``config.json``. The ids are kept sorted ascending (the
loader sorts them), so that among tied logits the draft is the lowest id, as the full
head's argmax picks it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagelm.distributed import all_reduce
from pagelm.models import ops
from pagelm.models.layers import ParallelLMHead, VocabParallelEmbedding

logger = logging.getLogger("pagelm")

# The name of the draft vocabulary's tensor in a head's safetensors.
DRAFT_VOCAB_TENSOR = "draft_vocab"


def check_draft_vocab(ids: torch.Tensor, vocab_size: int, config_size: int | None = None) -> torch.Tensor:
    """``ids`` as a checkpoint may give them (any order), checked against the target's
    ``vocab_size`` and the config's ``draft_vocab_size``: sorted ascending, int64."""
    if ids.dim() != 1 or ids.is_floating_point() or ids.numel() == 0:
        raise ValueError(f"draft_vocab must be a non-empty 1-D tensor of token ids, got {tuple(ids.shape)} {ids.dtype}")
    ids = ids.long()
    sorted_ids = torch.unique(ids)
    if len(sorted_ids) != len(ids):
        raise ValueError(f"draft_vocab lists {len(ids) - len(sorted_ids)} token ids more than once")
    if sorted_ids[0] < 0 or sorted_ids[-1] >= vocab_size:
        raise ValueError(f"draft_vocab has ids outside the target's vocabulary [0, {vocab_size}): "
                         f"{sorted_ids[0].item()}..{sorted_ids[-1].item()}")
    if config_size is not None and config_size != len(ids):
        raise ValueError(f"config.json says draft_vocab_size={config_size}, the draft_vocab tensor has {len(ids)} ids")
    return sorted_ids


class DraftLMHead:
    """Hidden states -> draft token ids (the target's): the argmax of the target's logits,
    over the whole vocabulary (``draft_vocab`` None) or over ``draft_vocab``'s columns."""

    def __init__(self, target: nn.Module, draft_vocab: torch.Tensor | None, device: torch.device) -> None:
        self.compute_logits = target.compute_logits
        self.vocab: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if draft_vocab is not None:
            self._use_rows(target, draft_vocab.to(device))

    @property
    def size(self) -> int | None:
        """How many ids the argmax ranges over (None: the target's whole vocabulary)."""
        return None if self.vocab is None else len(self.vocab)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, V]``: the target's (``compute_logits``), or
        their columns for the draft vocabulary ``[N, V_draft]``."""
        if self.weight is None:
            return self.compute_logits(hidden)
        return ops.linear(hidden, self.weight).float()

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N]`` target token ids, on the device (no host sync)."""
        tokens = self.logits(hidden).argmax(dim=-1)
        return tokens if self.vocab is None else self.vocab.index_select(0, tokens)

    @torch.no_grad()
    def _use_rows(self, target: nn.Module, vocab: torch.Tensor) -> None:
        """Gather the LM head's rows for ``vocab``, unless the target's ``compute_logits`` is
        not that LM head alone (then the whole vocabulary, with a warning)."""
        lm_head = _lm_head(target)
        if lm_head is None:
            logger.warning("EAGLE: the target has no ParallelLMHead to take draft vocabulary rows from: "
                           "drafting over the whole vocabulary")
            return
        # The embedding's lookup: this rank's rows for the ids in its range, summed over the
        # tensor-parallel ranks, so every rank holds all the rows and drafts without a gather.
        self.weight = VocabParallelEmbedding.forward(lm_head, vocab).contiguous()
        self.vocab = vocab
        if not self._matches_target(vocab):
            logger.warning("EAGLE: the target's compute_logits is not its LM head alone; the draft "
                           "vocabulary is not used (drafting over the whole vocabulary)")
            self.weight = self.vocab = None
            return
        logger.info("EAGLE: drafting over a draft vocabulary of %d of the target's %d ids", len(vocab), lm_head.vocab_size)

    def _matches_target(self, vocab: torch.Tensor) -> bool:
        """Whether the rows' logits are the target's ``compute_logits`` columns for ``vocab``,
        on a probe large enough that a soft cap or a scale would show, on every
        tensor-parallel rank (the probe is the same on each: ``compute_logits`` gathers)."""
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(2, self.weight.shape[1], generator=gen).to(self.weight)
        probe *= 100 / self.logits(probe).abs().max().clamp(min=1e-6)
        want = self.compute_logits(probe)[:, vocab]
        got = self.logits(probe)
        mismatch = not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        # Every rank decides alike: one drafting over the whole vocabulary gathers logits
        # from the others each pass.
        return all_reduce(torch.tensor([float(mismatch)], device=self.weight.device)).item() == 0


def _lm_head(target: nn.Module) -> ParallelLMHead | None:
    """The target's LM head (a vision-language model's is its language model's)."""
    for owner in (target, getattr(target, "language_model", None)):
        head = getattr(owner, "lm_head", None)
        if isinstance(head, ParallelLMHead):
            return head
    return None
