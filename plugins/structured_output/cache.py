"""The compiled-grammar cache: bounded by memory, least recently used evicted first. The
manager keeps one (``GrammarManager``), and so does the grammar process
(``grammar_process``), which compiles its own copies."""

from __future__ import annotations

from collections import OrderedDict

from pagelm.plugins.structured_output.grammar import CompiledGrammar

GrammarKey = tuple[str, str]  # (kind, canonical spec)


class GrammarCache:
    """Compiled grammars, least recently used first, holding at most ``max_bytes`` in total
    (a grammar larger than that on its own is not kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[GrammarKey, CompiledGrammar] = OrderedDict()

    def get(self, key: GrammarKey) -> CompiledGrammar | None:
        compiled = self._entries.get(key)
        if compiled is not None:
            self._entries.move_to_end(key)
        return compiled

    def put(self, key: GrammarKey, compiled: CompiledGrammar) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = compiled
        self.nbytes += compiled.memory_size_bytes
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.memory_size_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
