"""Every contract violation names the plugin and what is wrong; a broken plugin can be left
out by name; a missing model or an unknown proposer fails at once with a clear message."""

import time

import pytest

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.plugin_manager import PluginLoadError, PluginManager, get_plugin_manager
from pagelm.registry import PluginError
from pagelm.sched.policy import SchedulingPolicy
from pagelm.spec_decode import Proposer
from test_plugins import install_fake_distribution, plugin_declaring


class NoRank(SchedulingPolicy):
    name = "no_rank"  # forgot rank()


class OutOfVocabulary(Proposer):
    name = "out_of_vocabulary"

    def propose(self, batch):
        return [[10**6] * int(m) for m in batch.max_num_drafts]


class ReturnsNone(Proposer):
    name = "returns_none"

    def propose(self, batch):
        return None


class Plugins:
    @hookimpl
    def pagelm_register_proposers(self, registry):
        registry.add(OutOfVocabulary.name, OutOfVocabulary)
        registry.add(ReturnsNone.name, ReturnsNone)


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
        pm.scheduling_policies()


def test_a_registration_hook_that_raises_is_named():
    class Plugin:
        @hookimpl
        def pagelm_register_attention_backends(self, registry):
            raise KeyError("oops")

    pm = PluginManager()
    pm.register(Plugin(), name="broken-backends")
    with pytest.raises(PluginError, match=r"plugin 'broken-backends' .*failed in pagelm_register_attention_backends: KeyError"):
        pm.attention_backends()


@pytest.mark.parametrize("method, problem", [
    ("out_of_vocabulary", r"draft ids outside the vocabulary \[0, \d+\)"),
    ("returns_none", r"must return one list of draft ids per request"),
])
def test_a_proposer_returning_bad_drafts_is_named(llama_dir, registered, method, problem):
    registered(Plugins(), "test-bad-proposers")
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", speculative_config={"method": method, "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(PluginError, match=rf"proposer '{method}' \(test_plugin_errors\..*\): .*{problem}"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)


def test_an_incompatible_plugin_says_how_to_leave_it_out(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_old", plugin_declaring("1.0"))
    with pytest.raises(PluginLoadError, match=r"PAGELM_DISABLE_PLUGINS=pagelm_old"):
        PluginManager().load_entry_points()
    monkeypatch.setenv("PAGELM_DISABLE_PLUGINS", "pagelm_old")
    pm = PluginManager()
    pm.load_entry_points()
    assert pm.not_loaded["pagelm_old"][1] == "disabled (PAGELM_DISABLE_PLUGINS)"


def test_a_builtin_plugin_can_be_disabled_by_name(monkeypatch):
    monkeypatch.setenv("PAGELM_DISABLE_PLUGINS", "sjf, simulate")
    pm = PluginManager()
    assert "sjf" not in pm.scheduling_policies() and "fcfs" in pm.scheduling_policies()
    assert "simulate" not in pm.cli_commands()
    with pytest.raises(ValueError, match=r"unknown scheduling policy 'sjf'; registered: fcfs, priority"):
        pm.scheduling_policies().get("sjf")


def test_an_unknown_proposer_method_is_the_error(llama_dir):
    with pytest.raises(ValueError, match=r"speculative_config.method='nope' is not a registered proposer; registered: eagle, ngram"):
        LLM(str(llama_dir), speculative_config={"method": "nope"})


@pytest.mark.parametrize("model", ["missing-dir", "/no/such/model", "./relative/missing"])
def test_a_model_path_that_does_not_exist_fails_at_once(model):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"model {model!r} is not a local model directory"):
        LLM(model)
    assert time.monotonic() - start < 2.0
