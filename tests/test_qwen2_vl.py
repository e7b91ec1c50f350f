"""Qwen2-VL: greedy tokens (and their logprobs) equal Hugging Face's with 0, 1 and 3 images of
different sizes, whatever the chunking (inside an image), prefix caching or preemption; the
M-RoPE positions follow ``get_rope_index``; chat content parts become Qwen2-VL's image
markers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

from pagelm import LLM, SamplingParams
from pagelm.models.qwen2_vl import mrope_positions
from pagelm.models.testing import IMAGE_PAD, QWEN2_VL_IMAGE, build_tiny_qwen2_vl, random_image
from pagelm.multimodal import MultiModalFeature
from pagelm.worker.cuda_graphs import CudaGraphRunner

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
V = QWEN2_VL_IMAGE


image = random_image


# Resized to 42x56, 28x28, 84x42 and 14x84 pixels: 12, 4, 18 and 6 embeddings (3x4, 2x2, 6x3, 1x6).
IMAGES = [image(0, 40, 60), image(1, 28, 28), image(2, 100, 50), image(3, 17, 90)]
CASES = [
    ("class A: pass", []),
    (f"def f(x): {V} return", [IMAGES[0]]),
    (f"{V} and {V} then {V} import os", [IMAGES[1], IMAGES[2], IMAGES[1]]),
    (f"look: {V}", [IMAGES[3]]),
]


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl") / "tiny-qwen2-vl")


def hf_inputs(model_dir, text: str, images: list) -> dict:
    """What ``Qwen2VLProcessor`` gives ``generate`` (built here from its parts: its video
    processor needs torchvision): each ``<|image_pad|>`` repeated once per merged patch."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    enc = dict(Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=images, return_tensors="pt")) if images else {}
    grids = iter(enc.get("image_grid_thw", []))
    ids = []
    for t in tokenizer.encode(text):
        ids += [t] * (int(next(grids).prod()) // 4 if t == pad else 1)
    input_ids = torch.tensor([ids])
    enc.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=(input_ids == pad).int())
    return enc


@pytest.fixture(scope="module")
def hf_results(qwen2_vl_dir):
    """Hugging Face's prompt ids, greedy tokens and their logprobs for each case."""
    model = Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl_dir).eval()
    out = []
    for text, images in CASES:
        enc = hf_inputs(qwen2_vl_dir, text, images)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        tokens = gen.sequences[0, enc["input_ids"].shape[1]:].tolist()
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.scores, tokens)]
        out.append((enc["input_ids"][0].tolist(), tokens, logprobs))
    return out


def prompts():
    return [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in CASES]


def assert_equal_to_hf(outputs, hf_results):
    for (hf_prompt, hf_tokens, hf_logprobs), out in zip(hf_results, outputs):
        assert out.prompt_token_ids == hf_prompt
        completion = out.outputs[0]
        assert list(completion.token_ids) == hf_tokens
        logprobs = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        assert logprobs == pytest.approx(hf_logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),  # whole prompts in one step
        dict(max_num_batched_tokens=8, enable_prefix_caching=False),  # 8-token chunks: every image split
        dict(num_kv_blocks=20, max_model_len=72, max_num_batched_tokens=16),  # a pool that preempts
    ],
    ids=["whole", "chunked", "preempting"],
)
def test_qwen2_vl_greedy_tokens_equal_hugging_face(qwen2_vl_dir, hf_results, engine_args):
    args = dict(device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128) | engine_args
    with LLM(str(qwen2_vl_dir), **args) as llm:
        assert_equal_to_hf(llm.generate(prompts(), GREEDY, use_tqdm=False), hf_results)
        core = llm.engine.core
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
        assert not core.scheduler.encoder_cache.refs
        if engine_args.get("num_kv_blocks"):
            assert core.scheduler.num_preemptions > 0


def test_prefix_cache_hit_on_a_repeated_prompt_keeps_the_tokens(qwen2_vl_dir, hf_results):
    """The second run of each prompt starts from cached KV (the chunk after the hit reads its
    own M-RoPE columns) and still equals Hugging Face."""
    with LLM(str(qwen2_vl_dir), device="cpu", block_size=4, max_num_batched_tokens=16) as llm:
        assert_equal_to_hf(llm.generate(prompts(), GREEDY, use_tqdm=False), hf_results)
        again = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert_equal_to_hf(again, hf_results)
        for out in again:
            assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // 4 * 4 > 0


def test_decode_with_images_beside_text_requests_in_one_batch(qwen2_vl_dir, hf_results):
    """Requests arriving one step apart share decode steps: shifted (image) and unshifted
    (text) positions in one batch, and a prompt chunk beside decodes."""
    with LLM(str(qwen2_vl_dir), device="cpu", block_size=4, max_num_batched_tokens=24) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts()):
            engine.add_request(str(i), prompt, GREEDY)
            engine.step()
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        assert_equal_to_hf([outputs[str(i)] for i in range(len(CASES))], hf_results)


def test_mrope_positions_follow_get_rope_index(qwen2_vl_dir):
    model = Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl_dir).eval()
    text, images = CASES[2]
    enc = hf_inputs(qwen2_vl_dir, text + " tail", images)
    ids = enc["input_ids"]
    hf_positions, hf_delta = model.model.get_rope_index(ids, enc["mm_token_type_ids"], enc["image_grid_thw"])
    pad = model.config.image_token_id
    features, row, i = [], iter(enc["image_grid_thw"]), 0
    flat = ids[0].tolist()
    while i < len(flat):
        if flat[i] == pad:
            grid = next(row)
            n = int(grid.prod()) // 4
            features.append(MultiModalFeature("image", str(i), i, n, {"image_grid_thw": grid}))
            i += n
        else:
            i += 1
    positions, delta = mrope_positions(len(flat), features, merge_size=2)
    assert positions.tolist() == hf_positions[:, 0].tolist()
    assert delta == int(hf_delta) < 0


def test_chat_with_image_parts_uses_the_vision_markers(qwen2_vl_dir):
    with LLM(str(qwen2_vl_dir), device="cpu", block_size=4) as llm:
        assert llm.engine.inputs.mm_processor.placeholder_text == V
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "describe "}, {"type": "image_pil", "image_pil": IMAGES[0]},
            {"type": "text", "text": " and "}, {"type": "image_pil", "image_pil": IMAGES[3]},
        ]}]
        chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
        text = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": f"describe {V} and {V}"}], tokenize=False, add_generation_prompt=True
        )
        direct = llm.generate({"prompt": text, "multi_modal_data": {"image": [IMAGES[0], IMAGES[3]]}}, GREEDY,
                              use_tqdm=False)[0]
        assert chat.prompt_token_ids == direct.prompt_token_ids
        assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
        pad = llm.engine.inputs.mm_processor.placeholder_token_id
        assert chat.prompt_token_ids.count(pad) == 12 + 6


def test_images_of_different_sizes_get_their_own_embedding_counts(qwen2_vl_dir):
    with LLM(str(qwen2_vl_dir), device="cpu", block_size=4) as llm:
        mm = llm.engine.inputs.mm_processor
        counts = [mm.num_embeddings(mm.preprocess(img)) for img in IMAGES]
        assert counts == [12, 4, 18, 6]
        # Bounded by max_pixels (3,920: 400x300 shrinks to 70x42) and min_pixels (784: 10x10 grows to 28x28).
        assert mm.num_embeddings(mm.preprocess(image(5, 400, 300))) == 5 * 3
        assert mm.num_embeddings(mm.preprocess(image(6, 10, 10))) == 2 * 2


def test_tied_embedding_checkpoint_equals_hugging_face(tmp_path):
    """Qwen2-VL-2B ties its LM head to the embedding (on the outer config in transformers 5)."""
    model_dir = build_tiny_qwen2_vl(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    text, images = CASES[1]
    enc = hf_inputs(model_dir, text, images)
    with torch.no_grad():
        hf = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    with LLM(str(model_dir), device="cpu", block_size=4) as llm:
        out = llm.generate(prompts()[1], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf


class CpuDecodeGraphs(CudaGraphRunner):
    """The decode-graph path on CPU: nothing is captured; a replay runs eagerly the step a
    graph records (inputs derived from the staging, deltas added, the model)."""

    def replay(self, size: int):
        self._derive_inputs(size)
        md = self.builder.build(self.common_metadata(size, self.seq_lens[:size].clone()))
        self.num_replays += 1
        return self._step(size, md)


@pytest.mark.parametrize("budget", [128, 1], ids=["whole-prompts", "one-token-chunks"])
def test_decode_graphs_add_each_requests_delta(qwen2_vl_dir, hf_results, budget):
    """Decode steps through the graph path stage each request's delta (images before: < 0,
    text: 0) and still equal Hugging Face; one-token prompt chunks (uniform steps too) run
    eagerly, since the graph has no M-RoPE columns."""
    with LLM(str(qwen2_vl_dir), device="cpu", block_size=4, max_num_batched_tokens=budget,
             long_prefill_token_threshold=budget) as llm:
        runner = llm.engine.core.runner
        runner.cuda_graphs = CpuDecodeGraphs(
            runner.model, runner.buffers, runner.metadata_builder, [1, 2, 4], runner.max_model_len,
            runner.block_size, position_offsets=True,
        )
        assert_equal_to_hf(llm.generate(prompts(), GREEDY, use_tqdm=False), hf_results)
        assert runner.cuda_graphs.num_replays >= MAX_TOKENS - 1


@pytest.mark.gpu
def test_cuda_decode_graphs_with_images_equal_hugging_face(qwen2_vl_dir, hf_results):
    """On a GPU the decode steps replay captured graphs that add each request's M-RoPE delta
    (the path the CPU test above can only run eagerly): tokens still equal Hugging Face's,
    and the graphs are what ran the decodes."""
    with LLM(str(qwen2_vl_dir), device="cuda", dtype="float32", block_size=16) as llm:
        graphs = llm.engine.core.runner.cuda_graphs
        assert graphs is not None
        before = graphs.num_replays
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        for (hf_prompt, hf_tokens, hf_logprobs), out in zip(hf_results, outputs):
            assert out.prompt_token_ids == hf_prompt
            assert list(out.outputs[0].token_ids) == hf_tokens
        assert graphs.num_replays - before >= MAX_TOKENS - 1
