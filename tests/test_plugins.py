"""Plugin manager: entry-point discovery, allow-list, autoload switch, clear errors."""

import sys
import textwrap

import pytest

from pagelm import hookimpl
from pagelm.plugin_manager import PluginLoadError, PluginManager
from pagelm.registry import UnknownNameError


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

    class LIFO(FCFSPolicy):
        name = "lifo_from_dist"

    @hookimpl
    def pagelm_register_scheduling_policies(registry):
        registry.add(LIFO.name, LIFO)
"""


def test_builtin_plugins_are_discovered_through_entry_points():
    pm = PluginManager()
    assert "torch" in pm.attention_backends()
    assert "fcfs" in pm.scheduling_policies()
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"} <= set(
        pm.models().names()
    )
    assert {"torch_attention", "fcfs", "models"} <= set(pm.loaded)
    assert all(pm.loaded[n].builtin for n in ("torch_attention", "fcfs", "models"))


def test_third_party_distribution_is_discovered(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", GOOD_PLUGIN)
    pm = PluginManager()
    assert "lifo_from_dist" in pm.scheduling_policies()
    info = pm.loaded["pagelm_lifo"]
    assert (info.distribution, info.version) == ("pagelm_lifo", "0.1")


def test_allow_list_skips_unlisted_third_party_plugins(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", GOOD_PLUGIN)
    monkeypatch.setenv("PAGELM_PLUGINS", "something_else")
    pm = PluginManager()
    assert "lifo_from_dist" not in pm.scheduling_policies()
    assert "fcfs" in pm.scheduling_policies()  # built-ins always load


def test_disable_autoload_skips_third_party_plugins(tmp_path, monkeypatch):
    install_fake_distribution(tmp_path, monkeypatch, "pagelm_lifo", GOOD_PLUGIN)
    monkeypatch.setenv("PAGELM_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = PluginManager()
    assert "lifo_from_dist" not in pm.scheduling_policies()
    assert "torch" in pm.attention_backends()


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
    assert pm.scheduling_policies().get("mine") is Mine


def test_unknown_name_lists_registered_ones():
    pm = PluginManager()
    with pytest.raises(UnknownNameError, match=r"unknown attention backend 'nope'; registered: .*torch"):
        pm.attention_backends().get("nope")


def test_loading_is_idempotent():
    pm = PluginManager()
    pm.load_entry_points()
    before = dict(pm.loaded)
    pm.load_entry_points()
    assert pm.loaded == before
    assert len(pm.scheduling_policies()) == len(pm.scheduling_policies())
