"""Medusa heads (``speculative_config={"method": "medusa"}``): the heads compute Medusa's
residual blocks, load Medusa-1's checkpoint layout, never change what comes out (greedy tokens
on every family through the conformance kit, seeded samples, async scheduling), are trained by
``pagelm train-eagle --method medusa`` and measured by ``pagelm bench latency``."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pagelm import LLM, SamplingParams
from pagelm.cli import main
from pagelm.plugins.spec_decode.medusa import MedusaHeads
from pagelm.plugins.spec_decode.medusa_train import MedusaTrainConfig, train_medusa_heads
from pagelm.testing.conformance import check_proposer
from spec_helpers import count_launches

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
QUIET = dict(log=lambda *_: None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def medusa_heads(make_model, tmp_path_factory):
    """medusa_heads(arch, **cfg) -> (target dir, heads dir): the trainer's initialisation (each
    head drafts the target's next token) with a little noise on the blocks, so drafts differ
    between heads and some are accepted, most not."""
    made = {}

    def get(arch, **cfg):
        key = (arch, tuple(sorted(cfg.items())))
        if key not in made:
            target = make_model(f"spec_{arch}", arch)
            out = tmp_path_factory.mktemp(f"medusa_{arch}")
            train_medusa_heads(target, out, MedusaTrainConfig(steps=0, **cfg), **QUIET)
            made[key] = (target, _perturb(out))
        return made[key]

    return get


def _perturb(heads_dir, scale=0.05):
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(0)
    weights = load_file(str(heads_dir / "model.safetensors"))
    weights = {n: t + scale * torch.randn(t.shape, generator=gen) if ".linear." in n else t for n, t in weights.items()}
    save_file(weights, str(heads_dir / "model.safetensors"))
    return heads_dir


def medusa(heads_dir, k=3, **kw):
    return {"method": "medusa", "num_speculative_tokens": k, "model": str(heads_dir), **kw}


def run(model_dir, prompts, params=GREEDY, **kw):
    llm = LLM(str(model_dir), dtype="float32", block_size=8, **kw)
    return llm, llm.generate(prompts, params, use_tqdm=False)


# ---- the heads ------------------------------------------------------------------------------


def test_stacked_heads_compute_medusa_residual_blocks_per_head():
    """Head i, block j: x <- x + SiLU(W[j,i] x + b[j,i]); then its own LM head."""
    torch.manual_seed(0)
    heads = MedusaHeads(hidden_size=8, num_heads=3, num_layers=2, vocab_size=11)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    h = torch.randn(5, 8)
    got = heads.logits(heads(h))
    for i in range(3):
        x = h
        for j in range(2):
            x = x + F.silu(F.linear(x, heads.weight[j, i], heads.bias[j, i]))
        torch.testing.assert_close(got[:, i], F.linear(x, heads.lm_head[i]))
    # The first two heads only (k below the number of heads): the same rows.
    torch.testing.assert_close(heads.logits(heads(h, 2)), got[:, :2])


def test_heads_load_medusa_one_checkpoint_names_with_or_without_prefix():
    heads = MedusaHeads(4, 2, 1, 6)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    saved = heads.checkpoint_weights()
    assert set(saved) == {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "1.0.linear.weight",
                          "1.0.linear.bias", "1.1.weight"}
    again = MedusaHeads(4, 2, 1, 6)
    again.load_weights({f"medusa_head.{n}": t for n, t in saved.items()})
    assert all(torch.equal(a, b) for a, b in zip(heads.parameters(), again.parameters()))
    with pytest.raises(ValueError, match=r"weights missing: \['1.1.weight'\]"):
        MedusaHeads(4, 2, 1, 6).load_weights({n: t for n, t in saved.items() if n != "1.1.weight"})


# ---- never changes the output ---------------------------------------------------------------


@pytest.mark.parametrize("arch", FAMILIES)
def test_medusa_greedy_output_is_identical_on_every_family(medusa_heads, arch):
    """The conformance kit: chunked prefill, prefix caching, preemption, max_model_len."""
    target, heads = medusa_heads(arch)
    stats = check_proposer("medusa", target, {"model": str(heads)})
    assert stats["num_drafts"] > 0


def test_heads_without_their_own_lm_heads_use_the_targets(medusa_heads):
    """Saved without LM heads, the heads draft through the target's compute_logits: the same
    drafts as heads that carry a copy of it."""
    prompts = [{"prompt_token_ids": list(range(20 + 9 * i, 36 + 9 * i))} for i in range(4)]
    stats = []
    for own in (True, False):
        target, heads = medusa_heads("llama", own_lm_head=own)
        assert ("0.1.weight" in _names(heads)) == own
        llm, outs = run(target, prompts, speculative_config=medusa(heads, adaptive=False))
        s = llm.engine.core.scheduler.spec_decoding_stats
        stats.append(([o.outputs[0].token_ids for o in outs], s.num_draft_tokens, s.num_accepted_tokens))
    assert stats[0] == stats[1]
    _, want = run(target, prompts)
    assert stats[0][0] == [o.outputs[0].token_ids for o in want]


def _names(heads_dir):
    from safetensors import safe_open

    with safe_open(str(heads_dir / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_seeded_sampling_gives_the_same_tokens_with_and_without_medusa(medusa_heads):
    """One-hot drafts: the rejection sampler keeps a seeded request's tokens exactly."""
    target, heads = medusa_heads("llama")
    prompts = [{"prompt_token_ids": [11, 12, 13] * 6}, {"prompt_token_ids": list(range(30, 50))}]
    params = [
        SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, frequency_penalty=0.5, repetition_penalty=1.2,
                       min_tokens=6, seed=3, max_tokens=24),
    ]
    _, want = run(target, prompts, params)
    llm, got = run(target, prompts, params, speculative_config=medusa(heads, adaptive=False))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.core.scheduler.spec_decoding_stats.num_drafts > 0


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
def test_medusa_engine_runs_ahead_where_nobody_drafts_with_the_same_outputs(medusa_heads, preempt):
    """The heads keep no state: under async scheduling the engine runs steps ahead while
    adaptive drafting has every request backed off (also through preemption), and gives the
    synchronous engine's tokens (and, without preemption, its verifications)."""
    target, heads = medusa_heads("llama")
    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(5, 250, (12 + 3 * i,), generator=gen).tolist()} for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=40 + 2 * i, ignore_eos=True) for i in range(6)]
    kv = dict(num_kv_blocks=24, max_model_len=128) if preempt else {}
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(str(target), dtype="float32", block_size=8, async_scheduling=async_scheduling,
                  speculative_config=medusa(heads, max_backoff_steps=4), **kv)
        core = llm.engine.core
        counts = count_launches(core)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
        results[async_scheduling] = ([o.outputs[0].token_ids for o in outs], counts, core.scheduler.num_preemptions)
    (want, sync_counts, _), (got, counts, preemptions) = results[False], results[True]
    assert got == want
    assert sync_counts["ahead"] == 0 and counts["ahead"] > 0 and counts["verify"] > 0
    if preempt:  # which steps preempt whom depends on the timing: the tokens do not
        assert preemptions > 0
    else:
        assert counts["verify"] == sync_counts["verify"]


# ---- configured like the rest ---------------------------------------------------------------


def test_medusa_config_problems_are_clear_errors(llama_dir, medusa_heads, tmp_path):
    with pytest.raises(ValueError, match="medusa needs 'model'"):
        LLM(str(llama_dir), speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="is not a Medusa heads directory"):
        LLM(str(llama_dir), speculative_config=medusa(tmp_path))
    _, heads = medusa_heads("llama")
    with pytest.raises(ValueError, match="num_speculative_tokens=5 is more than the 4 Medusa heads"):
        LLM(str(llama_dir), speculative_config=medusa(heads, k=5))


# ---- trained, and measured ------------------------------------------------------------------


def test_train_eagle_method_medusa_writes_heads_the_proposer_loads(llama_dir, tmp_path):
    out = tmp_path / "heads"
    assert main(["train-eagle", "--method", "medusa", "--target", str(llama_dir), "--out", str(out),
                 "--steps", "0", "--medusa-num-heads", "3"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 1)
    assert "2.1.weight" in _names(out)  # each head's own LM head
    assert main(["train-eagle", "--method", "medusa", "--target", str(llama_dir), "--out", str(tmp_path / "shared"),
                 "--steps", "0", "--medusa-shared-lm-head"]) == 0
    assert not any(name.endswith(".1.weight") for name in _names(tmp_path / "shared"))
    llm, outs = run(llama_dir, [{"prompt_token_ids": [11, 12, 13] * 4}], speculative_config=medusa(out))
    assert llm.engine.core.runner.spec.proposer.heads.num_heads == 3


@pytest.fixture(scope="module")
def bigram_target(make_model):
    """A one-layer model whose attention and MLP write nothing (o_proj and down_proj zero):
    its next token is a function of the current one, so its continuations are learnable, as a
    trained model's are and a random one's are not."""
    from safetensors.torch import load_file

    target = make_model("medusa_bigram", "llama", num_hidden_layers=1)
    weights = load_file(str(target / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_training_teaches_the_heads_the_targets_continuation(bigram_target, tmp_path):
    """Held out, the trained heads predict what the target says 2, 3, 4 tokens ahead, and the
    engine accepts their drafts: the trainer's labels line up with the positions the
    proposer drafts (an off-by-one would accept next to nothing)."""
    cfg = MedusaTrainConfig(num_heads=3, num_prompts=16, prompt_len=12, gen_len=24, steps=60, eval_every=20, lr=1e-2)
    report = train_medusa_heads(bigram_target, tmp_path / "heads", cfg, **QUIET)
    assert report["initial"]["accepted_per_step"] < 0.2 < 1.2 < report["kept"]["accepted_per_step"]
    prompts = [{"prompt_token_ids": list(range(20 + 9 * i, 36 + 9 * i))} for i in range(4)]
    llm, outs = run(bigram_target, prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                    speculative_config=medusa(tmp_path / "heads"))
    stats = llm.engine.core.scheduler.spec_decoding_stats
    assert stats.mean_acceptance_length > 2.0, stats
    _, want = run(bigram_target, prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_latency_measures_medusa_heads(llama_dir, tmp_path):
    train_medusa_heads(llama_dir, tmp_path / "heads", MedusaTrainConfig(steps=0), **QUIET)
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1", "--workload", "code",
                 "--input-len", "16", "--output-len", "6", "--warmup", "0", "--iters", "1",
                 "--speculative-config", json.dumps(medusa(tmp_path / "heads", k=2)), "--compare", "spec-off",
                 "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["spec"]["num_drafts"] > 0 and r["spec"]["num_draft_tokens"] <= 2 * r["spec"]["num_drafts"]
    assert r["speedup"] is not None
