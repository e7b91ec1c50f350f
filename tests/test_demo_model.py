"""The built-in demo model: trained by pagelm itself, written as a normal HF directory, cached."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagelm.plugins.demo import model as demo_model
from pagelm.plugins.demo.model import DEMO_MODEL_NAME, TRAINING_LOG, DemoModelArgs, ensure_demo_model, train_demo_model

# Small enough to train in a couple of seconds; the real recipe only changes sizes and steps.
TINY = dict(
    steps=40,
    seq_len=32,
    batch_size=8,
    lr=1e-2,
    seed=0,
    time_budget_s=None,
    progress=False,
    model_args=DemoModelArgs(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1),
    corpus_bytes=150_000,
)


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory) -> Path:
    return train_demo_model(tmp_path_factory.mktemp("demo") / "model", **TINY)


def _losses(model_dir: Path) -> list[float]:
    return json.loads((model_dir / TRAINING_LOG).read_text())["losses"]


def test_trained_dir_loads_with_transformers(trained_dir):
    model = AutoModelForCausalLM.from_pretrained(trained_dir)
    tokenizer = AutoTokenizer.from_pretrained(trained_dir)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tokenizer) == 512
    assert (trained_dir / "model.safetensors").is_file()
    ids = tokenizer("def f(x):\n    return x", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], 512)


def test_trained_dir_generates_with_pagelm(trained_dir):
    from pagelm import LLM, SamplingParams

    llm = LLM(str(trained_dir), dtype="float32")
    out = llm.generate(["import "], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_generation_config_stops_on_eos_and_im_end(trained_dir):
    tokenizer = AutoTokenizer.from_pretrained(trained_dir)
    eos = json.loads((trained_dir / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_chat_template_renders_chatml(trained_dir):
    tokenizer = AutoTokenizer.from_pretrained(trained_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_code_prompts_end_on_whole_tokens(trained_dir):
    # Words keep their trailing space, so "import " is one token, not "import" + a lone " ".
    tokenizer = AutoTokenizer.from_pretrained(trained_dir)
    assert tokenizer.tokenize("import ") == [tokenizer.tokenize("import os")[0]]
    assert tokenizer.decode(tokenizer.encode("def f():\n\tpass  # ünï 🙂")) == "def f():\n\tpass  # ünï 🙂"


def test_loss_goes_down(trained_dir):
    losses = _losses(trained_dir)
    assert len(losses) == TINY["steps"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_training_is_deterministic_given_seed(trained_dir, tmp_path):
    again = train_demo_model(tmp_path / "again", **TINY)
    assert _losses(again) == _losses(trained_dir)
    a = AutoModelForCausalLM.from_pretrained(trained_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_time_budget_stops_training_early(tmp_path):
    out = train_demo_model(tmp_path / "m", **{**TINY, "steps": 10_000, "time_budget_s": 1.0})
    assert 0 < len(_losses(out)) < 10_000


# --------------------------------------------------------------------------------------------
# ensure_demo_model: cache location, reuse, atomic writes
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_training(monkeypatch, trained_dir):
    """Replace the 3-minute recipe with a copy of the tiny model; count the calls."""
    calls = []

    def train(out_dir, progress=True):
        calls.append(out_dir)
        shutil.copytree(trained_dir, out_dir, dirs_exist_ok=True)
        return Path(out_dir)

    monkeypatch.setattr(demo_model, "train_demo_model", train)
    return calls


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGELM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_model.default_cache_dir() == tmp_path / "xdg" / "pagelm"
    monkeypatch.setenv("PAGELM_CACHE_DIR", str(tmp_path / "mine"))
    assert demo_model.default_cache_dir() == tmp_path / "mine"


def test_ensure_trains_once_then_reuses(fake_training, tmp_path):
    first = ensure_demo_model(tmp_path, progress=False)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = ensure_demo_model(tmp_path, progress=False)
    assert first == second == tmp_path / DEMO_MODEL_NAME
    assert len(fake_training) == 1
    assert (second / "model.safetensors").stat().st_mtime_ns == mtime


def test_ensure_uses_env_cache_dir(fake_training, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGELM_CACHE_DIR", str(tmp_path / "cache"))
    assert ensure_demo_model(progress=False) == tmp_path / "cache" / DEMO_MODEL_NAME


def test_failed_training_leaves_no_partial_directory(monkeypatch, tmp_path):
    def crash(out_dir, progress=True):
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_model, "train_demo_model", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_demo_model(tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{DEMO_MODEL_NAME}.lock"]


def test_leftover_temp_dir_of_killed_run_is_cleaned(fake_training, tmp_path):
    stale = tmp_path / f".{DEMO_MODEL_NAME}-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    ensure_demo_model(tmp_path, progress=False)
    assert not stale.exists()
