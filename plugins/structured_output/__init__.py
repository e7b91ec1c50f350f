"""Guided decoding's machinery, outside the core: the grammar-level contract a grammar
library implements (``GrammarBackend``, ``CompiledGrammar``, ``StructuredOutputGrammar``,
optionally ``GrammarOffload``), the manager that runs one for the engine core
(``GrammarManager``: asynchronous compiles, a bounded cache, bitmask rows prepared a step
ahead), and the built-in xgrammar backend with its grammar process."""

from pagelm.plugins.structured_output.backend import GrammarBackend
from pagelm.plugins.structured_output.cache import GrammarCache
from pagelm.plugins.structured_output.grammar import CompiledGrammar, GrammarOffload, StructuredOutputGrammar
from pagelm.plugins.structured_output.manager import GrammarManager

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarCache", "GrammarManager", "GrammarOffload", "StructuredOutputGrammar"]
