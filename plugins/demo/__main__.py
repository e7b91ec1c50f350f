"""``python -m pagelm.plugins.demo``: make sure the built-in demo model exists, then complete a few
Python prompts and answer one chat message with it through the offline ``LLM`` API."""

from __future__ import annotations

import argparse
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):",
    "import ",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
]
CHAT = [{"role": "user", "content": "Write a Python function is_prime(n): Return True if n is a prime number."}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagelm.plugins.demo", description=__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $PAGELM_CACHE_DIR or ~/.cache/pagelm")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from pagelm import LLM, SamplingParams
    from pagelm.plugins.demo.model import ensure_demo_model

    model_dir = ensure_demo_model(args.cache_dir)
    print(f"demo model: {model_dir}")
    llm = LLM(str(model_dir))
    # Greedy decoding; a tiny model loops without a mild repetition penalty.
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, repetition_penalty=1.2)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        print(f"\n--- {out.prompt!r}\n{out.prompt}{out.outputs[0].text}")
    reply = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
    print(f"\n--- chat: {CHAT[0]['content']!r}\n{reply}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
