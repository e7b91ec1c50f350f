"""Attention: the backend contract, the forward context and the layer models call."""

from pagelm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    GraphSupport,
    QKRotary,
)
from pagelm.attention.forward_context import ForwardContext, forward_context, get_forward_context
from pagelm.attention.layer import Attention, attention_layers

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "CommonAttentionMetadata",
    "GraphSupport",
    "QKRotary",
    "ForwardContext",
    "attention_layers",
    "forward_context",
    "get_forward_context",
]
