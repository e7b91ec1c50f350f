"""Vision-language models: LLaVA's greedy tokens equal Hugging Face's with 0, 1 and 3
images of different sizes, whatever the chunking, prefix caching or preemption; the encoder
runs once per distinct image; different images never share KV; bad image input is a clear
ValueError."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaForConditionalGeneration, LlavaProcessor

from pagelm import LLM, SamplingParams
from pagelm.models.testing import build_tiny_llava, random_image

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


image = random_image


IMAGES = [image(0, 40, 60), image(1, 28, 28), image(2, 100, 50), image(3, 17, 90)]
# (prompt text, images): none, one, three (one of them twice), and a different one alone.
CASES = [
    ("class A: pass", []),
    ("def f(x): <image> return", [IMAGES[0]]),
    ("<image> and <image> then <image> import os", [IMAGES[1], IMAGES[2], IMAGES[1]]),
    ("look: <image>", [IMAGES[3]]),
]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="module")
def hf_tokens(llava_dir):
    """Hugging Face's greedy tokens for each case (its own processor expands the prompt)."""
    tokenizer = AutoTokenizer.from_pretrained(llava_dir)
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir).eval()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil.from_pretrained(llava_dir), tokenizer=tokenizer, patch_size=7,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )
    out = []
    for text, images in CASES:
        enc = processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append((enc["input_ids"][0].tolist(), ids[0, enc["input_ids"].shape[1] :].tolist()))
    return out


def prompts():
    return [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in CASES]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),  # whole prompts in one step
        dict(max_num_batched_tokens=8, enable_prefix_caching=False),  # chunks split images
        dict(max_num_batched_tokens=24, max_num_encoder_input_tokens=16, encoder_cache_size=32),  # one image a step
        dict(num_kv_blocks=18, max_model_len=72, max_num_batched_tokens=16, async_scheduling=True),  # preemptions
    ],
    ids=["whole", "chunked", "encoder-budget", "preempting"],
)
def test_llava_greedy_tokens_equal_hugging_face(llava_dir, hf_tokens, engine_args):
    args = dict(device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128) | engine_args
    with LLM(str(llava_dir), **args) as llm:
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        for (hf_prompt, hf_out), out in zip(hf_tokens, outputs):
            assert out.prompt_token_ids == hf_prompt
            assert list(out.outputs[0].token_ids) == hf_out
        core = llm.engine.core
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
        assert not core.scheduler.encoder_cache.refs
        if engine_args.get("num_kv_blocks"):
            assert core.scheduler.num_preemptions > 0


def test_the_same_image_twice_runs_the_encoder_once(llava_dir):
    with LLM(str(llava_dir), device="cpu", block_size=4, enable_prefix_caching=False) as llm:
        first = llm.generate(prompts()[1], GREEDY, use_tqdm=False)
        again = llm.generate({"prompt": "other text <image>", "multi_modal_data": {"image": image(0, 40, 60)}},
                             GREEDY, use_tqdm=False)
        runner, cache = llm.engine.core.runner, llm.engine.core.scheduler.encoder_cache
        assert runner.num_encoded_images == 1
        assert (cache.stats.queries, cache.stats.hits) == (2, 1)
        assert first[0].outputs[0].token_ids and again[0].outputs[0].token_ids


def test_different_images_never_share_kv_blocks(llava_dir):
    text = "x = 1\ny = 2\nz = 3\nw = 4\n <image> end"
    with LLM(str(llava_dir), device="cpu", block_size=4) as llm:
        llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[0]}}, GREEDY, use_tqdm=False)
        same = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[0]}}, GREEDY, use_tqdm=False)[0]
        other = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[2]}}, GREEDY, use_tqdm=False)[0]
        offset = same.prompt_token_ids.index(llm.engine.inputs.mm_processor.placeholder_token_id)
        assert other.num_cached_tokens == offset // 4 * 4  # only the blocks before the image
        # The same image: every full block but the one holding the last token (recomputed).
        assert same.num_cached_tokens == (len(same.prompt_token_ids) - 1) // 4 * 4 > offset + 4


def test_chat_with_image_parts_equals_the_rendered_prompt(llava_dir):
    import base64
    import io

    buffer = io.BytesIO()
    IMAGES[0].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    with LLM(str(llava_dir), device="cpu", block_size=4) as llm:
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "describe "}, {"type": "image_url", "image_url": {"url": url}},
            {"type": "image_pil", "image_pil": IMAGES[1]},
        ]}]
        chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
        text = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "describe <image><image>"}], tokenize=False, add_generation_prompt=True
        )
        ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
        direct = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": IMAGES[:2]}}, GREEDY,
                              use_tqdm=False)[0]
        assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
        assert chat.prompt_token_ids == direct.prompt_token_ids


@pytest.mark.parametrize(
    "prompt, error",
    [
        ({"prompt": "<image> <image>", "multi_modal_data": {"image": [IMAGES[0]]}}, "2 image placeholder"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": IMAGES[0]}}, "0 image placeholder"),
        ({"prompt": "<image>", "multi_modal_data": {"image": "not an image"}}, r"multi_modal_data.image\[0\]"),
        ({"prompt": "<image>" * 3, "multi_modal_data": {"image": [IMAGES[0]] * 3}}, "limit_mm_per_prompt"),
        ({"prompt": "<image>", "multi_modal_data": {"audio": b""}}, "multi_modal_data must be"),
        ({"prompt": "<image>", "multi_modal_data": {"image": Image.new("1", (9000, 9000))}}, "pixels"),
    ],
    ids=["too-few-images", "too-many-images", "not-an-image", "over-limit", "unknown-modality", "huge"],
)
def test_bad_image_input_is_a_clear_error(llava_dir, prompt, error):
    with LLM(str(llava_dir), device="cpu", block_size=4, limit_mm_per_prompt={"image": 2}) as llm:
        with pytest.raises(ValueError, match=error):
            llm.generate(prompt, GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()


def test_text_only_model_refuses_images(llama_dir):
    with LLM(str(llama_dir), device="cpu") as llm:
        with pytest.raises(ValueError, match="takes no images"):
            llm.generate({"prompt": "hi", "multi_modal_data": {"image": IMAGES[0]}}, GREEDY, use_tqdm=False)


def test_only_steps_covering_image_positions_merge_embeddings(llava_dir):
    """Text prompts on a vision-language model, and the decode steps of a prompt with an image,
    run the plain forward: no encoder, no merged embeddings."""
    with LLM(str(llava_dir), device="cpu", block_size=4) as llm:
        model, merges = llm.engine.core.runner.model, []
        merge = model.merge_multimodal_embeddings
        model.merge_multimodal_embeddings = lambda *args: merges.append(args[0].numel()) or merge(*args)
        llm.generate(["class A: pass", "def f(): return 1"], GREEDY, use_tqdm=False)
        assert merges == [] and llm.engine.core.runner.num_encoded_images == 0
        out = llm.generate(prompts()[1], GREEDY, use_tqdm=False)[0]
        assert merges == [len(out.prompt_token_ids)]  # the one prefill step; the 8 decode steps never
