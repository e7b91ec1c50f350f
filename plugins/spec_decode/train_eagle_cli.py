"""``pagelm train-eagle [--method eagle|medusa] [--target DIR] --out DIR``: train an EAGLE draft
head (default) or Medusa heads for a target by self-distillation (the target writes its own
training text; no dataset, no hub), then serve with ``--speculative-config '{"method":
"eagle", "num_speculative_tokens": 3, "model": "DIR"}'`` (``"medusa"`` likewise, ``k`` up to
the number of heads). Without ``--target``, the built-in demo model."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("train-eagle", help="train an EAGLE head or Medusa heads for speculative decoding", description=__doc__)
    p.add_argument("--method", choices=["eagle", "medusa"], default="eagle", help="what to train (default: %(default)s)")
    p.add_argument("--target", help="target model directory (default: the built-in demo model)")
    p.add_argument("--out", required=True, type=Path, help="directory to write the head to")
    p.add_argument("--num-prompts", type=int, default=128, help="prompts the target continues")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    p.add_argument("--gen-len", type=int, default=64, help="tokens the target writes per prompt")
    p.add_argument("--prompts-file", type=Path, help="text prompts, one per line (default: stdlib snippets)")
    p.add_argument("--temperature", type=float, default=0.0, help="the target's sampling temperature")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--max-seconds", type=float, default=None, help="stop training after this long")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                   help="eagle: draft over the N tokens most frequent in the training text only (EAGLE-3's reduced "
                   "vocabulary: each drafting pass reads N rows of the target's LM head, not all of them); "
                   "saved with the head (default: the whole vocabulary)")
    p.add_argument("--medusa-num-heads", type=int, default=4,
                   help="medusa: heads to train, the most drafts per step (default: %(default)s)")
    p.add_argument("--medusa-num-layers", type=int, default=1,
                   help="medusa: residual blocks per head (default: %(default)s)")
    p.add_argument("--medusa-shared-lm-head", action="store_true",
                   help="medusa: save no LM head per head; serving uses the target's (far smaller for large vocabularies)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target = args.target
    if target is None:
        from pagelm.plugins.demo.model import ensure_demo_model

        target = ensure_demo_model()
    prompts = None
    if args.prompts_file is not None:
        prompts = [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    common = dict(
        num_prompts=args.num_prompts, prompt_len=args.prompt_len, gen_len=args.gen_len,
        temperature=args.temperature, steps=args.steps, max_seconds=args.max_seconds, lr=args.lr,
        batch_size=args.batch_size, seed=args.seed, prompts=prompts,
    )
    if args.method == "medusa":
        if args.draft_vocab_size is not None:
            raise SystemExit("--draft-vocab-size is for EAGLE heads (--method eagle)")
        from pagelm.plugins.spec_decode.medusa_train import MedusaTrainConfig, train_medusa_heads

        cfg = MedusaTrainConfig(
            num_heads=args.medusa_num_heads, num_layers=args.medusa_num_layers,
            own_lm_head=not args.medusa_shared_lm_head, **common,
        )
        train_medusa_heads(target, args.out, cfg)
        return 0
    from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head

    train_eagle_head(target, args.out, EagleTrainConfig(draft_vocab_size=args.draft_vocab_size, **common))
    return 0
