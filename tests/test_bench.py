"""`pagelm bench latency` and `pagelm bench throughput`: presets, workloads, the roofline
model, and both benchmarks end to end on a tiny model on the CPU (Hugging Face peer included)."""

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, LlamaConfig

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import random_prompts
from pagelm.plugins.bench.presets import PRESETS, materialize, resolve_bench_model
from pagelm.plugins.bench.roofline import DecodeCost, decode_avg_context, measure_copy_bandwidth
from pagelm.plugins.bench.workload import TokenWorkload
from pagelm.cli import build_parser, main

# ---- presets --------------------------------------------------------------------------------

# Parameter counts of the published checkpoints (a tied embedding counted once).
PUBLISHED_PARAMS = {
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen3-8b": 8_190_735_360,
    "llava-1.5-7b": 7_063_427_072,
    "qwen2-vl-2b": 2_208_985_600,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_has_the_published_parameter_count(name, tmp_path):
    config = AutoConfig.from_pretrained(materialize(name, tmp_path))
    auto = AutoModelForImageTextToText if "vision_config" in PRESETS[name] else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    assert type(model).__name__ == PRESETS[name]["architectures"][0]
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]


def test_preset_directory_holds_only_a_bfloat16_config(tmp_path):
    path = materialize("llama-3.2-1b", tmp_path)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    config = AutoConfig.from_pretrained(path)
    assert config.dtype == torch.bfloat16
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 32.0


def test_preset_runs_with_random_weights_and_no_tokenizer_unless_flags_say_otherwise(tmp_path):
    path, kwargs = resolve_bench_model("qwen3-0.6b", {"load_format": "auto"}, tmp_path)
    assert path == str(tmp_path / "qwen3-0.6b")
    assert kwargs == {"load_format": "auto", "skip_tokenizer_init": True}


def test_bench_model_that_is_neither_directory_nor_preset_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="neither a model directory nor a preset"):
        resolve_bench_model("qwen9-1t", {}, tmp_path)


# ---- an engine without a tokenizer (skip_tokenizer_init) ------------------------------------


@pytest.fixture(scope="module")
def config_only_dir(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("config-only")
    shutil.copy(llama_dir / "config.json", path / "config.json")
    return path


def test_engine_without_tokenizer_returns_token_ids_and_empty_text(config_only_dir):
    llm = LLM(str(config_only_dir), load_format="dummy", skip_tokenizer_init=True)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert out[0].outputs[0].text == ""
    assert llm.get_tokenizer() is None


def test_engine_without_tokenizer_refuses_text_prompts_and_stop_strings(config_only_dir):
    llm = LLM(str(config_only_dir), load_format="dummy", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [5]}, SamplingParams(stop=["x"]), use_tqdm=False)


# ---- workloads ------------------------------------------------------------------------------


def test_nano_vllm_workload_has_nano_vllms_token_totals():
    w = TokenWorkload.nano_vllm()
    assert len(w.prompt_token_ids) == 256
    assert w.num_prompt_tokens == 142_827
    assert w.num_output_tokens == 133_966
    assert all(100 <= len(p) <= 1024 for p in w.prompt_token_ids)
    assert max(max(p) for p in w.prompt_token_ids) == 10000  # randint's bound is inclusive


def test_fixed_workload_has_exact_shapes_inside_the_vocabulary():
    w = TokenWorkload.fixed(3, 7, 5, vocab_size=50, seed=1)
    assert [len(p) for p in w.prompt_token_ids] == [7, 7, 7]
    assert w.output_lens == [5, 5, 5]
    assert max(max(p) for p in w.prompt_token_ids) < 50


def test_latency_prompts_are_fresh_each_run_and_the_same_for_every_engine():
    assert random_prompts(0, 2, 8, 512, 0) == random_prompts(0, 2, 8, 512, 0)
    assert random_prompts(0, 2, 8, 512, 0) != random_prompts(0, 2, 8, 512, 1)


# ---- the roofline ---------------------------------------------------------------------------

_TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, architectures=["LlamaForCausalLM"],
)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_bytes_per_step_match_a_hand_count(tied):
    cost = DecodeCost.from_hf_config(LlamaConfig(**_TINY, tie_word_embeddings=tied), torch.float32)
    # per layer: q 64x64 + k, v 64x32 each + o 64x64 + MLP 3 x 64x128 + 2 norms of 64 = 36,992;
    # 2 layers + final norm 64 + lm_head 512x64 (read in full, tied or not) = 106,816 params.
    assert cost.weight_bytes == 106_816 * 4
    assert cost.embedding_row_bytes == 64 * 4
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head 16
    # 4 sequences at 20 tokens of context: weights + 4 embedding rows + 80 tokens of KV.
    assert cost.bytes_per_step(4, 20) == 427_264 + 4 * 256 + 80 * 512


def test_mean_decode_context_is_prompt_plus_half_the_output():
    # Steps making tokens 2..4 of a 10-token prompt read 11, 12 and 13 tokens of KV.
    assert decode_avg_context(10, 4) == (11 + 12 + 13) / 3


def test_copy_bandwidth_is_measured_on_the_cpu():
    assert measure_copy_bandwidth(torch.device("cpu"), 1 << 20, 3) > 1e8


# ---- the command line -----------------------------------------------------------------------


def test_bench_lists_latency_and_throughput(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "latency" in out and "throughput" in out and "serve" in out


@pytest.mark.parametrize("bench_name", ["latency", "throughput"])
def test_every_bench_flag_has_help(bench_name):
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    parser = bench._subparsers._group_actions[0].choices[bench_name]
    missing = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert missing == []


def test_latency_runs_end_to_end_against_hf(llama_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main([
        "bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1,2", "--input-len", "8",
        "--output-len", "6", "--iters", "1", "--compare", "hf", "--hf-output-len", "4", "--json", str(out),
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["weight_bytes"] == 106_816 * 4  # the tiny Llama above, untied, float32
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["tpot_s"] > 0 and r["ttft_s"] > 0 and r["e2e_s"] > r["tpot_s"]
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch_size"] / r["tpot_s"])
        assert 0 < r["mbu"] and r["roofline_tokens_per_s"] > 0
        assert r["hf"]["output_len"] == 4 and r["hf"]["ttft_s"] > 0 and r["hf"]["tpot_s"] > 0
        assert r["hf_ratio"] == pytest.approx(r["decode_tokens_per_s"] / (r["batch_size"] / r["hf"]["tpot_s"]))
    assert "pagelm/HF" in capsys.readouterr().out


def test_latency_profiles_a_step_operator_by_operator(llama_dir, tmp_path, capsys):
    """``--profile-kernels``: on the CPU the torch operators of one more run, per engine step.
    Every step of the tiny Llama runs one matmul per projection (qkv, o, gate_up, down) per
    layer and one for the LM head."""
    from transformers import AutoConfig

    out = tmp_path / "latency.json"
    rc = main([
        "bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1", "--input-len", "8",
        "--output-len", "5", "--iters", "1", "--profile-kernels", "3", "--json", str(out),
    ])
    assert rc == 0
    profile = json.loads(out.read_text())["results"][0]["kernel_profile"]
    assert profile["device"] == "cpu" and profile["num_steps"] == 5
    rows = {r["name"]: r for r in profile["kernels"]}
    num_layers = AutoConfig.from_pretrained(llama_dir).num_hidden_layers
    assert rows["aten::mm"]["per_step"] == 4 * num_layers + 1
    assert profile["busy_us_per_step"] == pytest.approx(sum(r["us_per_step"] for r in profile["kernels"]))
    times = [r["us_per_step"] for r in profile["kernels"]]
    assert times == sorted(times, reverse=True) and times[0] > 0
    printed = capsys.readouterr().out
    assert "torch operator (self time, CPU)" in printed and "outside them" in printed
    with pytest.raises(SystemExit, match="--profile-kernels must be >= 0"):
        main(["bench", "latency", "--model", str(llama_dir), "--profile-kernels", "-1"])


def test_throughput_fixed_runs_end_to_end_against_hf(llama_dir, tmp_path):
    out = tmp_path / "throughput.json"
    rc = main([
        "bench", "throughput", "--model", str(llama_dir), "--workload", "fixed", "--num-seqs", "4",
        "--input-len", "8", "--output-len", "5", "--compare", "hf", "--hf-num-seqs", "2", "--json", str(out),
    ])
    assert rc == 0
    hf, pagelm = json.loads(out.read_text())["results"]
    assert (hf["target"], hf["num_requests"], hf["prompt_tokens"], hf["output_tokens"]) == ("hf", 2, 16, 10)
    assert (pagelm["target"], pagelm["num_requests"], pagelm["prompt_tokens"], pagelm["output_tokens"]) == (
        "pagelm", 4, 32, 20,
    )
    assert pagelm["output_tokens_per_s"] > 0 and hf["output_tokens_per_s"] > 0
    assert pagelm["total_tokens_per_s"] == pytest.approx(52 / pagelm["elapsed_s"])


def test_llava_preset_processes_an_image_into_576_embeddings(tmp_path):
    """What `pagelm bench multimodal --model llava-1.5-7b` needs before any weight: CLIP's
    processor from the preset directory, with no tokenizer."""
    import numpy as np
    from PIL import Image

    from pagelm.models.llava import LlavaProcessor

    path = materialize("llava-1.5-7b", tmp_path)
    processor = LlavaProcessor(path, AutoConfig.from_pretrained(path), tokenizer=None)
    image = Image.fromarray(np.zeros((480, 640, 3), dtype=np.uint8))
    ids, features = processor.process([1, 32000, 2], [image])
    assert features[0].data["pixel_values"].shape == (3, 336, 336)
    assert (features[0].offset, features[0].length, len(ids)) == (1, 576, 578)


def test_qwen2_vl_preset_processes_a_640x480_image_into_391_embeddings(tmp_path):
    """What `pagelm bench multimodal --model qwen2-vl-2b` needs before any weight: Qwen2-VL's
    image processor from the preset directory (released min/max pixels), with no tokenizer."""
    import numpy as np
    from PIL import Image

    from pagelm.models.qwen2_vl import Qwen2VLProcessor

    path = materialize("qwen2-vl-2b", tmp_path)
    processor = Qwen2VLProcessor(path, AutoConfig.from_pretrained(path), tokenizer=None)
    image = Image.fromarray(np.zeros((480, 640, 3), dtype=np.uint8))
    ids, features = processor.process([1, 151655, 2], [image])
    # 476 x 644 pixels (multiples of 28): 34 x 46 patches of 14, 17 x 23 embeddings.
    assert features[0].data["image_grid_thw"].tolist() == [1, 34, 46]
    assert features[0].data["pixel_values"].shape == (34 * 46, 3 * 2 * 14 * 14)
    assert (features[0].offset, features[0].length, len(ids)) == (1, 391, 393)
