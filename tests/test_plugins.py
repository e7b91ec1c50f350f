"""Plugin manager: entry-point discovery, allow-list, autoload switch, clear errors, the
plugin API version check, and `pagelm plugins`."""

import json
import re
import sys
import textwrap
import warnings

import pytest

from pagelm import hookimpl
from pagelm.cli import main as cli_main
from pagelm.plugin_api import PLUGIN_API_VERSION, api_incompatibility
from pagelm.plugin_manager import PluginLoadError, PluginManager
from pagelm.registry import PluginError, UnknownNameError


def install_fake_distribution(tmp_path, monkeypatch, name, module_source, entry_name=None):
    """A real distribution on sys.path (a .dist-info folder with entry_points.txt), found by
    importlib.metadata exactly like a pip-installed package."""
    entry_name = entry_name or name
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(module_source))
    info = tmp_path / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[pagelm.plugins]\n{entry_name} = {name}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


GOOD_PLUGIN = """
    from pagelm import hookimpl
    from pagelm.plugins.policies.fcfs import FCFSPolicy

    PAGELM_PLUGIN_API = "2.0"

    class LIFO(FCFSPolicy):
        name = "lifo_from_dist"

    @hookimpl
    def pagelm_register_scheduling_policies(registry):
        registry.add(LIFO.name, LIFO)
"""


def test_builtin_plugins_are_discovered_through_entry_points():
    pm = PluginManager()
    assert "torch" in pm.collect("attention backend")
    assert "fcfs" in pm.collect("scheduling policy")
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"} <= set(
        pm.collect("model architecture").names()
    )
    assert {"torch_attention", "fcfs", "models"} <= set(pm.loaded)
    assert all(pm.loaded[n].builtin for n in ("torch_attention", "fcfs", "models"))


@pytest.mark.parametrize("kind, builtin", [
    ("attention backend", "torch"), ("scheduling policy", "priority"), ("structured output backend", "xgrammar"),
    ("speculative proposer", "ngram"), ("model loader", "safetensors"), ("executor", "uni"),
    ("data parallel", "replicas"), ("stat logger", "prometheus"), ("kv offload", "cpu"),
    ("cli command", "serve"), ("kernel", "rms_norm"), ("router", "round_robin"), ("tool call parser", "hermes"),
])
def test_collect_answers_the_core_kinds_and_those_plugins_add(kind, builtin):
    # Since plugin API 2.15 there is no per-kind accessor: ``collect`` is the one way in.
    pm = PluginManager()
    assert kind in pm.kinds()
    assert builtin in pm.collect(kind)


def test_third_party_distribution_is_discovered(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", GOOD_PLUGIN)
    pm = PluginManager()
    assert "lifo_from_dist" in pm.collect("scheduling policy")
    info = pm.loaded["pagelm_lifo"]
    assert (info.distribution, info.version) == ("pagelm_lifo", "0.1")


def test_allow_list_skips_unlisted_third_party_plugins(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", GOOD_PLUGIN)
    monkeypatch.setenv("PAGELM_PLUGINS", "something_else")
    pm = PluginManager()
    assert "lifo_from_dist" not in pm.collect("scheduling policy")
    assert "fcfs" in pm.collect("scheduling policy")  # built-ins always load


def test_disable_autoload_skips_third_party_plugins(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", GOOD_PLUGIN)
    monkeypatch.setenv("PAGELM_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = PluginManager()
    assert "lifo_from_dist" not in pm.collect("scheduling policy")
    assert "torch" in pm.collect("attention backend")


def test_plugin_that_fails_to_import_is_named(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_broken", "import not_a_real_module_xyz\n")
    pm = PluginManager()
    with pytest.raises(PluginLoadError, match=r"pagelm_broken.*failed to import.*not_a_real_module_xyz"):
        pm.load_entry_points()


def test_misspelt_hook_fails_loudly():
    class Typo:
        @hookimpl
        def pagelm_register_attention_backend(self, registry):  # missing the final "s"
            pass

    pm = PluginManager()
    with pytest.raises(PluginLoadError, match="pagelm_register_attention_backend"):
        pm.register(Typo(), name="typo")


def test_in_process_plugin_is_registered_and_listed():
    from pagelm.plugins.policies.fcfs import FCFSPolicy

    class Mine(FCFSPolicy):
        name = "mine"

    class Plugin:
        @hookimpl
        def pagelm_register_scheduling_policies(self, registry):
            registry.add("mine", Mine)

    pm = PluginManager()
    pm.register(Plugin(), name="mine-plugin")
    assert pm.collect("scheduling policy").get("mine") is Mine


def test_unknown_name_lists_registered_ones():
    pm = PluginManager()
    with pytest.raises(UnknownNameError, match=r"unknown attention backend 'nope'; registered: .*torch"):
        pm.collect("attention backend").get("nope")


def test_loading_is_idempotent():
    pm = PluginManager()
    pm.load_entry_points()
    before = dict(pm.loaded)
    pm.load_entry_points()
    assert pm.loaded == before
    assert len(pm.collect("scheduling policy")) == len(pm.collect("scheduling policy"))


# ---- plugin API version -----------------------------------------------------------------------


def plugin_declaring(version):
    return GOOD_PLUGIN.replace('PAGELM_PLUGIN_API = "2.0"', f"PAGELM_PLUGIN_API = {version!r}")


def test_declared_api_version_is_recorded(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", GOOD_PLUGIN)
    pm = PluginManager()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a declaring plugin loads without a warning
        pm.load_entry_points()
    assert pm.loaded["pagelm_lifo"].api_version == "2.0"
    assert pm.loaded["fcfs"].api_version == PLUGIN_API_VERSION == "2.25"


def test_plugin_for_another_major_api_is_rejected_naming_both_versions(tmp_path, monkeypatch):
    # 1.x policies kept the waiting queue on the policy: they cannot run on 2.0.
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", plugin_declaring("1.1"))
    here = re.escape(PLUGIN_API_VERSION)
    with pytest.raises(PluginLoadError, match=rf"'pagelm_lifo'.*incompatible.*plugin API 1\.1.*provides plugin API {here}"):
        PluginManager().load_entry_points()


def test_plugin_needing_a_newer_minor_api_is_rejected(tmp_path, monkeypatch):
    major, minor = PLUGIN_API_VERSION.split(".")
    newer = f"{major}.{int(minor) + 1}"
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", plugin_declaring(newer))
    here, newer = re.escape(PLUGIN_API_VERSION), re.escape(newer)
    with pytest.raises(PluginLoadError, match=rf"declares plugin API {newer}, newer than this pagelm's plugin API {here}"):
        PluginManager().load_entry_points()


def test_malformed_api_version_is_rejected(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", plugin_declaring("one"))
    with pytest.raises(PluginLoadError, match=r"must look like 'MAJOR.MINOR'"):
        PluginManager().load_entry_points()


@pytest.mark.parametrize("declared, provided, ok", [
    ("1.0", "1.0", True), ("1.0", "1.3", True), ("1", "1.3", True), (1, "1.0", True),
    ("1.4", "1.3", False), ("2.0", "1.3", False), ("0.9", "1.3", False),
])
def test_api_compatibility_rule(declared, provided, ok):
    assert (api_incompatibility(declared, provided) is None) == ok


def test_undeclared_api_version_loads_with_a_warning(tmp_path, monkeypatch):
    source = GOOD_PLUGIN.replace('PAGELM_PLUGIN_API = "2.0"', "")
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", source)
    pm = PluginManager()
    with pytest.warns(UserWarning, match=r"'pagelm_lifo'.*does not declare PAGELM_PLUGIN_API"):
        pm.load_entry_points()
    assert "lifo_from_dist" in pm.collect("scheduling policy")
    assert pm.loaded["pagelm_lifo"].api_version is None


def test_registry_rejects_an_entry_of_the_wrong_kind():
    class NotAPolicy:
        pass

    class Plugin:
        @hookimpl
        def pagelm_register_scheduling_policies(self, registry):
            registry.add("bogus", NotAPolicy)

    pm = PluginManager()
    pm.register(Plugin(), name="bogus-plugin")
    with pytest.raises(PluginError, match=r"plugin 'bogus-plugin' .*registers scheduling policy 'bogus', which must be a subclass of pagelm.sched.policy.SchedulingPolicy"):
        pm.collect("scheduling policy")


def test_non_strict_loading_records_broken_plugins(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", plugin_declaring("3.0"))
    pm = PluginManager()
    pm.load_entry_points(strict=False)
    info, why = pm.not_loaded["pagelm_lifo"]
    assert why.startswith("error:") and "plugin API 3.0" in why
    assert "fcfs" in pm.collect("scheduling policy")


# ---- pagelm plugins ---------------------------------------------------------------------------


def plugins_json(capsys):
    assert cli_main(["plugins", "--json"]) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)}


def test_cli_lists_builtin_plugins_with_kind_package_and_version(capsys):
    rows = plugins_json(capsys)
    for name in ("fcfs", "priority", "sjf"):
        assert rows[name]["kind"] == "scheduling policy"
        assert rows[name]["registers"] == {"scheduling policy": [name]}
    assert rows["torch_attention"]["registers"] == {"attention backend": ["torch"]}
    assert "LlamaForCausalLM" in rows["models"]["registers"]["model architecture"]
    import pagelm

    mine = ("fcfs", "priority", "sjf", "torch_attention", "models")
    assert {(rows[n]["package"], rows[n]["version"], rows[n]["plugin_api"]) for n in mine} == {("pagelm", pagelm.__version__, "2.25")}


def test_cli_lists_third_party_broken_and_disabled_plugins(tmp_path, monkeypatch, capsys):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", GOOD_PLUGIN)
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_future", plugin_declaring("9.0"))
    rows = plugins_json(capsys)
    assert rows["pagelm_lifo"]["registers"] == {"scheduling policy": ["lifo_from_dist"]}
    assert (rows["pagelm_lifo"]["package"], rows["pagelm_lifo"]["version"]) == ("pagelm_lifo", "0.1")
    assert "plugin API 9.0" in rows["pagelm_future"]["status"]
    monkeypatch.setenv("PAGELM_DISABLE_PLUGIN_AUTOLOAD", "1")
    rows = plugins_json(capsys)
    assert rows["pagelm_lifo"]["status"] == "disabled (PAGELM_DISABLE_PLUGIN_AUTOLOAD)"


def test_cli_table_names_the_columns(capsys):
    assert cli_main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert out.split()[:7] == ["name", "kind", "registers", "package", "version", "api", "status"]
    assert f"pagelm plugin API {PLUGIN_API_VERSION}" in out


def _pagelm_in_fresh_process(tmp_path, *argv):
    """``pagelm ARGV`` in a new interpreter that finds the fake distributions in ``tmp_path``
    (this process's plugin manager has long loaded; a broken plugin shows first in a fresh one)."""
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    code = "import sys; from pagelm.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120)


def test_cli_plugins_lists_a_broken_plugin_in_a_fresh_process_and_other_commands_name_it(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_broken", "import not_a_real_module_xyz\n")
    listing = _pagelm_in_fresh_process(tmp_path, "plugins", "--json")
    assert listing.returncode == 0, listing.stderr
    rows = {row["name"]: row for row in json.loads(listing.stdout)}
    assert "failed to import" in rows["pagelm_broken"]["status"]
    assert rows["fcfs"]["status"] == "loaded"
    other = _pagelm_in_fresh_process(tmp_path, "generate", "--help")
    assert other.returncode != 0
    assert "pagelm_broken" in other.stderr and "not_a_real_module_xyz" in other.stderr
