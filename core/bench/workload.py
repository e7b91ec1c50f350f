"""Synthetic, seeded workloads: the same prompts for every run and every target (server or
in-process), so figures compare like with like."""

from __future__ import annotations

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
