"""Guided decoding (structured output): the backend ABCs plugins implement, the engine core's
manager (asynchronous compile, bounded cache, batch bitmask), and the check requests go
through before they are queued."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagelm.structured_output.backend import (
    CompiledGrammar,
    GrammarOffload,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from pagelm.structured_output.cache import GrammarCache
from pagelm.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.sampling_params import GuidedDecodingParams

__all__ = [
    "CompiledGrammar",
    "GrammarCache",
    "GrammarOffload",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StructuredOutputManager",
    "validate_guided_decoding",
]


def validate_guided_decoding(config: "EngineConfig", params: "GuidedDecodingParams") -> None:
    """Raise ``ValueError`` if this engine cannot serve ``params``: no tokenizer, the backend
    unusable here (e.g. its library is missing), or a constraint it rejects. Cheap: it runs
    when a request arrives, before anything is queued."""
    from pagelm.plugin_manager import get_plugin_manager

    if config.skip_tokenizer_init:
        raise ValueError("guided_decoding needs the tokenizer; the engine has skip_tokenizer_init=True")
    backend_cls = get_plugin_manager().structured_output_backends().get(config.structured_output_backend)
    problems = backend_cls.validate(config)
    if problems:
        raise ValueError(f"guided_decoding: structured_output_backend={backend_cls.name!r}: " + "; ".join(problems))
    backend_cls.validate_request(params)
