"""``pagelm generate MODEL --prompt ...``: offline generation from the command line."""

from __future__ import annotations

import argparse

from pagelm.plugins.engine_args import add_engine_args, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts", description=__doc__)
    p.add_argument("model", help="Hugging Face model directory")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    p.add_argument("--chat", action="store_true", help="treat each prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagelm import LLM, SamplingParams

    config = engine_kwargs(args)
    model = config.pop("model", None) or args.model
    llm = LLM(model, **config)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outs = llm.generate(args.prompt, params)
    for out in outs:
        print(f"--- {out.prompt!r}")
        print(out.outputs[0].text)
    return 0
