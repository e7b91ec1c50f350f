"""``hermes``: tool calls as Hermes 2 Pro and Qwen 2.5 / Qwen 3 write them, one JSON object
per ``<tool_call>`` block (vLLM's parser of the same name)::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The text before the first block is the content (the whole of it when no block holds a
call). A block whose body is not ``{"name": <string>, "arguments": <object>}`` stays in the
content as written; a block cut off by the end of the output counts as if closed there.
Whitespace between and after calls is dropped; other text after a call is content.

Streaming holds text that may be the start of ``<tool_call>``, and a block until it closes:
each call goes out whole, in one delta, so no delta is ever taken back.
"""

from __future__ import annotations

import json

from pagelm.plugins.tool_parsers.parser import StreamDelta, ToolCall, ToolCallDelta, ToolParser

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tokenizer, tools) -> None:
        super().__init__(tokenizer, tools)
        self._pos = 0  # text before this is sent (or dropped)
        self._num_calls = 0
        # True once the current stretch of text between blocks has been sent in part: its
        # whitespace is then content like the rest (only whitespace-only stretches drop).
        self._stretch_sent = False

    def extract_tool_calls_streaming(self, previous_text: str, delta_text: str, finished: bool) -> StreamDelta:
        text = previous_text + delta_text
        out = StreamDelta()
        while True:
            if text.startswith(START, self._pos):
                if not self._take_block(text, finished, out):
                    break
                continue
            start = text.find(START, self._pos)
            end = start if start != -1 else len(text) if finished else len(text) - _partial_tag(text, self._pos)
            self._take_text(text[self._pos:end], closed=start != -1 or finished, out=out)
            if start == -1:
                break
        return out

    def _take_block(self, text: str, finished: bool, out: StreamDelta) -> bool:
        """Send the block at ``self._pos`` once it is closed (or the output ends)."""
        end = text.find(END, self._pos + len(START))
        if end == -1 and not finished:
            return False
        stop = len(text) if end == -1 else end + len(END)
        call = parse_call(text[self._pos + len(START):end if end != -1 else len(text)], "arguments")
        if call is None:  # content as written
            self._take_text(text[self._pos:stop], closed=False, out=out)
        else:
            out.tool_calls.append(ToolCallDelta(self._num_calls, call.id, call.name, call.arguments))
            self._num_calls += 1
            self._pos = stop
            self._stretch_sent = False
        return True

    def _take_text(self, piece: str, closed: bool, out: StreamDelta) -> None:
        """Send ``piece`` (text outside valid calls) as content, unless it is whitespace
        after a call: held while more text may follow it, dropped once it is ``closed``."""
        if self._num_calls and not self._stretch_sent and not piece.strip():
            if closed:
                self._pos += len(piece)
            return
        out.content += piece
        self._pos += len(piece)
        self._stretch_sent = self._stretch_sent or bool(piece)


def parse_call(body: str, *argument_keys: str) -> ToolCall | None:
    """``{"name": <string>, <argument key>: <object>}`` as a call, else None. Arguments
    written as a JSON string holding an object (some models do) are taken too."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return call_from_object(obj, *argument_keys)


def call_from_object(obj: object, *argument_keys: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    keys = [k for k in argument_keys if k in obj]
    if len(keys) != 1:
        return None
    arguments = obj[keys[0]]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_tag(text: str, pos: int) -> int:
    """How many characters at the end of ``text[pos:]`` may be the start of ``<tool_call>``."""
    for n in range(min(len(START) - 1, len(text) - pos), 0, -1):
        if START.startswith(text[len(text) - n:]):
            return n
    return 0
