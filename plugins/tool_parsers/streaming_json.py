"""A JSON object read from model output as it streams in, for parsers that send each call
whole once its closing brace has arrived."""

from __future__ import annotations

import json

_decoder = json.JSONDecoder()

# ``json_object_at``'s answer while more output may still complete the object.
PENDING = object()


def json_object_at(text: str, at: int, finished: bool, searched: int) -> tuple[object, int]:
    """The JSON value opening at ``text[at]`` (a ``{``): ``(value, end)`` once it is whole;
    ``(PENDING, searched)`` while unfinished output may complete it, ``searched`` being how far
    the text holds nothing that could close it (pass it back next time, so long calls are not
    decoded again on every delta); ``(None, at)`` when finished output holds no such value."""
    if "}" not in text[max(searched, at):] and not finished:
        return PENDING, searched
    try:
        return _decoder.raw_decode(text, at)
    except (ValueError, RecursionError):
        return (None, at) if finished else (PENDING, len(text))
