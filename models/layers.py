"""Building blocks shared by the decoder-only models: norms, activations, rotary embedding and
linear layers whose fused parameters load from Hugging Face's separate projections."""

from __future__ import annotations

import torch
from torch import nn

from pagelm.distributed import all_gather, all_reduce, fused_all_reduce_buffers, parallel_state
from pagelm.models import ops
from pagelm.models.weights import default_weight_loader


class RMSNorm(nn.Module):
    """RMSNorm that can fuse the residual add that precedes it in every decoder layer.

    ``forward(x, residual)`` computes ``h = x + residual`` and returns ``(norm(h), h)``: the
    caller carries ``h`` on as the next residual. With ``residual=None`` the input itself is
    the next residual, so the first layer needs no special case.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Normalised in float32 and scaled in the model dtype, as Hugging Face does, so bf16
        # outputs round the same way (the fused kernel rounds identically).
        return ops.rms_norm(x, self.weight, self.eps, residual)


# ---------------------------------------------------------------------------------------------
# rotary embedding
# ---------------------------------------------------------------------------------------------


def rope_parameters(config) -> dict:
    """The config's RoPE settings as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; older configs split them between
    ``config.rope_scaling`` (``type`` or ``rope_type``) and ``config.rope_theta``.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` for the config's RoPE type; scaled types (llama3,
    linear, yarn, ...) use transformers' own init functions so the numbers match exactly."""
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    # Imported here: transformers' rope utilities are only needed for scaled RoPE.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE on flattened ``[num_tokens, heads * head_dim]`` q/k.

    cos/sin are precomputed for every position up to ``max_position`` and kept in float32:
    the rotation is done in float32 and only the result is cast back to the model dtype.
    When ``inv_freq`` covers fewer than ``head_dim`` dims (partial rotary), the rest pass
    through unrotated.
    """

    def __init__(
        self, head_dim: int, max_position: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.numel()
        assert self.rotary_dim <= head_dim
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(positions.device, torch.float32))
        # [max_position, rotary_dim]: cos of each frequency, then sin.
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    @classmethod
    def from_config(cls, config, head_dim: int) -> RotaryEmbedding:
        inv_freq, attention_scaling = rope_inv_freq(config, head_dim)
        return cls(head_dim, config.max_position_embeddings, inv_freq, attention_scaling)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the rotated ``(q, k)``; on CUDA they are ``q`` and ``k`` rotated in place."""
        return ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim, self.rotary_dim)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL): the rotary frequencies split into sections (``mrope_section``,
    summing to ``rotary_dim / 2``), section ``i`` turned by row ``i % 3`` of the positions
    (temporal, height, width)::

        positions [3, num_tokens]   frequency f in section i  ->  angle positions[i % 3, t] * f

    ``[num_tokens]`` positions mean every row equal, which is plain RoPE: text, and decode.
    """

    def __init__(
        self, head_dim: int, max_position: int, inv_freq: torch.Tensor, mrope_section: list[int],
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__(head_dim, max_position, inv_freq, attention_scaling)
        if sum(mrope_section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to rotary_dim / 2 = {self.rotary_dim // 2}")
        row = torch.repeat_interleave(torch.arange(len(mrope_section)) % 3, torch.tensor(mrope_section))
        # [rotary_dim]: the position row each cos/sin column of the cache reads.
        self.register_buffer("row_of_column", torch.cat([row, row]), persistent=False)

    @classmethod
    def from_config(cls, config, head_dim: int) -> MRotaryEmbedding:
        inv_freq, attention_scaling = rope_inv_freq(config, head_dim)
        section = rope_parameters(config).get("mrope_section")
        if section is None:
            raise ValueError("M-RoPE needs rope_parameters['mrope_section'] in the config")
        return cls(head_dim, config.max_position_embeddings, inv_freq, list(section), attention_scaling)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.ndim == 1:
            return super().forward(positions, q, k)
        num_tokens = positions.shape[-1]
        rows = self.cos_sin_cache[positions]  # [3, num_tokens, rotary_dim]
        cos_sin = rows.gather(0, self.row_of_column.expand(1, num_tokens, -1)).squeeze(0)
        # Each token reads its own row of this per-step table: the same rotary op as RoPE's.
        index = torch.arange(num_tokens, device=positions.device)
        return ops.rotary_embedding(index, q, k, cos_sin, self.head_dim, self.rotary_dim)


# ---------------------------------------------------------------------------------------------
# linear layers
# ---------------------------------------------------------------------------------------------


class Linear(nn.Module):
    """``y = x W^T + b`` with parameters left uninitialised (the loader fills every one, so
    a random init would only cost time on big models)."""

    # The weight of the projection that runs next (``link_weight_prefetch``), which a batch-1
    # GEMV may pull into L2 while it reads its own.
    prefetch_next: torch.Tensor | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, prefetch=self.prefetch_next)

    def forward_normed(
        self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(norm(x, residual)[0])`` and the next residual: the decoder norm that feeds
        this projection runs inside it (one kernel at batch 1) when it is an ``RMSNorm``."""
        if isinstance(norm, RMSNorm):
            return ops.rms_norm_linear(
                x, norm.weight, norm.eps, residual, self.weight, self.bias, prefetch=self.prefetch_next
            )
        normed, residual = norm(x, residual)
        return self(normed), residual


def link_weight_prefetch(model: nn.Module) -> None:
    """Point every projection at the weight of the projection registered after it (the LM
    head after the last layer's down projection): in the decoder models registration order is
    the order a decode step runs them, so a batch-1 GEMV can pull the next weight into L2
    while it reads its own. A wrong link would only prefetch bytes nobody reads next. The
    parameter is held as a plain attribute (not registered twice), so a weight replaced in
    place (``param.data = ...``) is followed."""
    projections = [m for m in model.modules() if isinstance(m, (Linear, ParallelLMHead))]
    for current, following in zip(projections, projections[1:]):
        if isinstance(current, Linear):
            object.__setattr__(current, "prefetch_next", following.weight)


class FusedColumnLinear(Linear):
    """Several projections of the same input stacked along the output dim, one matmul;
    column-parallel under tensor parallelism (each rank holds its slice of every projection).

    ``shard_sizes`` names each projection with its full (all-ranks) size, in order;
    ``weight_loader(param, tensor, shard_id)`` copies this rank's rows of a checkpoint's
    separate projection into its slice. ``_source_rows`` says which rows those are (QKV
    overrides it for key/value heads shared by several ranks).
    """

    def __init__(self, input_size: int, shard_sizes: dict[str | int, int], bias: bool = False) -> None:
        tp = parallel_state().tp_size
        for shard_id, size in shard_sizes.items():
            if size % tp:
                raise ValueError(f"projection {shard_id!r} of size {size} does not split over tensor_parallel_size={tp}")
        local = {shard_id: self._local_size(shard_id, size) for shard_id, size in shard_sizes.items()}
        super().__init__(input_size, sum(local.values()), bias)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in local.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def _local_size(self, shard_id: str | int, size: int) -> int:
        return size // parallel_state().tp_size

    def _source_rows(self, shard_id: str | int, size: int) -> int:
        """The first row of this rank's slice in the checkpoint's projection ``shard_id``."""
        return parallel_state().tp_rank * size

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            if parallel_state().tp_size > 1:
                raise ValueError("a fused projection checkpoint cannot be split for tensor parallelism")
            return default_weight_loader(param, loaded)
        offset, size = self.shard_offsets[shard_id]
        rows = loaded.narrow(0, self._source_rows(shard_id, size), size)
        default_weight_loader(param.data.narrow(0, offset, size), rows)


class QKVLinear(FusedColumnLinear):
    """q, k and v projections in one weight: ``[q (heads*d) | k (kv_heads*d) | v (kv_heads*d)]``,
    this rank's heads of each. With more ranks than key/value heads, each kv head is held by
    ``tp / kv_heads`` ranks: the ones whose query heads use it."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = parallel_state().tp_size
        if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
            raise ValueError(
                f"tensor_parallel_size={tp} must divide num_attention_heads={num_heads}, and divide or be "
                f"a multiple of num_key_value_heads={num_kv_heads}"
            )
        self.head_dim, self.num_kv_heads = head_dim, num_kv_heads
        q_size, kv_size = num_heads * head_dim, max(num_kv_heads, tp) * head_dim
        super().__init__(hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias)
        self.q_size, self.kv_size = self.shard_offsets["q"][1], self.shard_offsets["k"][1]

    def _source_rows(self, shard_id: str | int, size: int) -> int:
        state = parallel_state()
        if shard_id == "q" or self.num_kv_heads >= state.tp_size:
            return state.tp_rank * size
        return state.tp_rank // (state.tp_size // self.num_kv_heads) * self.head_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.split_qkv(super().forward(x))

    def forward_normed(self, norm, x, residual):
        qkv, residual = super().forward_normed(norm, x, residual)
        return self.split_qkv(qkv), residual

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class MergedColumnLinear(FusedColumnLinear):
    """Projections addressed by position (``gate_up_proj``: shard 0 is gate, 1 is up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, dict(enumerate(output_sizes)), bias)


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks (``o_proj``, ``down_proj``,
    after a column-parallel one): each rank multiplies its slice, the partial sums are
    all-reduced, and the bias is added once, after the sum.

    At batch 1 over two ranks the GEMV does the all-reduce itself (each of its programs trades
    its tile with the other rank's: no all-reduce kernel, no barrier between kernels).
    ``reduce_site`` (0 or 1) picks that exchange's buffers; consecutive row-parallel
    projections must alternate (a decoder layer's o_proj 0, its down_proj 1)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_site: int = 0) -> None:
        tp = parallel_state().tp_size
        if input_size % tp:
            raise ValueError(f"input size {input_size} does not split over tensor_parallel_size={tp}")
        super().__init__(input_size // tp, output_size, bias)
        self.weight.weight_loader = self.weight_loader
        self.reduce_site = reduce_site

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, parallel_state().tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if parallel_state().tp_size == 1:
            return ops.linear(x, self.weight, self.bias, prefetch=self.prefetch_next)
        return self.project_and_reduce(x)

    def project_and_reduce(self, x: torch.Tensor, silu_input: bool = False) -> torch.Tensor:
        """The layer's output over every rank from this rank's input slice (with
        ``silu_input``, ``x`` is the ``[gate | up]`` activation and ``silu(gate) * up`` the
        operand): the all-reduce inside the GEMV where it can be, else after it."""
        project = ops.silu_and_mul_linear if silu_input else ops.linear
        if self.bias is None and ops.fuses_all_reduce(x, self.weight):
            buffers = fused_all_reduce_buffers(self.reduce_site, self.weight.shape[0], x.dtype)
            if buffers is not None:
                return project(x, self.weight, None, prefetch=self.prefetch_next, all_reduce=buffers)
        return self.reduce(project(x, self.weight, None, prefetch=self.prefetch_next))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's partial product (computed without the bias)."""
        out = all_reduce(partial)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """The token embedding with the vocabulary split over the ranks (``ceil(vocab / tp)`` rows
    each, the last padded): a rank embeds the ids in its range, zeros elsewhere, and the sum
    over ranks is every token's embedding. ``ParallelLMHead`` splits the same way, so a tied
    LM head shares this weight."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        state = parallel_state()
        self.num_local = -(-vocab_size // state.tp_size)
        self.start = state.tp_rank * self.num_local
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start : self.start + self.num_local]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if parallel_state().tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head, split over the vocabulary as the embedding is: each rank's logits for its
    rows, gathered (and the padding cut) into the full vocabulary on every rank."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden_states, self.weight, None)
        if parallel_state().tp_size == 1:
            return logits
        return all_gather(logits, dim=-1)[..., : self.vocab_size]
