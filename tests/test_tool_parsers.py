"""The built-in tool-call parsers (``hermes``, ``llama3_json``) on real model outputs, and the
server's readers of ``tool_choice="required"`` / named output: what each whole text means,
and that streaming it cut anywhere (every character boundary; arbitrary cuts with
hypothesis) adds up to exactly that."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelm.plugins.server.tools import NamedToolCall, RequiredToolCalls
from pagelm.plugins.tool_parsers.conformance import _stream_tool_parser, check_tool_parser
from pagelm.plugins.tool_parsers.parser import StreamDelta, ToolCallDelta, accumulate

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'

# (model output, content, [(name, arguments JSON)]) as the parser must read them.
HERMES = [
    # Qwen 2.5 / Hermes 2 Pro, one call, as their chat templates ask for it
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    # text first, then two calls (parallel tool calls); whitespace between calls is dropped
    ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>\n',
     "Let me check both.\n", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    # no call at all
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    # non-ASCII arguments stay as written (ensure_ascii=False, as vLLM)
    ('<tool_call>{"name": "translate", "arguments": {"text": "Straße 日本"}}</tool_call>', None,
     [("translate", '{"text": "Straße 日本"}')]),
    # cut off by max_tokens after a complete object: the block counts as closed
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, [("f", '{"a": 1}')]),
    # cut off inside the object: all content, as written (vLLM: the same)
    ('<tool_call>\n{"name": "f", "arguments": {"a": ', '<tool_call>\n{"name": "f", "arguments": {"a": ', []),
    # malformed: no arguments; the block stays content
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    # malformed JSON beside a good call: the good call is kept, the bad block is content
    ('<tool_call>{name: f}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
     "<tool_call>{name: f}</tool_call>\n", [("g", "{}")]),
    # text after a call is content
    ('<tool_call>{"name": "g", "arguments": {}}</tool_call>\nDone.', "\nDone.", [("g", "{}")]),
    # arguments written as a JSON string holding the object
    ('<tool_call>{"name": "g", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>', None, [("g", '{"x": [1, 2]}')]),
    # something that only looks like the start of a tag
    ("a <tool_c b <tool_calls> c", "a <tool_c b <tool_calls> c", []),
    ("x <tool_", "x <tool_", []),
    ("", None, []),
]

LLAMA3 = [
    # Llama 3.1/3.2 JSON tool calling, with and without <|python_tag|>
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    # several calls separated by ';' (and by a newline), nested objects and braces in strings
    ('{"name": "a", "parameters": {"x": {"y": [1, {"z": "}{"}]}}}; {"name": "b", "arguments": {}}\n'
     '{"name": "c", "parameters": {}}', None,
     [("a", '{"x": {"y": [1, {"z": "}{"}]}}'), ("b", "{}"), ("c", "{}")]),
    # leading/trailing whitespace, and a dangling ';'
    ('\n  {"name": "a", "parameters": {"q": "é"}} ;  ', None, [("a", '{"q": "é"}')]),
    # plain text: all content
    ("Paris is sunny today.", "Paris is sunny today.", []),
    # a JSON object that is not a call: content as written
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    # both parameters and arguments: not a call (vLLM refuses it too)
    ('{"name": "a", "parameters": {}, "arguments": {}}', '{"name": "a", "parameters": {}, "arguments": {}}', []),
    # cut off inside the first call: content as written
    ('{"name": "a", "parameters": {"x": ', '{"name": "a", "parameters": {"x": ', []),
    # cut off inside the second call: the first is kept, the rest is content
    ('{"name": "a", "parameters": {}}; {"name": "b", "param', '{"name": "b", "param', [("a", "{}")]),
    # text after a call is content
    ('{"name": "a", "parameters": {}} I called a.', "I called a.", [("a", "{}")]),
    # a call inside prose is not one (Llama writes calls as the whole reply)
    ('I would call {"name": "a", "parameters": {}}', 'I would call {"name": "a", "parameters": {}}', []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ("<|python_ta", "<|python_ta", []),
    ("   ", "   ", []),
]


def _key(result):
    return result.content, [(c.name, c.arguments) for c in result.tool_calls]


@pytest.mark.parametrize("parser, table", [("hermes", HERMES), ("llama3_json", LLAMA3)])
def test_parser_reads_each_output_and_streams_it_identically_at_every_cut(parser, table):
    results = check_tool_parser(parser, [text for text, _, _ in table])
    assert [_key(r) for r in results] == [(content, calls) for _, content, calls in table]
    for r in results:  # arguments are JSON objects, ids are fresh
        assert all(isinstance(json.loads(c.arguments), dict) and c.id.startswith("chatcmpl-tool-") for c in r.tool_calls)


def _cuts(text, points):
    points = sorted(set(p % (len(text) + 1) for p in points))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([t for t, _, _ in HERMES + LLAMA3]), st.lists(st.integers(0, 400), max_size=12),
       st.sampled_from(["hermes", "llama3_json"]))
def test_any_cut_of_an_output_streams_to_the_whole_text_result(text, points, name):
    from pagelm.plugin_manager import get_plugin_manager

    cls = get_plugin_manager().collect("tool call parser").get(name)
    whole = cls(None, []).extract_tool_calls(text)
    assert _key(_stream_tool_parser(cls(None, []), _cuts(text, points))) == _key(whole)


def test_a_call_goes_out_whole_in_one_delta_once_its_block_closes():
    from pagelm.plugins.tool_parsers.hermes import HermesToolParser

    parser, previous, deltas = HermesToolParser(None, []), "", []
    for piece in ["Sure.", "\n<tool", "_call>\n", WEATHER[:20], WEATHER[20:], "\n</tool_call>"]:
        deltas.append(parser.extract_tool_calls_streaming(previous, piece, False))
        previous += piece
    assert [d.content for d in deltas] == ["Sure.", "\n", "", "", "", ""]
    (call,) = deltas[-1].tool_calls
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "get_weather", {"city": "Paris", "unit": "celsius"})


# ---- tool_choice="required" and named: the server's readers of guided output -----------------

REQUIRED = [
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', None, [("f", '{"a": 1}'), ("g", "{}")]),
    ('[ {"name":"f","parameters":{"a":[1,2]}} ]', None, [("f", '{"a": [1, 2]}')]),
    # cut off by max_tokens: complete calls kept, the rest content
    ('[{"name": "f", "parameters": {}}, {"name": "g", "par', '{"name": "g", "par', [("f", "{}")]),
    ('[{"name": "f", "parameters": {"a": 1', '[{"name": "f", "parameters": {"a": 1', []),
]


@pytest.mark.parametrize("text, content, calls", REQUIRED)
def test_required_output_streams_to_its_whole_text_calls(text, content, calls):
    whole = RequiredToolCalls(None, []).extract_tool_calls(text)
    assert _key(whole) == (content, calls)
    for pieces in [list(text) + [""]] + [[text[:i], text[i:]] for i in range(len(text) + 1)]:
        assert _key(_stream_tool_parser(RequiredToolCalls(None, []), pieces)) == (content, calls)


def test_named_choice_streams_the_arguments_as_they_are_written():
    text = '{"city": "Paris"}'
    assert _key(NamedToolCall(None, [], "get_weather").extract_tool_calls(text)) == (None, [("get_weather", text)])
    parser, previous, deltas = NamedToolCall(None, [], "get_weather"), "", []
    for piece in ['{"ci', 'ty": "Pa', 'ris"}', ""]:
        deltas.append(parser.extract_tool_calls_streaming(previous, piece, piece == ""))
        previous += piece
    assert [c.arguments for d in deltas for c in d.tool_calls] == ['{"ci', 'ty": "Pa', 'ris"}']
    assert deltas[0].tool_calls[0].name == "get_weather" and deltas[1].tool_calls[0].name is None


def test_accumulate_refuses_a_call_without_a_name_or_with_a_gap_in_indexes():
    with pytest.raises(ValueError, match="no name"):
        accumulate([StreamDelta(tool_calls=[ToolCallDelta(0, arguments="{}")])])
    with pytest.raises(ValueError, match="count up from 0"):
        accumulate([StreamDelta(tool_calls=[ToolCallDelta(1, "id", "f", "{}")])])
