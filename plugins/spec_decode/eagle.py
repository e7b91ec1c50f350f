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
their positions is what it attends to once they draft again. Drafts are the head's argmax (a
one-hot proposal), which the rejection sampler verifies exactly, for greedy and sampled
requests alike.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagelm import hookimpl
from pagelm.attention import ForwardContext, attention_layers, forward_context
from pagelm.models.layers import VocabParallelEmbedding
from pagelm.models.loader import checkpoint_tensor, default_dtype, iterate_weights
from pagelm.models.pipeline import MissingLayer
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.spec_decode.drafting import DraftProposer, ProposalBatch

PAGELM_PLUGIN_API = "2.16"


class EagleProposer(DraftProposer):
    name = "eagle"
    uses_token_ids = False
    # Under pipeline parallelism the head lives on the last stage (the target's hidden states
    # and LM head are there) with a copy of the target's embedding (``load_eagle_head``).
    supports_pipeline_parallel = True

    def __init__(self, config, target: nn.Module, device, dtype) -> None:
        super().__init__(config, target, device, dtype)
        self.target = target
        self.head = load_eagle_head(
            Path(self.speculative.model).expanduser(), target, device, dtype, Path(config.model).expanduser()
        )

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
        return []

    @classmethod
    def num_lookahead_slots(cls, config) -> int:
        # Drafting writes the head's KV up to k - 1 positions past the verified ones.
        return config.speculative.num_speculative_tokens

    def attention_layers(self):
        return attention_layers(self.head)

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        device = batch.hidden_states.device
        drafts: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        last = torch.from_numpy(batch.last_token_index).to(device)
        input_ids = torch.roll(batch.input_ids, -1)  # position p reads token p+1
        input_ids[last] = torch.from_numpy(batch.next_token_ids).to(device)
        with forward_context(ForwardContext(attn_metadata=batch.build_attention_metadata(batch.common))):
            hidden = self.head(input_ids, batch.positions, batch.hidden_states)

        want = np.flatnonzero(batch.max_num_drafts > 0)
        if len(want) == 0:
            return drafts
        caps = batch.max_num_drafts[want]
        hidden = hidden[last[torch.from_numpy(want).to(device)]]
        tokens = self.target.compute_logits(hidden).argmax(dim=-1)
        out = torch.zeros((len(want), int(caps.max())), dtype=torch.long, device=device)
        out[:, 0] = tokens
        active = np.arange(len(want))  # indices into `want` still drafting
        for j in range(1, int(caps.max())):
            keep = np.flatnonzero(caps[active] > j)
            keep_t = torch.from_numpy(keep).to(device)
            active, hidden, tokens = active[keep], hidden[keep_t], tokens[keep_t]
            positions = batch.last_token_position[want[active]] + j
            metadata = batch.decode_attention_metadata(want[active], positions)
            with forward_context(ForwardContext(attn_metadata=metadata)):
                hidden = self.head(tokens, torch.from_numpy(positions).to(device), hidden)
            tokens = self.target.compute_logits(hidden).argmax(dim=-1)
            out[torch.from_numpy(active).to(device), j] = tokens
        for i, row, cap in zip(want.tolist(), out.tolist(), caps.tolist()):
            drafts[i] = row[:cap]
        return drafts


def load_eagle_head(
    path: Path, target: nn.Module, device: torch.device, dtype: torch.dtype, target_path: Path | None = None
) -> nn.Module:
    """Build the head ``Eagle<architecture>`` for ``path``'s config.json, load its weights and
    give it the target's embedding (unless it has its own). On a pipeline stage without
    the embedding (the last, where the head lives) it loads its own copy from the target's
    checkpoint at ``target_path``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)  # a head is one of pagelm's own architectures
    weights = dict(_iterate_weights(path))
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
    return head.eval()


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
