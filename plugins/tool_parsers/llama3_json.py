"""``llama3_json``: tool calls as Llama 3.1 / 3.2 / 3.3 write them with JSON-based tool
calling (vLLM's parser of the same name): the whole reply is the call, possibly after the
``<|python_tag|>`` token, several calls separated by ``;``::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply that does not open with a call (after whitespace and the tag) is all content, as is
one whose first object is not ``{"name": <string>, "parameters" | "arguments": <object>}``.
After the last call, what follows its separator (whitespace, one ``;``) is content.

Streaming holds the reply until its first character says which it is, then each call until
its closing brace: calls go out whole, one delta each, so no delta is ever taken back.
"""

from __future__ import annotations

from pagelm.plugins.tool_parsers.hermes import call_from_object
from pagelm.plugins.tool_parsers.parser import StreamDelta, ToolCallDelta, ToolParser
from pagelm.plugins.tool_parsers.streaming_json import PENDING, json_object_at

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tokenizer, tools) -> None:
        super().__init__(tokenizer, tools)
        self._calls_at: int | None = None  # where the next call may start; None: not in calls
        self._content_from: int | None = None  # content mode: text from here on is sent
        self._sent = 0
        self._num_calls = 0
        self._tried = 0  # text before this held no "}" that could close the pending object

    def extract_tool_calls_streaming(self, previous_text: str, delta_text: str, finished: bool) -> StreamDelta:
        text = previous_text + delta_text
        out = StreamDelta()
        if self._content_from is None and self._calls_at is None:
            self._decide_start(text, finished)
        while self._calls_at is not None and self._next_call(text, finished, out):
            pass
        if self._content_from is not None:
            start = max(self._sent, self._content_from)
            out.content = text[start:]
            self._sent = len(text)
        return out

    def _decide_start(self, text: str, finished: bool) -> None:
        lead = text.lstrip()
        if lead.startswith(PYTHON_TAG):
            lead = lead[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(lead) and not finished:
            return  # may still become the tag
        if lead.startswith("{"):
            self._calls_at = len(text) - len(lead)
        elif lead or finished:
            self._content_from = 0

    def _next_call(self, text: str, finished: bool, out: StreamDelta) -> bool:
        """Take the call at ``self._calls_at`` if it is complete; False when waiting or done."""
        at = _skip_separator(text, self._calls_at) if self._num_calls else self._calls_at
        if at == len(text):
            if finished:  # trailing whitespace (and a dangling ';') after the last call
                self._calls_at, self._content_from, self._sent = None, len(text), len(text)
            return False
        if text[at] == "{":
            obj, end = json_object_at(text, at, finished, self._tried)
            if obj is PENDING:
                self._tried = end
                return False
            call = call_from_object(obj, "parameters", "arguments")
            if call is not None:
                out.tool_calls.append(ToolCallDelta(self._num_calls, call.id, call.name, call.arguments))
                self._num_calls += 1
                self._calls_at = self._tried = end
                return True
        # Not a call: the rest is content (all of the reply when no call came before).
        self._calls_at, self._content_from = None, at if self._num_calls else 0
        return False


def _skip_separator(text: str, pos: int) -> int:
    """Past the whitespace and one ``;`` between two calls."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos < len(text) and text[pos] == ";":
        pos += 1
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return pos
