"""The conformance check for tool-call parsers (the conformance kit's, for this plugin's
kind; docs/plugins.md, "Writing a tool-call parser")::

    from pagelm.plugins.tool_parsers.conformance import check_tool_parser
    def test_my_parser_conforms():
        check_tool_parser("my_parser", ['Checking.\\nCALL get_weather {"city": "Paris"}'])
"""

from __future__ import annotations

from typing import Any

from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.tool_parsers.parser import ExtractedToolCalls, StreamDelta, ToolParser, accumulate


def check_tool_parser(
    name: str, outputs: list[str], tokenizer: Any = None, tools: list[dict[str, Any]] | None = None
) -> list[ExtractedToolCalls]:
    """``name`` is a registered ``ToolParser``, and for every output in ``outputs`` (write
    real ones of your format, malformed and cut-off ones too) its streamed deltas add up to
    ``extract_tool_calls`` of the whole text, whichever way the text is cut. Returns the
    whole-text results, for your own assertions on them."""
    cls = get_plugin_manager().collect("tool call parser").get(name)
    assert cls.name == name, f"tool parser registered as {name!r} but its name attribute is {cls.name!r}"
    tools = tools or []
    results = []
    for text in outputs:
        whole = cls(tokenizer, tools).extract_tool_calls(text)
        cuts = [list(text) + [""]] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
        for pieces in cuts:
            streamed = _stream_tool_parser(cls(tokenizer, tools), pieces)
            assert _calls_key(streamed) == _calls_key(whole), (
                f"{name}: streaming {text!r} in pieces {pieces if len(pieces) == 2 else 'of one character'} "
                f"gives {_calls_key(streamed)}, the whole text gives {_calls_key(whole)}"
            )
        results.append(whole)
    return results


def _stream_tool_parser(parser: ToolParser, pieces: list[str]) -> ExtractedToolCalls:
    deltas: list[StreamDelta] = []
    previous = ""
    for i, piece in enumerate(pieces):
        delta = parser.extract_tool_calls_streaming(previous, piece, i == len(pieces) - 1)
        assert isinstance(delta, StreamDelta), f"{parser.name}: streaming must return a StreamDelta, got {delta!r}"
        deltas.append(delta)
        previous += piece
    first = {}
    for delta in deltas:
        for call in delta.tool_calls:
            first.setdefault(call.index, call)
    assert all(c.id and c.name for c in first.values()), f"{parser.name}: a call's first delta needs its id and name"
    assert len({c.id for c in first.values()}) == len(first), f"{parser.name}: tool call ids must differ"
    return accumulate(deltas)


def _calls_key(result: ExtractedToolCalls) -> tuple:
    return result.content, [(c.name, c.arguments) for c in result.tool_calls]
