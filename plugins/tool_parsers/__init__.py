"""The built-in tool-call parsers (``pagelm serve --tool-call-parser NAME``), registered as a
plugin like any third party's: ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3) and ``llama3_json``
(Llama 3.x JSON tool calling). Tool-call parsers are a plugin kind this plugin adds: the
contract is ``parser.py``, its conformance check ``conformance.py``."""

from pagelm import hookimpl

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_add_plugin_kinds(plugin_manager) -> None:
    from pagelm.plugins.tool_parsers import parser

    plugin_manager.add_kind("tool call parser", parser, "pagelm_register_tool_parsers", parser.ToolParser)


@hookimpl
def pagelm_register_tool_parsers(registry) -> None:
    from pagelm.plugins.tool_parsers.hermes import HermesToolParser
    from pagelm.plugins.tool_parsers.llama3_json import Llama3JsonToolParser

    for parser in (HermesToolParser, Llama3JsonToolParser):
        registry.add(parser.name, parser)
