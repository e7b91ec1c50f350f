"""Offline fixtures for tests and demos: tiny tokenizers and tiny HF model directories."""

from pagelm.testing.tiny_models import (
    ARCHS,
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tokenizer,
    tiny_model_dir,
)

__all__ = ["ARCHS", "SPECIAL_TOKENS", "build_tiny_model", "build_tokenizer", "tiny_model_dir"]
