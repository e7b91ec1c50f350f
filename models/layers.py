"""Building blocks shared by the decoder-only models: norms, activations, rotary embedding and
linear layers whose fused parameters load from Hugging Face's separate projections."""

from __future__ import annotations

import torch
from torch import nn

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


# ---------------------------------------------------------------------------------------------
# linear layers
# ---------------------------------------------------------------------------------------------


class Linear(nn.Module):
    """``y = x W^T + b`` with parameters left uninitialised (the loader fills every one, so
    a random init would only cost time on big models)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)

    def forward_normed(
        self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(norm(x, residual)[0])`` and the next residual: the decoder norm that feeds
        this projection runs inside it (one kernel at batch 1) when it is an ``RMSNorm``."""
        if isinstance(norm, RMSNorm):
            return ops.rms_norm_linear(x, norm.weight, norm.eps, residual, self.weight, self.bias)
        normed, residual = norm(x, residual)
        return self(normed), residual


class FusedColumnLinear(Linear):
    """Several projections of the same input stacked along the output dim, one matmul.

    ``shard_sizes`` names each slice in order; ``weight_loader(param, tensor, shard_id)``
    copies a checkpoint's separate projection into its slice.
    """

    def __init__(self, input_size: int, shard_sizes: dict[str | int, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            return default_weight_loader(param, loaded)
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class QKVLinear(FusedColumnLinear):
    """q, k and v projections in one weight: ``[q (heads*d) | k (kv_heads*d) | v (kv_heads*d)]``."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias)
        self.q_size, self.kv_size = q_size, kv_size

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
