"""``GrammarBackend``: a grammar library as a structured-output plugin. It implements the
grammar-level ABCs (``grammar.py``) and gets the core's ``StructuredOutputBackend`` contract
for free: ``make_manager`` builds the built-in ``GrammarManager`` around it."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pagelm.plugins.structured_output.grammar import CompiledGrammar, GrammarOffload, StructuredOutputGrammar
from pagelm.plugins.structured_output.manager import GrammarManager
from pagelm.registry import raise_problems
from pagelm.structured_output import StructuredOutputBackend

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.sampling_params import GuidedDecodingParams


class GrammarBackend(StructuredOutputBackend):
    """A grammar library (registered with ``pagelm_register_structured_output_backends``,
    chosen with ``structured_output_backend=<name>``) run by the built-in ``GrammarManager``.

    The class side runs wherever requests arrive (the API process): ``validate`` and
    ``validate_request`` must be cheap and need no tokenizer. An instance is built once per
    engine, in a compile worker thread, when the first guided request arrives.
    """

    def __init__(self, config: "EngineConfig", tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """``tokenizer``: the model's Hugging Face tokenizer; ``vocab_size``: the model's
        (logits width, possibly larger than the tokenizer's); ``eos_token_ids``: the tokens
        that end a sequence, allowed only where the grammar is complete."""
        self.config = config
        self.vocab_size = vocab_size

    @classmethod
    def make_manager(
        cls, config: "EngineConfig", vocab_size: int, eos_token_ids: frozenset[int], *,
        device: torch.device, async_scheduling: bool,
    ) -> GrammarManager:
        """A ``GrammarManager`` around this backend. ``structured_output_process`` unset: the
        backend's offload (``offload``) where it pays, on CUDA with async scheduling, where the
        GIL the grammar work needs would otherwise slow the step loop beside it."""
        grammar_process = config.structured_output_process
        if grammar_process is None:
            grammar_process = device.type == "cuda" and async_scheduling
        return GrammarManager(
            config, cls, vocab_size, eos_token_ids, pin_memory=device.type == "cuda", grammar_process=grammar_process
        )

    @abstractmethod
    def compile(self, params: "GuidedDecodingParams") -> CompiledGrammar:
        """Compile a constraint (runs in a worker thread). Raise ``ValueError`` with a clear
        message when it cannot be compiled."""

    def batch_accept_tokens(
        self, grammars: Sequence[StructuredOutputGrammar], token_ids: Sequence[Sequence[int]]
    ) -> list[bool]:
        """``grammars[i].accept_tokens(token_ids[i])`` for each ``i``; override with one call
        that releases the GIL."""
        return [grammar.accept_tokens(tokens) for grammar, tokens in zip(grammars, token_ids)]

    def fill_bitmasks(
        self, grammars: Sequence[StructuredOutputGrammar], bitmask: torch.Tensor, rows: Sequence[int] | None = None
    ) -> None:
        """Fill row ``rows[i]`` (default ``i``) of ``bitmask`` from ``grammars[i]``; override
        to batch (threads, the GIL released)."""
        for grammar, row in zip(grammars, range(len(grammars)) if rows is None else rows):
            grammar.fill_bitmask(bitmask, row)

    def shutdown(self) -> None:
        """Release threads or other resources."""

    @classmethod
    def offload(
        cls, config: "EngineConfig", vocab_size: int, eos_token_ids: frozenset[int], rows: int, *, pin_memory: bool
    ) -> GrammarOffload | None:
        """A ``GrammarOffload`` for ``structured_output_process``, with a ``rows``-row bitmask
        (pinned for CUDA uploads with ``pin_memory``); None (the default): this backend has
        none, the manager's worker thread does the work. Called by the manager when its
        first guided request arrives."""
        return None

    @classmethod
    def build(cls, config: "EngineConfig", vocab_size: int, eos_token_ids: frozenset[int]) -> "GrammarBackend":
        """An instance with the model's tokenizer (the manager and the grammar process each
        build one, on first use)."""
        raise_problems(f"structured_output_backend={cls.name!r}", cls.validate(config))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model, trust_remote_code=config.trust_remote_code)
        return cls(config, tokenizer, vocab_size, eos_token_ids)
