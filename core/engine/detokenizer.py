"""Incremental detokenization and stop strings.

``tokenizers``' ``DecodeStream`` holds back bytes until they form whole UTF-8 characters, so a
character split over several byte-level BPE tokens appears exactly once, whole.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Prompt tokens replayed into the stream so the first output token decodes in context
# (e.g. a leading space in SentencePiece-style vocabularies).
_PRIME_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
        stop: list[str] | None = None, include_stop_str_in_output: bool = False,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"pagelm needs a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}")
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token in prompt_token_ids[-_PRIME_TOKENS:]:
            try:
                self._stream.step(backend, token)
            except Exception:  # a prompt id the tokenizer cannot decode: just don't prime
                self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.output_text = ""
        # Of the last update's tokens, how many were taken: fewer than given when a stop
        # string ends inside a run of several (accepted speculative drafts).
        self.num_tokens_used = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append the tokens' text; returns the stop string if one now appears (the text is
        then cut before it, or after it with ``include_stop_str_in_output``). Several tokens
        are checked one by one, so the stop string that plain decoding would have met first
        ends the text, and ``num_tokens_used`` says how many tokens that took."""
        self.num_tokens_used = len(new_token_ids)
        if not self.stop:
            for token in new_token_ids:
                self._append(token)
            return None
        for n, token in enumerate(new_token_ids, start=1):
            start = len(self.output_text)
            if not self._append(token):
                continue
            stop = self._find_stop(start)
            if stop is not None:
                self.num_tokens_used = n
                return stop
        return None

    def _append(self, token: int) -> bool:
        piece = self._stream.step(self._backend, token)
        if piece:
            self.output_text += piece
        return bool(piece)

    def _find_stop(self, start: int) -> str | None:
        """The first stop string in the text added since ``start`` (cutting the text)."""
        # Only the new text, plus enough of the old for a stop string spanning both.
        window_start = max(0, start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.output_text.find(s, window_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[: idx + len(s) if self.include_stop_str_in_output else idx]
        return s
