"""What every request body must be before its fields are read: text that is valid Unicode,
and arrays/objects nested at most ``MAX_JSON_DEPTH`` deep.

JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which Python keeps in a ``str`` but
which is no Unicode text: the tokenizer raised a ``TypeError`` on it (a 500) and UTF-8
encoders a ``UnicodeEncodeError`` wherever the string went next (the engine-core wire, the
block hash of a ``cache_salt``). Deep nesting reached code that recurses (pydantic, the
``extra_args`` check, the msgpack packer, schema rewriting) and ended as a
``RecursionError``, a 500. Both are a 400 naming the field here instead.

The walk only descends into strings, arrays and objects: a list of a million token ids is
skipped at C speed (``set(map(type, ...))``), since the check runs on the event loop.
"""

from __future__ import annotations

from typing import Any

from pagelm.plugins.server.errors import APIError

# Arrays/objects inside arrays/objects, the body itself counting as 1. Real requests nest a
# few levels (a JSON schema a few dozen); recursive consumers down the line (msgpack stops
# at 511, Python at ~1000 frames) stay far from their limits.
MAX_JSON_DEPTH = 128

_TEXT_OR_CONTAINER = (str, list, dict)


def check_body(body: Any) -> None:
    """Raise a 400 ``APIError`` naming the top-level field that holds a lone surrogate or
    nests too deeply. Anything that is not a JSON object is left to the schema's errors."""
    if not isinstance(body, dict):
        return
    for field, value in body.items():
        if isinstance(field, str):
            _check_text(field, "a field name", param=None)
        _check_value(str(field), value)


def _check_value(field: str, value: Any) -> None:
    stack = [(value, 2)]  # the body is level 1, its fields' values level 2
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is str:
            _check_text(item, field, param=field)
            continue
        if kind is not list and kind is not dict:
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(
                f"{field} nests arrays/objects more than {MAX_JSON_DEPTH} levels deep (counting the body)",
                param=field,
            )
        if kind is dict:
            for key in item:
                if type(key) is str:
                    _check_text(key, f"a key in {field}", param=field)
            children = item.values()
        else:
            children = item
        if not set(map(type, children)).isdisjoint(_TEXT_OR_CONTAINER):
            stack.extend((child, depth + 1) for child in children if type(child) in _TEXT_OR_CONTAINER)


def _check_text(text: str, what: str, param: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            f"{what} is not valid Unicode text: it holds a lone UTF-16 surrogate "
            f"({text[exc.start]!a}) at position {exc.start}",
            param=param,
        ) from None
