"""Programmatic dependent launch against reads of the step's metadata before the wait (GPU).

Rotary, the K/V store and attention read positions, slots, lengths and block tables before
waiting for the kernel before them (``pagelm.backends.kernels.common``). Were any of those
read stale (a writer still running, an old L1 line), a token's attention would see the wrong
keys and its output would change. With PDL off every kernel waits for the one before it, so
the same run with PDL on and off must give the same tokens, bit for bit (the kernels are
otherwise the same): many requests of mixed lengths, decode batches of 1 to 16 in graphs,
bf16 (the one-row GEMV's path) and a split-K attention over growing contexts.

EAGLE's drafting passes run the same kernels over the head's own metadata, written between
passes. A greedy run's tokens do not depend on its drafts, so the EAGLE run also compares
how many tokens were drafted and accepted: a stale read in a drafting pass would change a
draft and, over hundreds of them, those counts.

The pool is a fixed ``num_kv_blocks``: sized from the card's free memory instead, it came out
empty in two of five runs on one H200 (session 34; why was not traced)."""

import gc

import pytest
import torch

from pagelm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _run(model_dir, pdl: bool, monkeypatch, speculative_config=None):
    from pagelm.backends.kernels import common

    monkeypatch.setattr(common, "PDL_DISABLED", not pdl)
    common.pdl_supported.cache_clear()
    try:
        assert common.pdl_supported(torch.device("cuda")) == (pdl and torch.cuda.get_device_capability()[0] >= 9)
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", attention_backend="triton",
                  num_kv_blocks=2048, max_num_seqs=16, max_model_len=1024,
                  speculative_config=speculative_config)
        lengths = [3, 50, 17, 120, 9, 300, 33, 64, 1, 200, 77, 5, 140, 260, 12, 90, 31, 400, 7, 150]
        prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 1 for j in range(n)]} for i, n in enumerate(lengths)]
        params = [SamplingParams(temperature=0, max_tokens=40 + 23 * (i % 9), ignore_eos=True) for i in range(len(lengths))]
        out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.core.runner.cuda_graphs.num_replays > 0
        if speculative_config is not None:
            stats = llm.engine.core.scheduler.spec_decoding_stats
            out.append((stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens))
            assert stats.num_accepted_tokens > 0
        del llm
        return out
    finally:
        common.pdl_supported.cache_clear()
        gc.collect()
        torch.cuda.empty_cache()


def test_pdl_on_and_off_give_the_same_tokens(make_model, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    model_dir = make_model("pdl_qwen3", "qwen3", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048)
    with_pdl = _run(model_dir, True, monkeypatch)
    without = _run(model_dir, False, monkeypatch)
    assert with_pdl == without


def test_pdl_on_and_off_draft_the_same_with_eagle(make_model, monkeypatch, tmp_path):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    from pagelm.plugins.spec_decode import eagle as eagle_proposer
    from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head

    monkeypatch.setattr(eagle_proposer, "DRAFT_GRAPHS_ENABLED", True)
    model_dir = make_model("pdl_qwen3", "qwen3", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048)
    # Trained briefly so that drafts are accepted and the verification graphs replay.
    train_eagle_head(model_dir, tmp_path / "head", EagleTrainConfig(steps=60, num_prompts=32, gen_len=48), log=lambda *_: None)
    eagle = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head"), "adaptive": False}
    with_pdl = _run(model_dir, True, monkeypatch, eagle)
    without = _run(model_dir, False, monkeypatch, eagle)
    assert with_pdl == without
