"""GPU memory sizing of a vision-language model (issue 19): the profiling pass also runs the
vision encoder on the largest image batch one step may encode, and the KV pool leaves room
for a full encoder cache (``pagelm.worker.kv_sizing``)."""

from __future__ import annotations

import types

import pytest
import torch

from pagelm import LLM
from pagelm.models.llava import LlavaProcessor
from pagelm.models.qwen2_vl import Qwen2VLProcessor
from pagelm.models.testing import build_tiny_llava, build_tiny_qwen2_vl
from pagelm.worker import kv_sizing
from pagelm.worker.kv_sizing import kv_blocks_in_budget

GiB, MiB = 2**30, 2**20


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")  # 28 px, patch 7: 16 a image


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl") / "tiny-qwen2-vl")  # at most 20 a image


def record_encoder_calls(model) -> list[list]:
    """Wrap ``model.get_multimodal_embeddings``: each call's features, and what it returned."""
    calls = []
    encode = model.get_multimodal_embeddings

    def recorded(features):
        out = encode(features)
        calls.append((features, out))
        return out

    model.get_multimodal_embeddings = recorded
    return calls


# ---- the arithmetic ------------------------------------------------------------------------
def test_the_kv_budget_shrinks_by_exactly_the_encoder_cache_bytes():
    args = dict(total=80 * GiB, free=60 * GiB, reserved=19 * GiB, peak=20 * GiB, utilization=0.9,
                graphs=GiB // 2, per_block=MiB)
    without = kv_blocks_in_budget(**args)
    assert without == int(50.5 * 1024)
    assert kv_blocks_in_budget(**args, encoder_cache=3 * GiB) == without - 3 * 1024
    # Capped by what is free, the cache comes out of that too: 4 GiB free, 1 GiB of cache.
    assert kv_blocks_in_budget(80 * GiB, 4 * GiB, 70 * GiB, GiB, 0.9, 0, GiB, encoder_cache=GiB) == 3


def test_a_card_sizes_the_pool_without_the_encoder_cache(monkeypatch):
    # A CUDA rank, faked: its step peaks at 20 GiB; a full encoder cache takes 2 GiB.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 19 * GiB)

    class Spec:
        num_kv_heads, head_dim = 8, 128  # 2 * 8 * 128 * 2 bytes * 16 tokens = 64 KiB a block

    layer = types.SimpleNamespace(spec=Spec())
    config = types.SimpleNamespace(block_size=16, enforce_eager=True, gpu_memory_utilization=0.9)

    def runner(cache_bytes):
        return types.SimpleNamespace(
            device=torch.device("cuda"), dtype=torch.float16, profile_run=lambda: 20 * GiB,
            encoder_cache_bytes=lambda: cache_bytes,
        )

    text = kv_sizing.this_rank_kv_blocks(config, runner(0), [layer], 4096)
    vision = kv_sizing.this_rank_kv_blocks(config, runner(2 * GiB), [layer], 4096)
    assert text == 51 * GiB // (64 * 1024)
    assert text - vision == 2 * GiB // (64 * 1024)


def test_the_encoder_cache_bytes_are_its_embeddings_at_the_language_models_width(llava_dir, llama_dir):
    with LLM(str(llava_dir), device="cpu", dtype="float32", encoder_cache_size=48) as llm:
        runner = llm.engine.core.runner
        hidden = llm.engine.core.hf_config.text_config.hidden_size
        assert runner.encoder_cache_bytes() == 48 * hidden * 4
    with LLM(str(llama_dir), device="cpu") as llm:
        assert llm.engine.core.runner.encoder_cache_bytes() == 0
        assert llm.engine.core.runner.profile_encoder() == 0  # a text model: no encoder, no processor


# ---- the encoder in the profiling pass -----------------------------------------------------
def test_llava_profiles_as_many_whole_images_as_the_encoder_budget_allows(llava_dir):
    with LLM(str(llava_dir), device="cpu", dtype="float32", max_num_encoder_input_tokens=40,
             encoder_cache_size=64) as llm:
        core = llm.engine.core
        runner = core.runner
        runner.mm_processor = LlavaProcessor(llava_dir, core.hf_config, None)
        calls = record_encoder_calls(runner.model)
        assert runner.encoder_profile_embeddings() == 40
        assert runner.profile_encoder() == 32  # two 16-embedding images; a third would make 48
        (features, out), = calls
        assert [f.data["pixel_values"].shape for f in features] == [torch.Size([3, 28, 28])] * 2
        hidden = core.hf_config.text_config.hidden_size
        assert [e.shape for e in out] == [torch.Size([16, hidden])] * 2
        assert runner.encoder_cache == {} and runner.num_encoded_images == 0  # nothing kept


def test_the_profiled_batch_is_no_larger_than_the_encoder_cache(llava_dir):
    # One step's images all have room in the cache at once: a 20-embedding cache encodes one image.
    with LLM(str(llava_dir), device="cpu", dtype="float32", max_num_encoder_input_tokens=40,
             encoder_cache_size=20) as llm:
        runner = llm.engine.core.runner
        runner.mm_processor = LlavaProcessor(llava_dir, llm.engine.core.hf_config, None)
        calls = record_encoder_calls(runner.model)
        assert runner.profile_encoder() == 16
        assert len(calls[0][0]) == 1


def test_qwen2_vl_profiles_the_largest_images_then_the_rest_of_the_budget(qwen2_vl_dir):
    # max_pixels 3,920 = 20 embeddings of 14 x 14 pixels: 46 = 20 (4 x 5) + 20 + 6 (2 x 3).
    with LLM(str(qwen2_vl_dir), device="cpu", dtype="float32", max_num_encoder_input_tokens=46,
             encoder_cache_size=46) as llm:
        core = llm.engine.core
        runner = core.runner
        runner.mm_processor = Qwen2VLProcessor(qwen2_vl_dir, core.hf_config, None)
        calls = record_encoder_calls(runner.model)
        assert runner.profile_encoder() == 46
        (features, out), = calls
        assert [f.data["image_grid_thw"].tolist() for f in features] == [[1, 8, 10], [1, 8, 10], [1, 4, 6]]
        assert [f.data["pixel_values"].shape for f in features] == [
            torch.Size([80, 3 * 2 * 7 * 7]), torch.Size([80, 294]), torch.Size([24, 294])
        ]
        hidden = core.hf_config.text_config.hidden_size
        assert [e.shape for e in out] == [torch.Size([20, hidden]), torch.Size([20, hidden]), torch.Size([6, hidden])]


def test_a_processor_without_dummy_inputs_profiles_nothing(llava_dir, caplog):
    with LLM(str(llava_dir), device="cpu", dtype="float32") as llm:
        runner = llm.engine.core.runner
        processor = LlavaProcessor(llava_dir, llm.engine.core.hf_config, None)
        processor.dummy_inputs = lambda n: []  # a third-party processor that predates 2.12
        runner.mm_processor = processor
        calls = record_encoder_calls(runner.model)
        assert runner.profile_encoder() == 0
        assert calls == []
        assert "not counted" in caplog.text
