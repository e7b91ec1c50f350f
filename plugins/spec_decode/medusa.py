"""``medusa``: Medusa heads (Cai et al., 2024) draft ``k`` tokens at once from the target's last
hidden state. ``speculative_config={"method": "medusa", "num_speculative_tokens": k,
"model": "<heads dir>"}``; ``pagelm train-eagle --method medusa`` makes heads for any target.

Head ``i`` (1-based) reads the target's hidden state ``f`` at a request's last verified
position ``p*`` and predicts the token ``i`` places after the one the target has just
sampled there (``s``, position ``p* + 1``)::

    f_p* ─┬─ head 1: f + SiLU(W1 f + b1) ─ lm_head 1 ─► d1   (token p* + 2)
          ├─ head 2: f + SiLU(W2 f + b2) ─ lm_head 2 ─► d2   (token p* + 3)
          └─ ...                                       ─► dk
    next step verifies   | s d1 d2 .. dk |

Drafts are each head's argmax (top-1 chains, no tree): a one-hot proposal the rejection
sampler verifies exactly, for greedy and sampled requests alike. The heads keep no state
between steps and have no KV cache, so the engine may run steps ahead (async scheduling)
whenever adaptive drafting has every request backed off, as with n-gram. All drafting
requests go through the heads in one batched pass per step (a few matmuls over ``[n, k,
hidden]``); the ``[n, k]`` drafts stay on the device (``DeviceDrafts``) for the next
verification to take there. With CUDA graphs that pass
and the argmax replay as one graph per padded batch of up to ``MAX_DRAFT_GRAPH_BATCH``
drafting requests (``medusa_graphs``), unless ``PAGELM_MEDUSA_DRAFT_GRAPHS=0``; on the CPU,
with ``enforce_eager`` and for larger batches they run eagerly.

The heads directory follows Medusa-1's checkpoint layout, in safetensors: ``config.json``
with ``medusa_num_heads`` and ``medusa_num_layers``, and per head ``i`` residual blocks
``{i}.{j}.linear.weight`` / ``.bias`` (``j < medusa_num_layers``) and its own LM head
``{i}.{medusa_num_layers}.weight`` (a ``medusa_head.`` prefix is accepted). Heads saved without
their LM heads use the target's (``compute_logits``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagelm import hookimpl
from pagelm.models.pipeline import MissingLayer
from pagelm.plugins.spec_decode.drafting import DraftProposer, ProposalBatch
from pagelm.spec_decode import DeviceDrafts
from pagelm.plugins.spec_decode.medusa_graphs import MedusaDraftGraphs
from pagelm.spec_decode import DraftGraphSetup

PAGELM_PLUGIN_API = "2.25"

# Drafting is captured for up to this many drafting requests (EAGLE's limit, and the
# verification graphs').
MAX_DRAFT_GRAPH_BATCH = 32
# The heads' pass is captured in CUDA graphs unless ``PAGELM_MEDUSA_DRAFT_GRAPHS=0``.
DRAFT_GRAPHS_ENABLED = os.environ.get("PAGELM_MEDUSA_DRAFT_GRAPHS", "1").lower() in ("1", "true", "on", "yes")

_WEIGHT = re.compile(r"(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


class MedusaHeads(nn.Module):
    """``num_heads`` heads of ``num_layers`` residual blocks each, stacked so that all heads
    run as one batched matmul per block::

        x [n, heads, hidden]  <-  x + SiLU(x @ W[j]^T + b[j])     for each block j
        logits [n, heads, vocab] = x @ lm_head^T                 (own LM heads)
    """

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1, vocab_size: int | None = None) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.num_layers = hidden_size, num_heads, num_layers
        # [block, head, out, in]; zero: a head starts as the identity (Medusa's initialisation).
        self.weight = nn.Parameter(torch.zeros(num_layers, num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_layers, num_heads, hidden_size))
        # Each head's own LM head [head, vocab, hidden]; None: the target's is used.
        self.lm_head = None if vocab_size is None else nn.Parameter(torch.zeros(num_heads, vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """``hidden`` ``[..., hidden]`` -> the first ``num_heads`` heads' states ``[..., heads, hidden]``."""
        h = num_heads or self.num_heads
        x = hidden.to(self.weight.dtype).unsqueeze(-2).expand(*hidden.shape[:-1], h, self.hidden_size)
        for j in range(self.num_layers):
            x = x + F.silu(torch.einsum("...ki,koi->...ko", x, self.weight[j, :h]) + self.bias[j, :h])
        return x

    def logits(self, states: torch.Tensor, target_logits=None) -> torch.Tensor:
        """``states`` ``[..., heads, hidden]`` -> ``[..., heads, vocab]``, through each head's own LM
        head, or ``target_logits`` (the target's ``compute_logits``) when it has none."""
        if self.lm_head is None:
            return target_logits(states.flatten(0, -2)).view(*states.shape[:-1], -1)
        return torch.einsum("...ki,kvi->...kv", states, self.lm_head[: states.shape[-2]])

    # ---- checkpoint layout ---------------------------------------------------------------
    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """Weights under Medusa-1's names (what ``load_weights`` reads)."""
        out = {}
        for i in range(self.num_heads):
            for j in range(self.num_layers):
                out[f"{i}.{j}.linear.weight"] = self.weight[j, i].detach().contiguous()
                out[f"{i}.{j}.linear.bias"] = self.bias[j, i].detach().contiguous()
            if self.lm_head is not None:
                out[f"{i}.{self.num_layers}.weight"] = self.lm_head[i].detach().contiguous()
        return out

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        expected = set(self.checkpoint_weights())
        seen = set()
        for name, tensor in weights.items():
            m = _WEIGHT.fullmatch(name)
            if m is None:
                raise ValueError(f"unexpected weight {name!r}")
            i, j, kind = int(m.group(1)), int(m.group(2)), m.group(3)
            if i >= self.num_heads:
                continue  # more heads than configured: the extra ones are unused
            if kind == "weight" and j == self.num_layers and self.lm_head is not None:
                target = self.lm_head[i]
            elif kind == "linear.weight" and j < self.num_layers:
                target = self.weight[j, i]
            elif kind == "linear.bias" and j < self.num_layers:
                target = self.bias[j, i]
            else:
                raise ValueError(f"unexpected weight {name!r} for {self.num_layers} block(s) per head")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            seen.add(f"{i}.{j}.{kind}")
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(f"weights missing: {missing[:8]}")


class MedusaProposer(DraftProposer):
    name = "medusa"
    uses_token_ids = False
    needs_every_step = False  # no KV cache, no state: a step's hidden states are all it reads
    # Under pipeline parallelism the heads live on the last stage, beside the hidden states.
    supports_pipeline_parallel = True

    def __init__(self, config, target: nn.Module, device, dtype) -> None:
        super().__init__(config, target, device, dtype)
        self.target = target
        self.heads = load_medusa_heads(Path(self.speculative.model).expanduser(), target, device, dtype)
        self.graphs: MedusaDraftGraphs | None = None  # captured on CUDA (capture_cuda_graphs)

    @classmethod
    def validate(cls, config) -> list[str]:
        spec = config.speculative
        if not spec.model:
            return ["medusa needs 'model': the directory of Medusa heads (config.json and weights; "
                    "`pagelm train-eagle --method medusa --target MODEL --out DIR` makes one)"]
        path = Path(spec.model).expanduser()
        try:
            heads = int(json.loads((path / "config.json").read_text())["medusa_num_heads"])
        except (OSError, ValueError, KeyError, TypeError):
            return [f"model={spec.model!r} is not a Medusa heads directory (no config.json with medusa_num_heads)"]
        problems = []
        if not _weight_files(path):
            problems.append(f"model={spec.model!r} has no weights (*.safetensors or medusa_lm_head.pt)")
        if spec.num_speculative_tokens > heads:
            problems.append(f"num_speculative_tokens={spec.num_speculative_tokens} is more than the "
                            f"{heads} Medusa heads in {spec.model!r} (one draft per head)")
        return problems

    def capture_cuda_graphs(self, setup: DraftGraphSetup) -> None:
        """Graphs of the heads' pass (``MedusaDraftGraphs``) for up to ``MAX_DRAFT_GRAPH_BATCH``
        drafting requests; larger batches draft eagerly."""
        sizes = [s for s in setup.sizes if s <= MAX_DRAFT_GRAPH_BATCH]
        if not sizes or not DRAFT_GRAPHS_ENABLED:
            return
        self.graphs = MedusaDraftGraphs(
            self.heads, self.target.compute_logits, sizes, self.num_speculative_tokens, setup.device, self.dtype
        )
        self.graphs.capture(setup.pool)

    def release_cuda_graphs(self) -> None:
        self.graphs = None

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        want = np.flatnonzero(batch.max_num_drafts > 0)
        if len(want) == 0:
            return drafts
        caps = batch.max_num_drafts[want]
        hidden = batch.hidden_states
        # No stream sync: a blocking copy from pageable memory would drain the GPU first.
        index = torch.from_numpy(batch.last_token_index[want]).to(hidden.device, non_blocking=True)
        size = None if self.graphs is None else self.graphs.padded_size(len(want))
        if size is not None:
            self.graphs.load(hidden, index)
            tokens = self.graphs.replay(size)[: len(want)]
        else:
            states = self.heads(hidden[index], int(caps.max()))
            tokens = self.heads.logits(states, self.target.compute_logits).argmax(dim=-1)
        # Left on the device, one row per request of the batch (zeros where it drafts none).
        ids = tokens[: len(want), : int(caps.max())]
        if len(want) < batch.num_reqs:
            rows = torch.from_numpy(want).to(ids.device, non_blocking=True)
            ids = torch.zeros((batch.num_reqs, ids.shape[1]), dtype=ids.dtype, device=ids.device).index_copy_(0, rows, ids)
        return DeviceDrafts(ids, batch.max_num_drafts)


def load_medusa_heads(path: Path, target: nn.Module, device: torch.device, dtype: torch.dtype) -> MedusaHeads:
    """The heads in ``path`` (config.json + weights), checked against the target's hidden size."""
    config = json.loads((path / "config.json").read_text())
    weights = {name.removeprefix("medusa_head."): t for name, t in _iterate_weights(path)}
    num_heads = int(config["medusa_num_heads"])
    num_layers = int(config.get("medusa_num_layers", 1))
    if "0.0.linear.weight" not in weights:
        raise ValueError(f"Medusa heads {path}: no weight '0.0.linear.weight' (Medusa-1's layout)")
    hidden = int(weights["0.0.linear.weight"].shape[-1])
    embed = target.get_input_embeddings()
    # A pipeline stage without the embedding (the last) reads the width from the config.
    target_hidden = (
        target.config.get_text_config().hidden_size if isinstance(embed, MissingLayer) else embed.weight.shape[-1]
    )
    if hidden != target_hidden:
        raise ValueError(f"Medusa heads {path}: hidden size {hidden}, the target's is {target_hidden}")
    lm = weights.get(f"0.{num_layers}.weight")
    target_vocab = getattr(getattr(target, "config", None), "vocab_size", None)
    if lm is not None and target_vocab is not None and lm.shape[0] != target_vocab:
        raise ValueError(f"Medusa heads {path}: LM heads of {lm.shape[0]} tokens, the target's vocabulary has {target_vocab}")
    with torch.device(device):
        heads = MedusaHeads(hidden, num_heads, num_layers, None if lm is None else int(lm.shape[0]))
    try:
        heads.load_weights(weights)
    except ValueError as e:
        raise ValueError(f"Medusa heads {path}: {e}") from None
    return heads.to(dtype).eval()


def _weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) or [p for p in [path / "medusa_lm_head.pt"] if p.is_file()]


def _iterate_weights(path: Path):
    for file in _weight_files(path):
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            yield from load_file(str(file)).items()
        else:
            yield from torch.load(file, map_location="cpu", weights_only=True).items()


@hookimpl
def pagelm_register_proposers(registry) -> None:
    registry.add(MedusaProposer.name, MedusaProposer)
