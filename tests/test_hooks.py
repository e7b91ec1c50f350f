"""Every hook in pagelm.hookspecs, and every hook a built-in plugin adds with a plugin kind of
its own, is documented in docs/plugins.md and has a test here named
``test_hook_<hook name>`` (datasette's pattern: adding a hook without docs or a test fails)."""

import ast
import json
import re
import shutil
from pathlib import Path

import pluggy
import pytest
import torch

from pagelm import LLM, SamplingParams, hookimpl, hookspecs
from pagelm.backends.torch import TorchAttentionBackend
from pagelm.models import LlamaForCausalLM
from pagelm.kernels import KERNELS
from pagelm.plugin_manager import PluginManager, get_plugin_manager
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.registry import PluginError, UnknownNameError
from pagelm.sched.request_queue import RankedQueue

ROOT = Path(__file__).resolve().parents[1]
CORE_HOOKS = {name for name in vars(hookspecs) if name.startswith("pagelm_")}
HOOKS = sorted(CORE_HOOKS | {hook for hook, _ in PluginManager().kinds().values()})
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_plugin_hooks_are_documented():
    documented = re.findall(r"^### `(pagelm_\w+)\(", (ROOT / "docs" / "plugins.md").read_text(), re.M)
    assert sorted(documented) == HOOKS, "docs/plugins.md needs one '### `hook(args)`' heading per hookspec"


def test_plugin_hooks_have_tests():
    tested = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_hook_"):
                tested.add(node.name.removeprefix("test_hook_"))
    missing = [h for h in HOOKS if h not in tested]
    assert not missing, f"hooks without a test_hook_<name> test: {missing}"


@pytest.fixture
def plugin():
    """register(obj) registers an in-process plugin for the test, removed afterwards."""
    names = []

    def register(obj):
        name = f"test-hooks-{len(names)}"
        get_plugin_manager().register(obj, name=name)
        names.append(name)
        return obj

    yield register
    for name in names:
        get_plugin_manager().unregister(name)


def generate(model_dir, prompts=1, **kw):
    llm = LLM(str(model_dir), dtype="float32", **kw)
    return llm, llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(prompts)], PARAMS, use_tqdm=False)


# ---- registration hooks ---------------------------------------------------------------------


class CountingBackend(TorchAttentionBackend):
    name = "counting_torch"
    impls = 0

    @classmethod
    def make_impl(cls, spec):
        cls.impls += 1
        return super().make_impl(spec)


def test_hook_pagelm_register_attention_backends(llama_dir, plugin):
    class P:
        @hookimpl
        def pagelm_register_attention_backends(self, registry):
            registry.add(CountingBackend.name, CountingBackend)

    plugin(P())
    _, outs = generate(llama_dir, attention_backend="counting_torch")
    _, want = generate(llama_dir)
    assert CountingBackend.impls > 0  # one per attention layer
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids


class NewestFirst(FCFSPolicy):
    name = "newest_first"

    def rank(self, request):
        return -request.arrival_time

    def make_queue(self):
        return RankedQueue(self.rank)


def test_hook_pagelm_register_scheduling_policies(llama_dir, plugin):
    class P:
        @hookimpl
        def pagelm_register_scheduling_policies(self, registry):
            registry.add(NewestFirst.name, NewestFirst)

    plugin(P())
    llm, outs = generate(llama_dir, prompts=3, max_num_seqs=1, scheduling_policy="newest_first")
    assert type(llm.engine.core.scheduler.policy) is NewestFirst
    firsts = [o.metrics.first_token_time for o in outs]
    assert firsts[2] < firsts[1] < firsts[0]


class RenamedLlama(LlamaForCausalLM):
    built = 0

    def __init__(self, *args, **kwargs):
        type(self).built += 1
        super().__init__(*args, **kwargs)


def test_hook_pagelm_register_models(llama_dir, plugin, tmp_path):
    model_dir = Path(shutil.copytree(llama_dir, tmp_path / "renamed"))
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["PagelmRenamedLlama"]
    (model_dir / "config.json").write_text(json.dumps(config))

    class P:
        @hookimpl
        def pagelm_register_models(self, registry):
            registry.add("PagelmRenamedLlama", RenamedLlama)

    plugin(P())
    _, outs = generate(model_dir)
    _, want = generate(llama_dir)
    assert RenamedLlama.built == 1
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_hook_pagelm_register_model_loaders(llama_dir, plugin, tmp_path):
    """A third-party load_format: the weights as one torch state dict (``model.pt``) beside
    config.json, no safetensors. The engine builds the model through it and generates the
    same tokens as from the safetensors checkpoint."""
    from safetensors.torch import load_file

    from pagelm.model_loader import ModelLoader
    from pagelm.models.loader import _build

    model_dir = tmp_path / "torch-format"
    model_dir.mkdir()
    for f in llama_dir.iterdir():
        if f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, model_dir / f.name)
    weights = {}
    for f in llama_dir.glob("*.safetensors"):
        weights.update(load_file(f))
    torch.save(weights, model_dir / "model.pt")
    loads = []

    class TorchStateDictLoader(ModelLoader):
        @classmethod
        def load(cls, config, hf_config, device, dtype):
            loads.append(config.model)
            model = _build(hf_config, device, dtype)
            model.load_weights(torch.load(Path(config.model) / "model.pt").items())
            return model.eval()

    class P:
        @hookimpl
        def pagelm_register_model_loaders(self, registry):
            registry.add("torch-state-dict", TorchStateDictLoader)

    plugin(P())
    _, outs = generate(model_dir, load_format="torch-state-dict")
    _, want = generate(llama_dir)
    assert loads == [str(model_dir)]
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(UnknownNameError, match="model loader 'no-such-format'.*torch-state-dict"):
        generate(llama_dir, load_format="no-such-format")


def test_hook_pagelm_register_executors(llama_dir, plugin):
    """A third-party executor: the built-in mp one that also logs each message kind it
    delivers. distributed_executor_backend selects it, and the ranks it starts serve."""
    import msgpack

    from pagelm.plugins.executors.mp import MultiprocessingExecutor

    kinds = []

    class LoggingExecutor(MultiprocessingExecutor):
        name = "logging-mp"

        def send(self, message: bytes) -> None:
            kinds.append(msgpack.unpackb(message, strict_map_key=False)[0])
            super().send(message)

    class P:
        @hookimpl
        def pagelm_register_executors(self, registry):
            registry.add("logging-mp", LoggingExecutor)

    plugin(P())
    llm, outs = generate(llama_dir, tensor_parallel_size=2, distributed_executor_backend="logging-mp")
    llm.shutdown()
    _, want = generate(llama_dir)
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert kinds[:2] == ["size_kv", "kv_cache"] and kinds.count("step") >= PARAMS.max_tokens


class CallLines:
    """A third-party tool-call format: one ``CALL <name> <arguments JSON>`` line per call."""

    @staticmethod
    def parser_class():
        from pagelm.plugins.tool_parsers.parser import StreamDelta, ToolCallDelta, ToolParser, make_tool_call_id

        class CallLinesParser(ToolParser):
            name = "call_lines"

            def __init__(self, tokenizer, tools):
                super().__init__(tokenizer, tools)
                self.lines_sent = self.num_calls = 0

            def extract_tool_calls_streaming(self, previous_text, delta_text, finished):
                lines = (previous_text + delta_text).split("\n")
                complete = lines if finished else lines[:-1]  # a line is whole once its newline came
                out = StreamDelta()
                for i in range(self.lines_sent, len(complete)):
                    if complete[i].startswith("CALL "):
                        name, _, arguments = complete[i][5:].partition(" ")
                        out.tool_calls.append(ToolCallDelta(self.num_calls, make_tool_call_id(), name, arguments))
                        self.num_calls += 1
                    else:
                        out.content += complete[i] + ("\n" if i < len(lines) - 1 else "")
                self.lines_sent = len(complete)
                return out

        return CallLinesParser


class Greeter:
    """The contract of a plugin kind a test plugin adds (``test_hook_pagelm_add_plugin_kinds``)."""


class GreeterSpecs:
    @pluggy.HookspecMarker("pagelm")
    def pagelm_register_greeters(self, registry):
        """Add ``Greeter`` subclasses."""


def test_hook_pagelm_add_plugin_kinds():
    """A plugin adds a kind of its own; another plugin registers an entry of it through the
    kind's hook, and an entry that is not a subclass of its contract is refused."""

    class Owner:
        @hookimpl
        def pagelm_add_plugin_kinds(self, plugin_manager):
            plugin_manager.add_kind("greeter", GreeterSpecs, "pagelm_register_greeters", Greeter)

    class Hello(Greeter):
        pass

    class Registers:
        @hookimpl
        def pagelm_register_greeters(self, registry):
            registry.add("hello", Hello)

    pm = PluginManager()
    with pytest.raises(UnknownNameError, match="unknown plugin kind 'greeter'.*router"):
        pm.collect("greeter")
    pm.register(Owner(), name="owner")
    pm.register(Registers(), name="registers")
    assert pm.collect("greeter").get("hello") is Hello
    assert pm.registrations("registers") == {"greeter": ["hello"]}

    class Wrong:
        @hookimpl
        def pagelm_register_greeters(self, registry):
            registry.add("not_a_greeter", int)

    pm.register(Wrong(), name="wrong")
    with pytest.raises(PluginError, match="'not_a_greeter', which must be a subclass of .*Greeter"):
        pm.collect("greeter")


def test_hook_pagelm_register_tool_parsers(plugin):
    """A third-party tool-call parser: the conformance kit passes it, the server's
    --tool-call-parser finds it by name, and an auto request's output becomes its calls."""
    from pagelm.plugins.server.protocol import ChatCompletionRequest
    from pagelm.plugins.server.tools import ToolCalling
    from pagelm.plugins.tool_parsers.conformance import check_tool_parser

    parser_cls = CallLines.parser_class()

    class P:
        @hookimpl
        def pagelm_register_tool_parsers(self, registry):
            registry.add(parser_cls.name, parser_cls)

    plugin(P())
    (whole,) = check_tool_parser("call_lines", ['Checking.\nCALL get_weather {"city": "Paris"}\n'])
    assert whole.content == "Checking.\n" and [(c.name, c.arguments) for c in whole.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    req = ChatCompletionRequest.model_validate_json(json.dumps({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    }))
    tools = ToolCalling(None, "call_lines", enable_auto_tool_choice=True).prepare(req)
    message, finish_reason = tools.message('CALL get_weather {"city": "Paris"}', "stop")
    assert finish_reason == "tool_calls" and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert set(get_plugin_manager().collect("tool call parser").names()) == {"call_lines", "hermes", "llama3_json"}
    with pytest.raises(UnknownNameError, match="tool call parser 'no-such-format'.*call_lines"):
        ToolCalling(None, "no-such-format")


def test_hook_pagelm_register_cli_commands(plugin, capsys):
    from pagelm.cli import main

    def add_parser(sub):
        p = sub.add_parser("hello", help="say hello")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: print(f"hello {args.name}") or 3)

    class P:
        @hookimpl
        def pagelm_register_cli_commands(self, registry):
            registry.add("hello", add_parser)

    plugin(P())
    assert main(["hello", "--name", "pagelm"]) == 3
    assert capsys.readouterr().out == "hello pagelm\n"


def fake_kernel(x):
    return x + 1


def test_hook_pagelm_register_kernels(plugin):
    from pagelm.kernels import fused_kernel

    assert fused_kernel("test_add_one") is None

    class P:
        @hookimpl
        def pagelm_register_kernels(self, registry):
            registry.add("test_add_one", f"{__name__}:fake_kernel")

    plugin(P())
    assert fused_kernel("test_add_one") is fake_kernel  # seen at once: the table follows the plugins
    # The built-in kernels are registered the same way, by reference (not imported until used).
    assert set(KERNELS) <= set(get_plugin_manager().collect("kernel").names())


def test_builtin_commands_come_from_plugins():
    commands = get_plugin_manager().collect("cli command")
    assert {"bench", "simulate"} <= set(commands.names())


# ---- lifecycle hooks ------------------------------------------------------------------------


def test_hook_pagelm_configure(llama_dir, plugin):
    class P:
        @hookimpl
        def pagelm_configure(self, config):
            config.max_num_seqs = (config.plugin_config.get("test") or {}).get("max_num_seqs", config.max_num_seqs)

    plugin(P())
    llm, _ = generate(llama_dir, plugin_config={"test": {"max_num_seqs": 3}})
    assert llm.engine.core.scheduler.config.max_num_seqs == 3


class Recorder:
    def __init__(self):
        self.events = []

    @hookimpl
    def pagelm_engine_started(self, engine):
        self.events.append(("started", engine.num_kv_blocks))

    @hookimpl
    def pagelm_request_finished(self, request, reason):
        self.events.append(("finished", request.request_id, reason))

    @hookimpl
    def pagelm_engine_shutdown(self, engine):
        self.events.append(("shutdown", engine.num_kv_blocks))


def test_hook_pagelm_engine_started(llama_dir, plugin):
    rec = plugin(Recorder())
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=40)
    assert rec.events == [("started", 40)]
    assert llm.engine.core.num_kv_blocks == 40


def test_hook_pagelm_request_finished(llama_dir, plugin):
    rec = plugin(Recorder())
    llm = LLM(str(llama_dir), dtype="float32")
    llm.generate([{"prompt_token_ids": [5, 6]}] * 2, PARAMS, use_tqdm=False)
    llm.engine.add_request("aborted", {"prompt_token_ids": [5, 6]}, PARAMS)
    llm.engine.abort_request(["aborted"])
    finished = [e[1:] for e in rec.events if e[0] == "finished"]
    assert sorted(finished) == [("0", "length"), ("1", "length"), ("aborted", "abort")]


def test_hook_pagelm_engine_shutdown(llama_dir, plugin):
    rec = plugin(Recorder())
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=40)
    llm.engine.shutdown()
    assert rec.events == [("started", 40), ("shutdown", 40)]
