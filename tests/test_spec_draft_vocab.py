"""EAGLE heads with a draft vocabulary (EAGLE-3's reduced vocabulary): drafting reads only the
target LM head's rows for those ids, every draft is one of them, the logits are the full
logits' columns, and the output is what decoding without speculation gives (greedy and
seeded sampling). ``pagelm train-eagle --draft-vocab-size N`` saves the N most frequent
tokens of its training text with the head; ``--random-draft-head`` takes
``"draft_vocab_size"``."""

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from pagelm import LLM, SamplingParams
from pagelm.spec_decode import DeviceDrafts
from pagelm.cli import main
from pagelm.plugins.spec_decode.draft_vocab import DraftLMHead, check_draft_vocab
from pagelm.plugins.spec_decode.eagle_train import (
    EagleTrainConfig, most_frequent_tokens, self_distillation_text, train_eagle_head,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(20 + 9 * i, 36 + 9 * i))} for i in range(4)]
# A small vocabulary of the tiny model's 512 ids: the full head drafts outside it.
VOCAB_TEXT = dict(num_prompts=16, prompt_len=16, gen_len=32)
NUM_DRAFT_IDS = 16


@pytest.fixture(scope="module")
def heads(make_model, tmp_path_factory):
    """(target, full-vocabulary head, head with a 16-token draft vocabulary): the trainer's
    initialisation, untrained."""
    target = make_model("spec_llama", "llama")
    root = tmp_path_factory.mktemp("draft_vocab")
    train_eagle_head(target, root / "full", EagleTrainConfig(steps=0), log=lambda *_: None)
    train_eagle_head(target, root / "vocab", EagleTrainConfig(steps=0, draft_vocab_size=NUM_DRAFT_IDS, **VOCAB_TEXT),
                     log=lambda *_: None)
    return target, root / "full", root / "vocab"


def _eagle(head, **kw):
    return {"method": "eagle", "num_speculative_tokens": 3, "model": str(head), **kw}


def _run_recording_drafts(target, spec, prompts=PROMPTS, params=GREEDY):
    """Token ids per request, every drafted id, the acceptance counters, the proposer."""
    llm = LLM(str(target), dtype="float32", block_size=8, speculative_config=spec)
    drafted = []
    proposer = llm.engine.core.runner.spec.proposer if spec else None
    if proposer is not None:
        propose = proposer.propose

        def recording(batch):
            drafts = propose(batch)
            lists = drafts.tolist() if isinstance(drafts, DeviceDrafts) else drafts
            drafted.extend(t for d in lists for t in d)
            return drafts

        proposer.propose = recording
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.core.scheduler.spec_decoding_stats
    return [o.outputs[0].token_ids for o in outs], drafted, stats, proposer


def test_greedy_tokens_are_the_same_without_speculation_with_the_full_head_and_with_a_draft_vocabulary(heads):
    target, full, vocab = heads
    plain, _, _, _ = _run_recording_drafts(target, None)
    with_full, full_drafts, full_stats, _ = _run_recording_drafts(target, _eagle(full, adaptive=False))
    with_vocab, vocab_drafts, vocab_stats, proposer = _run_recording_drafts(target, _eagle(vocab, adaptive=False))
    assert with_full == plain and with_vocab == plain
    ids = set(proposer.lm_head.vocab.tolist())
    assert len(ids) == NUM_DRAFT_IDS and proposer.lm_head.weight.shape == (NUM_DRAFT_IDS, 64)
    assert vocab_stats.num_draft_tokens == len(vocab_drafts) > 0
    assert set(vocab_drafts) <= ids
    # The full head drafts outside the draft vocabulary: the restriction is what kept them in.
    assert set(full_drafts) - ids
    assert vocab_stats.num_accepted_tokens > 0 and full_stats.num_accepted_tokens > 0


def test_seeded_samples_are_the_same_with_a_draft_vocabulary(heads):
    target, _, vocab = heads
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=24, ignore_eos=True) for i in range(len(PROMPTS))]
    plain, _, _, _ = _run_recording_drafts(target, None, params=params)
    got, drafted, stats, proposer = _run_recording_drafts(target, _eagle(vocab, adaptive=False), params=params)
    assert got == plain
    assert stats.num_draft_tokens > 0 and set(drafted) <= set(proposer.lm_head.vocab.tolist())


def test_draft_logits_are_the_target_logits_columns_and_the_argmax_their_target_id(heads):
    target, _, vocab = heads
    llm = LLM(str(target), dtype="float32", block_size=8, speculative_config=_eagle(vocab))
    proposer = llm.engine.core.runner.spec.proposer
    lm_head, model = proposer.lm_head, proposer.target
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    full = model.compute_logits(hidden)
    assert lm_head.logits(hidden).dtype == torch.float32
    torch.testing.assert_close(lm_head.logits(hidden), full[:, lm_head.vocab], rtol=1e-6, atol=1e-6)
    assert lm_head.argmax(hidden).tolist() == lm_head.vocab[full[:, lm_head.vocab].argmax(-1)].tolist()
    # The whole vocabulary's argmax is the target's.
    whole = DraftLMHead(model, None, torch.device("cpu"))
    assert whole.size is None and whole.argmax(hidden).tolist() == full.argmax(-1).tolist()


def test_a_target_whose_logits_are_not_its_lm_head_alone_drafts_over_the_whole_vocabulary(llama_dir, caplog):
    llm = LLM(str(llama_dir), dtype="float32", block_size=8)
    model = llm.engine.core.runner.model
    lm_head = DraftLMHead(model, torch.arange(10, 30), torch.device("cpu"))
    assert lm_head.size == 20
    plain = model.compute_logits
    model.compute_logits = lambda hidden: 30 * torch.tanh(plain(hidden) / 30)  # a soft cap, as Gemma's
    with caplog.at_level("WARNING", logger="pagelm"):
        capped = DraftLMHead(model, torch.arange(10, 30), torch.device("cpu"))
    assert capped.size is None and "not its LM head alone" in caplog.text


@pytest.mark.parametrize("ids,config_size,message", [
    (torch.tensor([3, 5, 3]), None, "more than once"),
    (torch.tensor([3, 512]), None, r"outside the target's vocabulary \[0, 512\)"),
    (torch.tensor([-1, 4]), None, "outside"),
    (torch.tensor([[1, 2]]), None, "1-D"),
    (torch.tensor([1.0, 2.0]), None, "token ids"),
    (torch.tensor([1, 2]), 3, "draft_vocab_size=3"),
])
def test_a_malformed_draft_vocabulary_is_a_clear_error(ids, config_size, message):
    with pytest.raises(ValueError, match=message):
        check_draft_vocab(ids, 512, config_size)


def test_a_draft_vocabulary_in_any_order_is_kept_sorted():
    assert check_draft_vocab(torch.tensor([9, 2, 5], dtype=torch.int32), 512, 3).tolist() == [2, 5, 9]


def test_draft_vocab_size_in_the_speculative_config_is_refused_for_a_trained_head(heads):
    target, full, _ = heads
    with pytest.raises(ValueError, match="draft vocabulary comes with the head"):
        LLM(str(target), dtype="float32", speculative_config=_eagle(full, draft_vocab_size=16))


# ---- train-eagle --draft-vocab-size ---------------------------------------------------------


def test_train_eagle_saves_the_most_frequent_tokens_of_its_text_and_serving_loads_them(make_model, tmp_path, capsys):
    target = make_model("spec_llama", "llama")
    out = tmp_path / "head"
    assert main(["train-eagle", "--target", str(target), "--out", str(out), "--num-prompts", "12", "--prompt-len", "12",
                 "--gen-len", "20", "--steps", "3", "--batch-size", "4", "--draft-vocab-size", "24"]) == 0
    # The same text again (the trainer's is deterministic), counted here independently.
    text = self_distillation_text(target, EagleTrainConfig(num_prompts=12, prompt_len=12, gen_len=20))
    counts = Counter(text.flatten().tolist())
    want = sorted(sorted(counts, key=lambda t: (-counts[t], t))[:24])
    saved = load_file(str(out / "model.safetensors"))["draft_vocab"]
    assert saved.tolist() == want
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 24
    report = json.loads((out / "eagle_training.json").read_text())
    assert report["steps"] == 3 and report["draft_vocab_size"] == 24
    assert report["draft_vocab_coverage"] == pytest.approx(sum(counts[t] for t in want) / text.numel(), abs=1e-4)

    llm = LLM(str(target), dtype="float32", block_size=8, speculative_config=_eagle(out))
    assert llm.engine.core.runner.spec.proposer.lm_head.vocab.tolist() == want
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    plain = LLM(str(target), dtype="float32", block_size=8).generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_the_most_frequent_tokens_break_ties_by_the_lower_id_and_come_sorted():
    text = torch.tensor([[9, 5, 5, 3, 3, 7, 1, 9], [3, 5, 8, 8, 2, 2, 0, 0]])
    # counts: 5 and 3 three times; 9, 8, 2 and 0 twice; 7 and 1 once.
    ids, coverage = most_frequent_tokens(text, 4, vocab_size=16)
    assert ids.tolist() == [0, 2, 3, 5]
    assert coverage == pytest.approx(10 / 16)


def test_train_eagle_refuses_a_draft_vocabulary_larger_than_the_target_s(llama_dir, tmp_path):
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in 1\.\.512"):
        train_eagle_head(llama_dir, tmp_path / "head", EagleTrainConfig(steps=0, draft_vocab_size=513), log=lambda *_: None)


def test_a_head_whose_config_names_a_draft_vocabulary_it_lacks_is_refused(heads, tmp_path):
    target, full, _ = heads
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes((full / "model.safetensors").read_bytes())
    config = json.loads((full / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 8}))
    with pytest.raises(ValueError, match="no 'draft_vocab' tensor"):
        LLM(str(target), dtype="float32", speculative_config=_eagle(broken))


# ---- bench latency --random-draft-head ------------------------------------------------------


def test_random_draft_head_takes_a_draft_vocabulary_of_the_first_ids(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELM_CACHE_DIR", str(tmp_path / "cache"))
    spec = json.dumps({"method": "eagle", "num_speculative_tokens": 2, "adaptive": False, "draft_vocab_size": 100})
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1", "--input-len", "16",
                 "--output-len", "8", "--warmup", "0", "--iters", "1", "--speculative-config", spec,
                 "--random-draft-head", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    head = tmp_path / "cache" / "presets" / "random-heads" / f"{llama_dir.name}-eagle-vocab100"
    assert report["speculative_config"]["model"] == str(head) and "draft_vocab_size" not in report["speculative_config"]
    assert load_file(str(head / "model.safetensors"))["draft_vocab"].tolist() == list(range(100))
    (r,) = report["results"]
    assert r["spec"]["num_drafts"] >= 3 and r["spec"]["num_draft_tokens"] >= 2 * r["spec"]["num_drafts"] - 1


def test_random_draft_head_refuses_a_draft_vocabulary_for_medusa(llama_dir):
    spec = json.dumps({"method": "medusa", "num_speculative_tokens": 2, "draft_vocab_size": 100})
    with pytest.raises(SystemExit, match="draft_vocab_size is an eagle head's"):
        main(["bench", "latency", "--model", str(llama_dir), "--speculative-config", spec, "--random-draft-head"])
