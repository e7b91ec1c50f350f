"""CUDA graphs of Medusa's drafting: one graph per captured batch size, each the heads' batched
pass and the argmax over their logits for ``size`` requests.

The heads keep no state and read nothing but each drafting request's last verified hidden
state, so a graph needs one input buffer; the gather of those rows from the step's hidden
states (one ``index_select`` into it) runs outside, before the replay::

    hidden [R, hidden]  <- index_select(step hidden, last verified rows)     (eager, one kernel)
    graph(size):  heads(hidden[:size], k) -> logits [size, k, vocab] -> drafts [size, k]

Every graph computes all ``k`` heads for every row; a request that wants fewer drafts has its
row cut on the host, exactly as the eager pass, which runs ``max(caps)`` heads, is (each head
is independent of the others). Rows past the real requests read whatever the buffer holds and
are never read back.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger("pagelm")


class MedusaDraftGraphs:
    """Medusa's drafting (``k`` of ``MedusaHeads``, argmax) for batches of up to ``max(sizes)`` requests."""

    def __init__(
        self, heads: nn.Module, compute_logits: Callable[[torch.Tensor], torch.Tensor], sizes: list[int],
        num_drafts: int, device: torch.device, dtype: torch.dtype,
    ) -> None:
        self.heads = heads
        self.compute_logits = compute_logits
        self.sizes = sorted(sizes)
        self.num_drafts = num_drafts
        r = self.sizes[-1]
        self.hidden = torch.zeros(r, heads.hidden_size, dtype=dtype, device=device)
        self.drafts = torch.zeros(r, num_drafts, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds ``num_reqs`` requests (None: run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def load(self, hidden_states: torch.Tensor, index: torch.Tensor) -> None:
        """Gather the drafting requests' rows ``index`` [n] of ``hidden_states`` into the input."""
        torch.index_select(hidden_states, 0, index, out=self.hidden[: len(index)])

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph for ``size`` (inputs loaded): the drafts ``[size, k]``."""
        self.graphs[size].replay()
        self.num_replays += 1
        return self.drafts[:size]

    def _step(self, size: int) -> torch.Tensor:
        """What a graph records."""
        states = self.heads(self.hidden[:size], self.num_drafts)
        self.drafts[:size].copy_(self.heads.logits(states, self.compute_logits).argmax(dim=-1))
        return self.drafts[:size]

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Capture every size into ``pool`` (the target's graphs' pool), largest first."""
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.hidden.device)  # this GPU's (see pagelm.worker.cuda_graphs)
        for size in reversed(self.sizes):
            self._step(size)  # warm-up outside the capture (autotuning, lazy allocations)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._step(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs of %d Medusa heads' drafting for batch sizes %s in %.1f s",
            self.num_drafts, self.sizes, time.perf_counter() - start,
        )
