"""``pagelm bench multimodal``: what images cost a vision-language model.

- **TTFT of a one-image prompt**, ``--iters`` times each way, medians: with an encoder-cache
  *miss* (a fresh random image every time: the encoder runs) and with a *hit* (an image
  encoded before, under new text: the encoder is skipped). Prefix caching is off, so the
  prompt's KV is computed every time either way. TTFT is the request's first token time minus
  its arrival (after the image was preprocessed in the API process); the preprocessing is
  reported apart (``preprocess_ms``).
- **Images per second through the encoder**: ``--num-images`` random images preprocessed
  once, then encoded in batches of ``--encoder-batch`` (``get_multimodal_embeddings``, timed
  with the device synchronised), best of ``--iters``.
- **Decode speed with and without an image**: a batch of ``--batch-size`` prompts, decode time
  per output token (TPOT) and tokens/s, once text-only and once with an image in each prompt,
  on the same engine, the text-only prompts as long as the expanded image prompts (the language
  model alone decodes either way, over the same context: the numbers should agree).

``--model llava-1.5-7b`` or ``--model qwen2-vl-2b`` runs the preset with random weights and
no tokenizer (Qwen2-VL keeps each image's size: 640x480 is 391 embeddings, where LLaVA crops
every image to 576); a model directory (e.g. one built by
``pagelm.models.testing.build_tiny_llava`` or ``build_tiny_qwen2_vl``) runs as it is.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.engine_args import add_engine_args, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "multimodal", help="vision-language models: TTFT with/without an encoder-cache hit, encoder images/s, TPOT",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model directory or a multimodal preset (llava-1.5-7b, qwen2-vl-2b)")
    p.add_argument("--input-len", type=int, default=64, help="text tokens around the image (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens in the decode run (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts in the decode run (default: %(default)s)")
    p.add_argument("--image-size", default="640x480", help="random images' WIDTHxHEIGHT (default: %(default)s)")
    p.add_argument("--num-images", type=int, default=64, help="images through the encoder (default: %(default)s)")
    p.add_argument("--encoder-batch", type=int, default=16, help="images per encoder call (default: %(default)s)")
    p.add_argument("--iters", type=int, default=5, help="timed runs of each measurement (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=run)


def random_image(rng: np.random.Generator, width: int, height: int):
    from PIL import Image

    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def run(args: argparse.Namespace) -> int:
    from pagelm import LLM, SamplingParams

    path, kwargs = resolve_bench_model(args.model, engine_kwargs(args))
    kwargs["enable_prefix_caching"] = False  # every prompt's KV computed: only the encoder cache differs
    llm = LLM(path, **kwargs)
    mm = llm.engine.inputs.mm_processor
    if mm is None:
        raise SystemExit(f"--model {args.model!r} is not a vision-language model")
    width, height = (int(x) for x in args.image_size.lower().split("x"))
    rng = np.random.default_rng(0)
    text = random.Random(0)
    vocab = min(llm.engine.vocab_size, 30000, mm.placeholder_token_id)  # text ids: never the placeholder

    def prompt(image=None, text_len: int = args.input_len) -> dict:
        ids = [text.randrange(100, vocab) for _ in range(text_len)]
        if image is None:
            return {"prompt_token_ids": ids}
        ids.insert(len(ids) // 2, mm.placeholder_token_id)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(p) -> float:
        return llm.generate(p, one, use_tqdm=False)[0].metrics.time_to_first_token

    ttft(prompt(random_image(rng, width, height)))  # warm-up
    seen = random_image(rng, width, height)
    ttft(prompt(seen))
    images = [random_image(rng, width, height) for _ in range(args.iters)]
    preprocess_s = []
    for image in images:
        t0 = time.perf_counter()
        mm.process([mm.placeholder_token_id], [image])
        preprocess_s.append(time.perf_counter() - t0)
    miss = [ttft(prompt(image)) for image in images]
    hit = [ttft(prompt(seen)) for _ in range(args.iters)]

    images_per_s = encoder_throughput(llm, mm, rng, width, height, args)
    num_embeddings = mm.num_embeddings(mm.preprocess(seen))
    # The text-only prompts are as long as the image prompts once their placeholder is expanded,
    # so both batches decode over the same context: only the image path (M-RoPE deltas) differs.
    tpot_text = decode_tpot(llm, [prompt(text_len=args.input_len + num_embeddings) for _ in range(args.batch_size)], args)
    tpot_image = decode_tpot(llm, [prompt(random_image(rng, width, height)) for _ in range(args.batch_size)], args)
    result = {
        "model": args.model, "image_size": args.image_size, "embeddings_per_image": num_embeddings,
        "input_len": args.input_len, "preprocess_ms": 1e3 * statistics.median(preprocess_s),
        "ttft_miss_ms": 1e3 * statistics.median(miss), "ttft_hit_ms": 1e3 * statistics.median(hit),
        "encoder_images_per_s": images_per_s,
        "decode_batch": args.batch_size, "tpot_text_ms": 1e3 * tpot_text, "tpot_image_ms": 1e3 * tpot_image,
        "decode_tok_per_s_text": args.batch_size / tpot_text, "decode_tok_per_s_image": args.batch_size / tpot_image,
        "encoder_runs": llm.engine.core.runner.num_encoded_images,
    }
    print(
        f"{args.model}: {num_embeddings} embeddings per {args.image_size} image, {args.input_len} text tokens\n"
        f"  TTFT, 1 image: miss {result['ttft_miss_ms']:.1f} ms, encoder-cache hit {result['ttft_hit_ms']:.1f} ms "
        f"(+ {result['preprocess_ms']:.1f} ms preprocessing in the API process)\n"
        f"  encoder: {images_per_s:.1f} images/s (batches of {args.encoder_batch})\n"
        f"  decode, batch {args.batch_size}: text-only {result['decode_tok_per_s_text']:.1f} tok/s "
        f"(TPOT {result['tpot_text_ms']:.2f} ms), with an image each {result['decode_tok_per_s_image']:.1f} tok/s "
        f"(TPOT {result['tpot_image_ms']:.2f} ms)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    llm.shutdown()
    return 0


def encoder_throughput(llm, mm, rng, width: int, height: int, args) -> float:
    """Images per second through ``get_multimodal_embeddings``, best of ``--iters``."""
    import torch

    from pagelm.multimodal import MultiModalFeature

    model, device = llm.engine.core.runner.model, llm.engine.core.device
    features = []
    for i in range(args.num_images):
        data = mm.preprocess(random_image(rng, width, height))
        features.append(MultiModalFeature("image", str(i), 0, mm.num_embeddings(data), data))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def encode_all() -> float:
        sync()
        t0 = time.perf_counter()
        for i in range(0, len(features), args.encoder_batch):
            model.get_multimodal_embeddings(features[i : i + args.encoder_batch])
        sync()
        return time.perf_counter() - t0

    with torch.inference_mode():
        encode_all()  # warm-up
        best = min(encode_all() for _ in range(max(args.iters, 1)))
    return len(features) / best


def decode_tpot(llm, prompts: list[dict], args) -> float:
    """Median decode time per output token of one batch (first token to last)."""
    from pagelm import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return statistics.median(
        (o.metrics.finished_time - o.metrics.first_token_time) / max(args.output_len - 1, 1) for o in outputs
    )
