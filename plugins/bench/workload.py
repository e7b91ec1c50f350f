"""Synthetic, seeded workloads: the same prompts for every run and every target (server or
in-process, pagelm or Hugging Face), so figures compare like with like. ``Workload`` is text for
the server benchmark; ``TokenWorkload`` is token ids for the latency and throughput ones."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

_WORDS = (
    "the model reads a prompt and writes tokens one at a time while the scheduler batches "
    "requests from many clients into one step over a paged cache of keys and values that "
    "grows by blocks and is shared between prompts with a common prefix"
).split()


@dataclass
class Workload:
    prompts: list[str]
    output_len: int

    @classmethod
    def synthetic(cls, num_prompts: int, input_words: int, output_len: int, seed: int = 0) -> "Workload":
        rng = random.Random(seed)
        prompts = [
            f"{i}: " + " ".join(rng.choice(_WORDS) for _ in range(input_words)) for i in range(num_prompts)
        ]
        return cls(prompts, output_len)


@dataclass
class TokenWorkload:
    """Prompts as random token ids, each with its own output length (generated with EOS
    ignored, so every request produces exactly that many tokens)."""

    prompt_token_ids: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int) -> "TokenWorkload":
        return TokenWorkload(self.prompt_token_ids[:n], self.output_lens[:n])

    @classmethod
    def nano_vllm(
        cls, num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024, seed: int = 0
    ) -> "TokenWorkload":
        """nano-vllm's ``bench.py``, draw for draw: ``random.seed(0)``, every prompt first
        (length uniform in [100, max_input_len], ids uniform in [0, 10000]), then every output
        length (uniform in [100, max_output_len]). The defaults give 142,827 prompt and 133,966
        output tokens."""
        rng = random.Random(seed)
        prompts = [
            [rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))] for _ in range(num_seqs)
        ]
        return cls(prompts, [rng.randint(100, max_output_len) for _ in range(num_seqs)])

    @classmethod
    def fixed(
        cls, num_seqs: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0
    ) -> "TokenWorkload":
        """``num_seqs`` prompts of exactly ``input_len`` ids below ``min(vocab_size, 10000)``."""
        rng = random.Random(seed)
        high = min(vocab_size, 10000) - 1
        prompts = [[rng.randint(0, high) for _ in range(input_len)] for _ in range(num_seqs)]
        return cls(prompts, [output_len] * num_seqs)

    @classmethod
    def shared_prefix(
        cls, num_seqs: int, prefix_len: int, suffix_len: int, output_len: int, vocab_size: int, seed: int = 0
    ) -> "TokenWorkload":
        """Many requests over one system prompt: every prompt is the same ``prefix_len`` ids
        followed by ``suffix_len`` ids of its own (ids below ``min(vocab_size, 10000)``)."""
        rng = random.Random(seed)
        high = min(vocab_size, 10000) - 1
        prefix = [rng.randint(0, high) for _ in range(prefix_len)]
        prompts = [prefix + [rng.randint(0, high) for _ in range(suffix_len)] for _ in range(num_seqs)]
        return cls(prompts, [output_len] * num_seqs)

    @classmethod
    def repeated(
        cls, num_seqs: int, block_len: int, repeats: int, output_len: int, vocab_size: int, seed: int | str = 0
    ) -> "TokenWorkload":
        """Prompts that repeat themselves: a block of ``block_len`` random ids (below
        ``min(vocab_size, 10000)``), its own for every prompt, ``repeats`` times over. Prompt
        lookup (n-gram drafting) finds every continuation of a model that keeps copying it::

            | b0 b1 ... b255 | b0 b1 ... b255 | b0 b1 ... b255 | b0 b1 ... b255 |
        """
        rng = random.Random(seed)
        high = min(vocab_size, 10000) - 1
        prompts = [[rng.randint(0, high) for _ in range(block_len)] * repeats for _ in range(num_seqs)]
        return cls(prompts, [output_len] * num_seqs)

    @classmethod
    def code(cls, tokenizer, num_seqs: int, input_len: int, output_len: int, seed: int | str = 0) -> "TokenWorkload":
        """Python source from the standard library: ``input_len`` tokens from a random place
        of a random file (the text the demo model, and EAGLE heads ``pagelm train-eagle``
        trains for it, know)."""
        rng = random.Random(seed)
        window = 8 * input_len  # characters: comfortably more than input_len tokens of code
        sources = [text for text in _stdlib_texts() if len(text) > 2 * window]
        if not sources:
            raise ValueError(f"no standard library file is long enough for {input_len}-token prompts")
        prompts: list[list[int]] = []
        while len(prompts) < num_seqs:
            text = rng.choice(sources)
            offset = rng.randrange(len(text) - window)
            ids = tokenizer.encode(text[offset : offset + window], add_special_tokens=False)
            if len(ids) >= input_len:
                prompts.append(ids[:input_len])
        return cls(prompts, [output_len] * num_seqs)


@functools.cache
def _stdlib_texts() -> tuple[str, ...]:
    from pagelm.plugins.demo.model import stdlib_sources

    return tuple(text for _, text in stdlib_sources(4_000_000))
