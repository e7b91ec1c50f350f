"""``eagle``: an EAGLE head drafts ``k`` tokens from the target's hidden states (chain
drafting, greedy). ``speculative_config={"method": "eagle", "num_speculative_tokens": k,
"model": "<head dir>"}``; ``pagelm train-eagle`` makes a head for any target.

Every step, after verification (positions ``p`` of the step; ``p*`` = a request's last
verified position, ``s`` = the token the target just sampled after it)::

    pass 1   all of the step's positions p:  head(token p+1, target hidden f_p) -> g_p
             (writes the head's KV at the step's slots; at p*: token s)     g_p* -> d1
    pass j   drafting requests, one token:   head(d_{j-1}, g) at position p* + j - 1 -> d_j

Rejected positions are processed like any other in pass 1; the rows past ``p*`` are unused,
and the KV they leave is overwritten when those positions are computed again, exactly like
the target's. Pass 1 covers every request, also those that draft nothing this step
(``max_num_drafts`` 0: a prefill chunk, or backed off by adaptive drafting): the head's KV at
their positions is what it attends to once they draft again. The exception is a step in which
every request is backed off (pausing between probes, ``DraftBackoff.deep``): the head
skips it, so that a drafter that does not pay costs plain decoding between its probes, and
its KV at those positions stays stale (outputs are exact all the same; acceptance is what a
probe over stale KV may lose). With every draft rejected on the demo model (CPU, 256 tokens),
following every step ran at 0.55x of no speculation, skipping at 0.75x (batch 1) and 0.91x
(batch 32); the trained head's tokens per step did not move (1.80 either way). Drafts are the head's argmax (a
one-hot proposal), which the rejection sampler verifies exactly, for greedy and sampled
requests alike; over the head's draft vocabulary when its checkpoint has one (``draft_vocab``:
only those rows of the target's LM head are read).

With CUDA graphs, a proposal after a step of one token per request (decode) or ``1 + k``
(a verification graph step) replays one graph per padded batch (``eagle_graphs``): every
pass in one launch, or pass 1 alone when nobody drafts (the head's KV follows every step, so
a request backed off by adaptive drafting costs one small launch). After other steps pass 1
runs eagerly (its shape is the step's) and passes ``2..k`` replay a graph of the drafting
requests; on the CPU, with ``enforce_eager`` and for batches above ``MAX_DRAFT_GRAPH_BATCH``
they run eagerly, one pass at a time over the requests still drafting. Either way the
drafts stay on the device (``DeviceDrafts``): the engine copies them into the next
verification there, and the host reads them with that verification's tokens.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagelm import hookimpl
from pagelm.attention import ForwardContext, GraphSupport, attention_layers, forward_context
from pagelm.models.layers import VocabParallelEmbedding
from pagelm.models.loader import checkpoint_tensor, default_dtype, iterate_weights
from pagelm.models.pipeline import MissingLayer
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.spec_decode.draft_vocab import DRAFT_VOCAB_TENSOR, DraftLMHead, check_draft_vocab
from pagelm.plugins.spec_decode.drafting import DraftProposer, ProposalBatch
from pagelm.plugins.spec_decode.eagle_graphs import EagleDraftGraphs, replays_without_host_planning, uniform_query_len
from pagelm.spec_decode import DeviceDrafts, DraftGraphSetup

PAGELM_PLUGIN_API = "2.25"

logger = logging.getLogger("pagelm")

# Drafting passes are captured for up to this many drafting requests (the verification
# graphs' limit: past it a step verifies eagerly, and launch overhead matters much less).
MAX_DRAFT_GRAPH_BATCH = 32
# The drafting passes are captured in CUDA graphs unless ``PAGELM_EAGLE_DRAFT_GRAPHS=0``. On an
# H100 (the demo model, k=3) they took EAGLE from 0.38x to 1.44x of no speculation at batch 1
# and from 0.56x to 1.63x at batch 32 (docs/benchmarks.md).
DRAFT_GRAPHS_ENABLED = os.environ.get("PAGELM_EAGLE_DRAFT_GRAPHS", "1").lower() in ("1", "true", "on", "yes")


class EagleProposer(DraftProposer):
    name = "eagle"
    uses_token_ids = False
    # The head's KV must follow every step, also those the engine runs ahead (async
    # scheduling, where nobody may draft): those come with their target pass, and pass 1
    # runs over them with no drafts asked.
    needs_every_step = False
    needs_ahead_target = True
    # Except in steps where every request is backed off (between its probes): the
    # head then skips them, and its KV at their positions goes stale (``DraftProposer``).
    skips_deep_backoff = True
    # Under pipeline parallelism the head lives on the last stage (the target's hidden states
    # and LM head are there) with a copy of the target's embedding (``load_eagle_head``).
    supports_pipeline_parallel = True

    def __init__(self, config, target: nn.Module, device, dtype) -> None:
        super().__init__(config, target, device, dtype)
        self.target = target
        self.head, draft_vocab = load_eagle_head(
            Path(self.speculative.model).expanduser(), target, device, dtype, Path(config.model).expanduser()
        )
        # The argmax of each drafting pass: over the head's draft vocabulary when it has one.
        self.lm_head = DraftLMHead(target, draft_vocab, device)
        # Captured on CUDA (capture_cuda_graphs): passes 2..k; every pass after a step of
        # 1 + k tokens per request (a verification graph step) and after a decode step (one
        # token each); and pass 1 alone after either, for steps after which nobody drafts.
        self.graphs: EagleDraftGraphs | None = None
        self.step_graphs: EagleDraftGraphs | None = None
        self.decode_graphs: EagleDraftGraphs | None = None
        self.kv_graphs: dict[int, EagleDraftGraphs] = {}  # by query_len

    @classmethod
    def validate(cls, config) -> list[str]:
        model = config.speculative.model
        if not model:
            return ["eagle needs 'model': the directory of an EAGLE head (config.json and weights; "
                    "`pagelm train-eagle --target MODEL --out DIR` makes one)"]
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            return [f"model={model!r} is not an EAGLE head directory (no config.json)"]
        if not list(path.glob("*.safetensors")) and not (path / "pytorch_model.bin").is_file():
            return [f"model={model!r} has no weights (*.safetensors or pytorch_model.bin)"]
        if "draft_vocab_size" in config.speculative.options:
            return ["eagle: a draft vocabulary comes with the head (`pagelm train-eagle --draft-vocab-size N`, "
                    "or `pagelm bench latency --random-draft-head`), not with 'draft_vocab_size' in speculative_config"]
        return []

    @classmethod
    def num_lookahead_slots(cls, config) -> int:
        # Drafting writes the head's KV up to k - 1 positions past the verified ones.
        return config.speculative.num_speculative_tokens

    def attention_layers(self):
        return attention_layers(self.head)

    def capture_cuda_graphs(self, setup: DraftGraphSetup) -> None:
        """Graphs of the drafting (``EagleDraftGraphs``) for up to ``MAX_DRAFT_GRAPH_BATCH``
        requests: the whole proposal after a step of ``1 + k`` tokens per request (a
        verification graph step; with a backend that captures those), and passes 2..k after
        any other step. Larger batches, and backends that plan each replay on the host,
        draft eagerly."""
        sizes = [s for s in setup.sizes if s <= MAX_DRAFT_GRAPH_BATCH]
        if not sizes or not DRAFT_GRAPHS_ENABLED:
            return
        if not replays_without_host_planning(setup.builder):
            logger.info("EAGLE: the attention backend plans each graph replay on the host: drafting runs eagerly")
            return
        k = self.num_speculative_tokens
        args = (self.head, self.lm_head.argmax, setup, sizes, k, self.head.config.hidden_size, self.dtype)
        if k >= 2:
            self.graphs = EagleDraftGraphs(*args)
        self.decode_graphs = EagleDraftGraphs(*args, query_len=1)
        self.kv_graphs = {1: EagleDraftGraphs(*args, query_len=1, kv_only=True)}
        if setup.graph_support == GraphSupport.ALWAYS:  # graph metadata of 1 + k tokens per request
            # Pass 1 reads the verification graph's step where it is (plugin API 2.23).
            sources = setup.verify_buffers
            self.step_graphs = EagleDraftGraphs(*args, query_len=1 + k, sources=sources)
            self.kv_graphs[1 + k] = EagleDraftGraphs(*args, query_len=1 + k, kv_only=True, sources=sources)
        for graphs in (self.graphs, self.decode_graphs, self.step_graphs, *self.kv_graphs.values()):
            if graphs is not None:
                graphs.capture(setup.pool)

    def release_cuda_graphs(self) -> None:
        self.graphs = self.step_graphs = self.decode_graphs = None
        self.kv_graphs = {}

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        whole = self._whole_proposal_graphs(batch)
        if whole is not None:
            return self._replay_proposal(batch, *whole)
        drafts: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        device = batch.hidden_states.device
        n = batch.num_reqs
        want = np.flatnonzero(batch.max_num_drafts > 0)
        # One upload (no stream sync): each request's last verified index and the token after
        # it, then the drafting requests' last verified indices.
        index = _to_device(np.concatenate([batch.last_token_index, batch.next_token_ids, batch.last_token_index[want]]), device)
        input_ids = torch.roll(batch.input_ids, -1)  # position p reads token p+1
        input_ids[index[:n]] = index[n : 2 * n]
        with forward_context(ForwardContext(attn_metadata=batch.build_attention_metadata(batch.common))):
            hidden = self.head(input_ids, batch.positions, batch.hidden_states)
        if len(want) == 0:
            return drafts
        caps = batch.max_num_drafts[want]
        hidden = hidden[index[2 * n :]]
        tokens = self.lm_head.argmax(hidden)
        width = int(caps.max())
        size = None if self.graphs is None or width < 2 else self.graphs.padded_size(len(want))
        if size is not None:
            out = self._replay_passes(batch, want, caps, hidden, tokens, size)
        else:
            out = self._eager_passes(batch, want, caps, hidden, tokens)
        # Left on the device, one row per request of the batch (zeros where it drafts none).
        ids = out[: len(want), :width]
        if len(want) < n:
            ids = torch.zeros((n, width), dtype=out.dtype, device=device).index_copy_(0, _to_device(want, device), ids)
        return DeviceDrafts(ids, batch.max_num_drafts)

    def _whole_proposal_graphs(self, batch: ProposalBatch) -> tuple[EagleDraftGraphs, int] | None:
        """The graphs and captured size for the whole proposal, after a step of one or
        ``1 + k`` tokens per request: pass 1 alone when nobody drafts, else every pass.
        None: pass 1 runs eagerly."""
        q = uniform_query_len(batch)
        if q is None:
            return None
        if not batch.max_num_drafts.any():
            graphs = self.kv_graphs.get(q)
        else:
            graphs = self.decode_graphs if q == 1 else self.step_graphs
        if graphs is None or graphs.query_len != q:
            return None
        size = graphs.padded_size(batch.num_reqs)
        return None if size is None else (graphs, size)

    def _replay_proposal(self, batch: ProposalBatch, graphs: EagleDraftGraphs, size: int) -> list[list[int]]:
        """Every pass (or pass 1 alone) from the graph of ``size`` requests."""
        caps = batch.max_num_drafts
        # Python's max over short lists: a numpy or torch reduction costs more at these sizes.
        end = max(max(batch.common.seq_lens_cpu.tolist()), max(batch.last_token_position.tolist()) + self.num_speculative_tokens)
        table = batch.block_table_cpu
        block_rows = table[batch.rows, : min(-(-end // batch.block_size), table.shape[1])]
        graphs.load_step(batch, caps, block_rows, size)
        out = graphs.replay(size)
        width = max(caps.tolist())
        if width == 0:  # pass 1 only (the head's KV): nothing to wait for
            return [[] for _ in range(batch.num_reqs)]
        return DeviceDrafts(out[: batch.num_reqs, :width], caps)

    def _replay_passes(self, batch, want, caps, hidden, tokens, size: int) -> torch.Tensor:
        """Passes 2..k from the captured graph of ``size`` requests: the drafts ``[size, k]``."""
        last_positions = batch.last_token_position[want]
        cols = -(-(int(last_positions.max()) + int(caps.max())) // batch.block_size)
        block_rows = batch.block_table_cpu[batch.rows[want], : min(cols, batch.block_table_cpu.shape[1])]
        self.graphs.load(tokens, hidden, last_positions, caps, block_rows, size)
        return self.graphs.replay(size)

    def _eager_passes(self, batch, want, caps, hidden, tokens) -> torch.Tensor:
        """Passes 2..k run one by one over the requests still drafting: the drafts ``[m, max caps]``."""
        device = hidden.device
        out = torch.zeros((len(want), int(caps.max())), dtype=torch.long, device=device)
        out[:, 0] = tokens
        active = np.arange(len(want))  # indices into `want` still drafting
        for j in range(1, int(caps.max())):
            keep = np.flatnonzero(caps[active] > j)
            if len(keep) < len(active):
                keep_t = _to_device(keep, device)
                hidden, tokens = hidden[keep_t], tokens[keep_t]
            active = active[keep]
            positions = batch.last_token_position[want[active]] + j
            metadata = batch.decode_attention_metadata(want[active], positions)
            with forward_context(ForwardContext(attn_metadata=metadata)):
                hidden = self.head(tokens, _to_device(positions, device), hidden)
            tokens = self.lm_head.argmax(hidden)
            out[_to_device(active, device), j] = tokens
        return out


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on the device without waiting for the stream (a blocking copy
    from pageable memory would drain the GPU first)."""
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device, non_blocking=True)


def load_eagle_head(
    path: Path, target: nn.Module, device: torch.device, dtype: torch.dtype, target_path: Path | None = None
) -> tuple[nn.Module, torch.Tensor | None]:
    """Build the head ``Eagle<architecture>`` for ``path``'s config.json, load its weights and
    give it the target's embedding (unless it has its own). On a pipeline stage without
    the embedding (the last, where the head lives) it loads its own copy from the target's
    checkpoint at ``target_path``. Returns the head and its draft vocabulary (sorted target
    ids; None: it drafts over the whole vocabulary; ``draft_vocab``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)  # a head is one of pagelm's own architectures
    weights = dict(_iterate_weights(path))
    draft_vocab = weights.pop(DRAFT_VOCAB_TENSOR, None)
    if draft_vocab is not None:
        draft_vocab = check_draft_vocab(draft_vocab, config.vocab_size, getattr(config, "draft_vocab_size", None))
    elif getattr(config, "draft_vocab_size", None) is not None:
        raise ValueError(f"EAGLE head {path}: config.json has draft_vocab_size but the weights have no "
                         f"{DRAFT_VOCAB_TENSOR!r} tensor")
    names = {name.removeprefix("model.") for name in weights}
    config.eagle_fc_bias = "fc.bias" in names
    config.eagle_input_layernorm = "layers.0.input_layernorm.weight" in names
    config.eagle_own_embedding = "embed_tokens.weight" in names
    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    head_cls = get_plugin_manager().collect("model architecture").get(arch if arch.startswith("Eagle") else f"Eagle{arch}")
    with torch.device(device), default_dtype(dtype):
        head = head_cls(config)
    loaded = head.load_weights(weights.items())
    if not config.eagle_own_embedding:
        embed = getattr(target, "get_input_embeddings", None)
        embed = embed() if embed is not None else target.model.embed_tokens
        if isinstance(embed, MissingLayer):
            embed = _embedding_copy(target_path, config, device, dtype)
        head.share_embedding(embed)
    missing = sorted(
        n for n, _ in head.named_parameters() if n not in loaded and (config.eagle_own_embedding or not n.startswith("embed_tokens."))
    )
    if missing:
        raise ValueError(f"EAGLE head {path}: weights missing: {missing[:8]}")
    return head.eval(), draft_vocab


def _embedding_copy(target_path: Path | None, config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The target's embedding, split over this stage's tensor-parallel ranks as the first
    stage's is, read from its checkpoint (the one tensor only)."""
    weight = None if target_path is None else checkpoint_tensor(target_path, "model.embed_tokens.weight")
    if weight is None:
        raise ValueError(
            f"the EAGLE head needs the target's embedding on the last pipeline stage, and the checkpoint "
            f"{target_path} has no 'model.embed_tokens.weight' (load_format='dummy' has no checkpoint)"
        )
    with torch.device(device), default_dtype(dtype):
        embed = VocabParallelEmbedding(weight.shape[0], weight.shape[1])
    embed.weight.weight_loader(embed.weight, weight.to(device, dtype))
    return embed


def _iterate_weights(path: Path):
    if list(path.glob("*.safetensors")):
        yield from iterate_weights(path)
        return
    yield from torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True).items()


@hookimpl
def pagelm_register_proposers(registry) -> None:
    registry.add(EagleProposer.name, EagleProposer)


@hookimpl
def pagelm_register_cli_commands(registry) -> None:
    """``pagelm train-eagle``: a head for any target (``eagle_train``)."""
    from pagelm.plugins.spec_decode.train_eagle_cli import add_parser

    registry.add("train-eagle", add_parser)
