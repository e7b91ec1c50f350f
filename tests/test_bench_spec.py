"""`pagelm bench latency` for speculative decoding: the repeat and code workloads, the
acceptance counts beside tokens/s, and ``--compare spec-off`` end to end on a tiny model."""

import json

import pytest

from pagelm.plugins.bench.latency import resolve_lengths, workload_prompts
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.bench.workload import TokenWorkload
from pagelm.cli import build_parser, main
from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
# Drafting every step: with every draft rejected, adaptive drafting would soon start new requests
# backed off, and a 10-token request might then draft nothing at all.
NGRAM_EVERY_STEP = NGRAM[:-1] + ', "adaptive": false}'
# A small repeat workload: 8-token blocks, 3 copies, 10 output tokens, one timed run.
SMALL_REPEAT = ["--workload", "repeat", "--repeat-block-len", "8", "--repeat-count", "3", "--output-len", "10",
                "--warmup", "0", "--iters", "1"]


def latency_args(*argv):
    return build_parser().parse_args(["bench", "latency", "--model", "m", *argv])


# ---- workloads ------------------------------------------------------------------------------


def test_repeat_workload_repeats_a_block_of_its_own_per_prompt():
    w = TokenWorkload.repeated(3, block_len=5, repeats=4, output_len=7, vocab_size=50, seed=1)
    for p in w.prompt_token_ids:
        assert len(p) == 20 and p == p[:5] * 4
        assert max(p) < 50
    assert len({tuple(p[:5]) for p in w.prompt_token_ids}) == 3
    assert w.output_lens == [7, 7, 7]


def test_repeat_workload_defaults_to_a_256_token_block_four_times_and_256_outputs():
    args = latency_args("--workload", "repeat")
    resolve_lengths(args)
    assert (args.input_len, args.output_len) == (1024, 256)
    args = latency_args()
    resolve_lengths(args)
    assert (args.input_len, args.output_len) == (128, 512)


def test_repeat_workload_refuses_an_input_len_that_is_not_block_times_count():
    args = latency_args("--workload", "repeat", "--input-len", "1000")
    with pytest.raises(SystemExit, match="--repeat-block-len x --repeat-count = 1024"):
        resolve_lengths(args)


def test_workload_prompts_are_the_same_for_every_engine_and_fresh_each_run():
    args = latency_args(*SMALL_REPEAT)
    resolve_lengths(args)
    first = workload_prompts(args, 2, 0, vocab_size=512)
    assert first == workload_prompts(args, 2, 0, vocab_size=512)
    assert first != workload_prompts(args, 2, 1, vocab_size=512)
    assert [len(p) for p in first] == [24, 24]


def test_code_workload_is_stdlib_source_cut_to_input_len(llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    w = TokenWorkload.code(tokenizer, 3, input_len=40, output_len=5, seed=2)
    assert [len(p) for p in w.prompt_token_ids] == [40, 40, 40]
    assert w.prompt_token_ids == TokenWorkload.code(tokenizer, 3, 40, 5, seed=2).prompt_token_ids
    text = tokenizer.decode(w.prompt_token_ids[0])
    assert text.isascii() and len(text) > 40


def test_demo_names_the_built_in_demo_model(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGELM_CACHE_DIR", str(tmp_path))
    (tmp_path / "demo-llama-v1").mkdir()
    assert resolve_bench_model("demo", {"seed": 1}) == (str(tmp_path / "demo-llama-v1"), {"seed": 1})


# ---- the command, end to end ----------------------------------------------------------------


def test_latency_reports_ngram_acceptance_and_speedup_over_spec_off(llama_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main([
        "bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1,2", *SMALL_REPEAT,
        "--speculative-config", NGRAM, "--compare", "spec-off", "--json", str(out),
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["workload"] == {"name": "repeat", "input_len": 24, "output_len": 10, "seed": 0,
                                  "block_len": 8, "repeats": 3}
    assert report["speculative_config"]["method"] == "ngram"
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        spec = r["spec"]
        assert spec["num_drafts"] > 0
        assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
        assert spec["num_draft_tokens"] <= 3 * spec["num_drafts"]
        assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
        assert 1 <= spec["mean_acceptance_length"] <= 4
        assert r["spec_off"]["decode_tokens_per_s"] == pytest.approx(r["batch_size"] / r["spec_off"]["tpot_s"])
        assert r["speedup"] == pytest.approx(r["decode_tokens_per_s"] / r["spec_off"]["decode_tokens_per_s"])
    printed = capsys.readouterr().out
    assert "without speculative decoding:" in printed
    assert "acceptance length" in printed and "speedup" in printed


def test_spec_reject_all_keeps_the_drafts_but_accepts_none(llama_dir, tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(llama_dir), "--batch-sizes", "2", *SMALL_REPEAT,
                 "--speculative-config", NGRAM, "--spec-reject-all", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert report["spec_reject_all"] is True
    assert r["spec"]["num_draft_tokens"] > 0 and r["spec"]["num_accepted_tokens"] == 0
    assert r["spec"]["mean_acceptance_length"] == 1.0


def test_latency_without_speculation_reports_no_acceptance(llama_dir, tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1", *SMALL_REPEAT,
                 "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert (r["spec"], r["spec_off"], r["speedup"]) == (None, None, None)


def test_latency_measures_an_eagle_head(llama_dir, tmp_path):
    head = tmp_path / "head"
    train_eagle_head(llama_dir, head, EagleTrainConfig(steps=0), log=lambda *_: None)
    eagle = json.dumps({"method": "eagle", "num_speculative_tokens": 2, "model": str(head)})
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1", "--workload", "code",
                 "--input-len", "16", "--output-len", "6", "--warmup", "0", "--iters", "1",
                 "--speculative-config", eagle, "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["spec"]["num_drafts"] > 0 and r["spec"]["num_draft_tokens"] <= 2 * r["spec"]["num_drafts"]


def test_paired_runs_take_turns_in_two_processes_and_report_each_pairs_speedup(llama_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main([
        "bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1,2", *SMALL_REPEAT[:-1], "3",
        "--speculative-config", NGRAM_EVERY_STEP, "--compare", "spec-off", "--paired", "--spec-reject-all",
        "--json", str(out),
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["paired"] is True
    for r in report["results"]:
        assert len(r["paired_speedups"]) == 3 and all(s > 0 for s in r["paired_speedups"])
        assert r["speedup"] == pytest.approx(sorted(r["paired_speedups"])[1])
        # The speculative engine drafted, and its process got --spec-reject-all: at batch 2 the
        # target takes none of the shifted drafts (greedy, so the same every run; at batch 1
        # it happens to pick a neighbour twice).
        assert r["spec"]["num_draft_tokens"] > r["spec"]["num_accepted_tokens"]
        if r["batch_size"] == 2:
            assert r["spec"]["num_accepted_tokens"] == 0
        assert r["spec_off"]["decode_tokens_per_s"] == pytest.approx(r["batch_size"] / r["spec_off"]["tpot_s"])
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch_size"] / r["tpot_s"])
    printed = capsys.readouterr().out
    assert "paired runs" in printed and "(median of 3 pairs)" in printed


def test_paired_needs_the_spec_off_comparison(llama_dir):
    with pytest.raises(SystemExit, match="--paired .* with --compare spec-off"):
        main(["bench", "latency", "--model", str(llama_dir), *SMALL_REPEAT, "--speculative-config", NGRAM, "--paired"])


def test_spec_off_comparison_needs_a_speculative_config(llama_dir):
    with pytest.raises(SystemExit, match="give --speculative-config"):
        main(["bench", "latency", "--model", str(llama_dir), *SMALL_REPEAT, "--compare", "spec-off"])


def test_a_workload_longer_than_max_model_len_is_refused_before_running(llama_dir):
    with pytest.raises(SystemExit, match="exceed max_model_len=20"):
        main(["bench", "latency", "--model", str(llama_dir), *SMALL_REPEAT, "--max-model-len", "20"])


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_random_draft_head_measures_a_speculative_step_that_always_drafts_k(llama_dir, tmp_path, monkeypatch, method):
    """``--random-draft-head``: a head of the target's shapes with random weights; with adaptive
    drafting off every decode step after the first verifies k drafts (what a speculative step costs)."""
    monkeypatch.setenv("PAGELM_CACHE_DIR", str(tmp_path / "cache"))
    spec = json.dumps({"method": method, "num_speculative_tokens": 2, "adaptive": False})
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(llama_dir), "--batch-sizes", "1", "--input-len", "16",
                 "--output-len", "8", "--warmup", "0", "--iters", "1", "--speculative-config", spec,
                 "--random-draft-head", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    head = tmp_path / "cache" / "presets" / "random-heads" / f"{llama_dir.name}-{method}"
    assert report["speculative_config"]["model"] == str(head) and (head / "model.safetensors").is_file()
    (r,) = report["results"]
    # k drafts every verification (one fewer at most where max_tokens leaves room for one).
    assert r["spec"]["num_drafts"] >= 3 and r["spec"]["num_draft_tokens"] >= 2 * r["spec"]["num_drafts"] - 1


def test_random_draft_head_needs_a_head_method_and_no_model(llama_dir):
    for spec in (NGRAM, json.dumps({"method": "eagle", "num_speculative_tokens": 2, "model": "x"})):
        with pytest.raises(SystemExit, match="random-draft-head"):
            main(["bench", "latency", "--model", str(llama_dir), "--speculative-config", spec, "--random-draft-head"])
