"""The core's shape, read from its imports with ``ast`` (TYPE_CHECKING and function-level
imports included): no circle, no module importing from a layer above its own, and no import
of the plugin folders by name (the core finds plugins through the plugin manager).

Layers, lowest first (docs/architecture.md draws them):
1. contracts and plain data; 2. mechanisms (plugin manager, KV cache, scheduler, sampler,
ops, loading); 3. the worker (model runner); 4. the engine (core
loop, core process and client, output processing, stats collection); 5. the APIs (``LLM``, the
``pagelm`` command, the conformance kit and test fixtures).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
PLUGIN_PACKAGES = ("pagelm.plugins", "pagelm.backends", "pagelm.models")

LAYERS = {
    1: [
        "pagelm", "pagelm.config", "pagelm.sampling_params", "pagelm.request", "pagelm.outputs",
        "pagelm.hookspecs", "pagelm.plugin_api", "pagelm.registry", "pagelm.sched.policy",
        "pagelm.sched.request_queue", "pagelm.sched.output", "pagelm.attention",
        "pagelm.spec_decode.proposer", "pagelm.spec_decode.config", "pagelm.spec_decode.stats",
        "pagelm.structured_output", "pagelm.worker.output", "pagelm.engine.core_output",
        "pagelm.sample.metadata", "pagelm.kv_cache.block_hash", "pagelm.model_loader", "pagelm.executor",
        "pagelm.distributed", "pagelm.stat_logger",
        "pagelm.kv_offload", "pagelm.multimodal",
    ],
    2: [
        "pagelm.plugin_manager", "pagelm.kv_cache", "pagelm.sched", "pagelm.sample", "pagelm.kernels",
        "pagelm.spec_decode",
    ],
    3: ["pagelm.worker"],
    4: ["pagelm.engine"],
    5: ["pagelm.llm", "pagelm.cli", "pagelm.plugins.server", "pagelm.testing", "pagelm.demo", "pagelm.plugins.demo.model"],
}


def core_modules() -> dict[str, Path]:
    mods = {}
    for path in CORE.rglob("*.py"):
        parts = list(path.relative_to(CORE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(["pagelm", *parts])] = path
    return mods


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name ``path`` imports (relative imports resolved)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(core module -> core modules it imports, core module -> plugin-folder names it imports)."""
    mods = core_modules()
    graph, plugin_imports = {}, {}
    for name, path in mods.items():
        edges, plugins = set(), set()
        for target in imported_names(name, path):
            if target.startswith(PLUGIN_PACKAGES):
                plugins.add(target)
                continue
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name and not target.startswith(name + "."):
                edges.add(target)
        graph[name], plugin_imports[name] = edges, plugins
    return graph, plugin_imports


def layer_of(module: str) -> int:
    best = None
    for level, prefixes in LAYERS.items():
        for prefix in prefixes:
            matches = module == prefix if prefix == "pagelm" else module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[1]):
                best = (level, len(prefix))
    assert best is not None, f"{module} has no layer: add it to LAYERS (and to docs/architecture.md)"
    return best[0]


def test_no_import_circle_in_the_core():
    graph, _ = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_no_core_module_imports_from_a_higher_layer():
    graph, _ = import_graph()
    upward = sorted(
        f"{m} (layer {layer_of(m)}) -> {t} (layer {layer_of(t)})"
        for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m)
    )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_core_never_imports_a_plugin_folder_by_name():
    _, plugin_imports = import_graph()
    named = sorted(f"{m} -> {t}" for m, targets in plugin_imports.items() for t in targets)
    assert not named, "the core imports plugins by name (use the plugin manager):\n" + "\n".join(named)
