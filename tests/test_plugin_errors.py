"""Every contract violation names the plugin and what is wrong; a broken plugin can be left
out by name; a missing model or an unknown proposer fails at once with a clear message."""

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from huggingface_hub import constants

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.plugin_manager import PluginLoadError, PluginManager, get_plugin_manager
from pagelm.registry import PluginError
from pagelm.sched.policy import SchedulingPolicy
from pagelm.plugins.spec_decode import DraftProposer
from pagelm.spec_decode import DeviceDrafts
from test_plugins import install_fake_distribution, plugin_declaring


class NoRank(SchedulingPolicy):
    name = "no_rank"  # forgot rank()


class OutOfVocabulary(DraftProposer):
    name = "out_of_vocabulary"

    def propose(self, batch):
        return [[10**6] * int(m) for m in batch.max_num_drafts]


class ReturnsNone(DraftProposer):
    name = "returns_none"

    def propose(self, batch):
        return None


class NegativeIds(DraftProposer):
    name = "negative_ids"

    def propose(self, batch):
        return [[-1] * int(m) for m in batch.max_num_drafts]


class OneIntPerRequest(DraftProposer):
    name = "one_int_per_request"

    def propose(self, batch):
        return [5] * batch.num_reqs


class FloatIds(DraftProposer):
    name = "float_ids"

    def propose(self, batch):
        return [[5.0] * int(m) for m in batch.max_num_drafts]


class DeviceOutOfVocabulary(DraftProposer):
    name = "device_out_of_vocabulary"

    def propose(self, batch):
        return DeviceDrafts(torch.full((batch.num_reqs, 2), 10**6), batch.max_num_drafts)


class DeviceWrongRows(DraftProposer):
    name = "device_wrong_rows"

    def propose(self, batch):
        return DeviceDrafts(torch.zeros((batch.num_reqs + 1, 2), dtype=torch.long), np.zeros(batch.num_reqs + 1, dtype=np.int64))


class DeviceFloatIds(DraftProposer):
    name = "device_float_ids"

    def propose(self, batch):
        return DeviceDrafts(torch.zeros((batch.num_reqs, 2)), batch.max_num_drafts)


class Plugins:
    @hookimpl
    def pagelm_register_proposers(self, registry):
        for proposer in (
            OutOfVocabulary, ReturnsNone, NegativeIds, OneIntPerRequest, FloatIds, DeviceOutOfVocabulary, DeviceWrongRows,
            DeviceFloatIds,
        ):
            registry.add(proposer.name, proposer)


@pytest.fixture
def registered():
    def register(plugin, name):
        get_plugin_manager().register(plugin, name=name)
        names.append(name)

    names = []
    yield register
    for name in names:
        get_plugin_manager().unregister(name)


def test_a_policy_missing_an_abstract_method_is_named_with_its_plugin():
    class Plugin:
        @hookimpl
        def pagelm_register_scheduling_policies(self, registry):
            registry.add(NoRank.name, NoRank)

    pm = PluginManager()
    pm.register(Plugin(), name="my-policies")
    with pytest.raises(PluginError, match=r"plugin 'my-policies' .*registers scheduling policy 'no_rank' .*does not implement rank"):
        pm.collect("scheduling policy")


def test_a_registration_hook_that_raises_is_named():
    class Plugin:
        @hookimpl
        def pagelm_register_attention_backends(self, registry):
            raise KeyError("oops")

    pm = PluginManager()
    pm.register(Plugin(), name="broken-backends")
    with pytest.raises(PluginError, match=r"plugin 'broken-backends' .*failed in pagelm_register_attention_backends: KeyError"):
        pm.collect("attention backend")


@pytest.mark.parametrize("method, problem", [
    ("out_of_vocabulary", r"draft ids outside the vocabulary \[0, \d+\)"),
    ("returns_none", r"must return one list of draft ids per request"),
    ("negative_ids", r"draft ids outside the vocabulary \[0, \d+\): \[-1, -1\]"),
    ("one_int_per_request", r"returned a draft that is not a list of token ids: \[5\]"),
    ("float_ids", r"draft ids that are not integers: \[5\.0, 5\.0\]"),
    # Drafts left on the device: their ids are checked when they reach the host, with the next
    # step's verification (clamped into the vocabulary on the device before it).
    ("device_out_of_vocabulary", r"draft ids outside the vocabulary \[0, \d+\): \[1000000, 1000000\]"),
    ("device_wrong_rows", r"returned DeviceDrafts whose token_ids must be a \[1, width\] tensor, got torch.Size\(\[2, 2\]\)"),
    ("device_float_ids", r"returned DeviceDrafts whose token_ids must hold integers, got torch.float32"),
])
def test_a_proposer_returning_bad_drafts_is_named(llama_dir, registered, method, problem):
    registered(Plugins(), "test-bad-proposers")
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", speculative_config={"method": method, "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(PluginError, match=rf"proposer '{method}' \(test_plugin_errors\..*\): .*{problem}"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)


def test_an_incompatible_plugin_says_how_to_leave_it_out(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_old", plugin_declaring("1.0"))
    with pytest.raises(PluginLoadError, match=r"set PAGELM_DISABLE_PLUGINS=pagelm_old \(or list the plugins to load in PAGELM_PLUGINS"):
        PluginManager().load_entry_points()
    monkeypatch.setenv("PAGELM_DISABLE_PLUGINS", "pagelm_old")
    pm = PluginManager()
    pm.load_entry_points()
    assert pm.not_loaded["pagelm_old"][1] == "disabled (PAGELM_DISABLE_PLUGINS)"


def test_a_builtin_plugin_can_be_disabled_by_name(monkeypatch):
    monkeypatch.setenv("PAGELM_DISABLE_PLUGINS", "sjf, simulate")
    pm = PluginManager()
    assert "sjf" not in pm.collect("scheduling policy") and "fcfs" in pm.collect("scheduling policy")
    assert "simulate" not in pm.collect("cli command")
    with pytest.raises(ValueError, match=r"unknown scheduling policy 'sjf'; registered: fcfs, priority"):
        pm.collect("scheduling policy").get("sjf")


def test_an_unknown_proposer_method_is_the_error(llama_dir):
    with pytest.raises(ValueError, match=r"speculative_config.method='nope' is not a registered proposer; registered: eagle, medusa, ngram"):
        LLM(str(llama_dir), speculative_config={"method": "nope"})


@pytest.mark.parametrize("model", ["missing-dir", "/no/such/model", "./relative/missing", "./missing-dir", "../missing-dir"])
def test_a_model_path_that_does_not_exist_fails_at_once(model):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"model {model!r} is not a local model directory"):
        LLM(model)
    assert time.monotonic() - start < 2.0


def test_a_hub_id_not_in_the_cache_fails_at_once_when_offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"model 'no-such-org/no-such-model': HF_HUB_OFFLINE is set and it is not in the local"):
        LLM("no-such-org/no-such-model")
    assert time.monotonic() - start < 2.0


DISABLED_SJF = """
    import json, sys
    from pagelm import LLM, SamplingParams

    model = sys.argv[1]
    try:
        LLM(model, dtype="float32", device="cpu", scheduling_policy="sjf")
        error = None
    except ValueError as exc:
        error = str(exc)
    llm = LLM(model, dtype="float32", device="cpu")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"error": error, "tokens": list(out[0].outputs[0].token_ids)}))
"""


def test_llm_runs_with_a_builtin_policy_disabled(llama_dir):
    # Plugins load once per process: a fresh one sees PAGELM_DISABLE_PLUGINS from the start.
    env = {**os.environ, "PAGELM_DISABLE_PLUGINS": "sjf"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DISABLED_SJF), str(llama_dir)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["error"] == "unknown scheduling policy 'sjf'; registered: fcfs, priority"
    llm = LLM(str(llama_dir), dtype="float32", device="cpu")
    want = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert got["tokens"] == list(want[0].outputs[0].token_ids)


NO_STRUCTURED_OUTPUT = """
    import json, sys
    from pagelm import LLM, GuidedDecodingParams, SamplingParams

    llm = LLM(sys.argv[1], dtype="float32", device="cpu")
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], plain, use_tqdm=False)
    try:
        guided = SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(regex="[0-9]+"))
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], guided, use_tqdm=False)
        error = None
    except ValueError as exc:
        error = str(exc)
    print(json.dumps({"error": error, "tokens": list(out[0].outputs[0].token_ids), "manager": llm.engine.core.structured_output}))
"""


def test_without_a_structured_output_plugin_the_engine_runs_and_refuses_guided_requests(llama_dir):
    env = {**os.environ, "PAGELM_DISABLE_PLUGINS": "xgrammar"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(NO_STRUCTURED_OUTPUT), str(llama_dir)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["manager"] is None
    assert got["error"] == (
        "guided_decoding needs a structured-output backend plugin, and none is registered "
        "(structured_output_backend='xgrammar'; is it in PAGELM_DISABLE_PLUGINS?)"
    )
    llm = LLM(str(llama_dir), dtype="float32", device="cpu")
    want = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert got["tokens"] == list(want[0].outputs[0].token_ids)
