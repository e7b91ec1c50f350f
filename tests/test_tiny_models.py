"""The offline tiny-model fixtures produce real, loadable, non-degenerate HF checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagelm.models import testing as tiny_models
from pagelm.models.testing import SPECIAL_TOKENS, build_tiny_model, build_tokenizer, tiny_model_dir


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def test_tokenizer_round_trips_multibyte_utf8(tmp_path):
    tokenizer = build_tokenizer(tmp_path)
    text = "def f(x):\n    return x  # Café, naïve, 日本語, 中文, 🙂🚀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 512


def test_tokenizer_special_token_ids(tmp_path):
    tokenizer = build_tokenizer(tmp_path)
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)


def test_tokenizer_is_deterministic(tmp_path):
    first = build_tokenizer(tmp_path / "a").get_vocab()
    tiny_models._trained_tokenizer_json.cache_clear()  # force a real retrain
    second = build_tokenizer(tmp_path / "b").get_vocab()
    assert first == second


def test_chat_template_renders_chatml(tmp_path):
    build_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_model_dir_loads_back_with_auto_classes(arch, tmp_root):
    path = tiny_model_dir(arch, tmp_root)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tokenizer) == 512
    assert model.config.num_hidden_layers == 2
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id


def test_qwen3_head_dim_differs_from_hidden_over_heads(tmp_root):
    config = json.loads((tiny_model_dir("qwen3", tmp_root) / "config.json").read_text())
    assert config["head_dim"] == 32 and config["hidden_size"] // config["num_attention_heads"] == 16


def test_sharded_dir_has_index_and_several_shards(tmp_root):
    path = tiny_model_dir("llama", tmp_root, sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((path / shard).is_file() for shard in shards)


def test_same_seed_gives_identical_weights(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a", "qwen2", seed=3))
    b = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", "qwen2", seed=3))
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_tiny_model_dir_is_cached_per_arguments(tmp_root):
    assert tiny_model_dir("llama", tmp_root) == tiny_model_dir("llama", tmp_root)
    assert tiny_model_dir("llama", tmp_root) != tiny_model_dir("llama", tmp_root, sharded=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_generation_is_not_degenerate(arch, tmp_root):
    path = tiny_model_dir(arch, tmp_root)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    input_ids = tokenizer("def hello(name):", return_tensors="pt").input_ids
    out = model.generate(input_ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    new_tokens = out[0, input_ids.shape[1]:].tolist()
    assert len(new_tokens) == 20
    assert len(set(new_tokens)) > 3


def test_dtype_argument_sets_saved_weight_dtype(tmp_root):
    path = tiny_model_dir("qwen3", tmp_root, dtype=torch.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_auto_tokenizer_keeps_chat_template_for_every_arch(arch, tmp_root):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir(arch, tmp_root))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n"
