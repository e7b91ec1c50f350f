"""``GET /tokenizer_info`` (with ``--enable-tokenizer-info-endpoint``, as in vLLM): the
tokenizer's configuration - what ``tokenizer_config.json`` set, its class, and the chat
template the server renders with - so that a client can tokenize and template as the server
does. Off by default: it shows the chat template and the model's path on the server."""

from __future__ import annotations

from typing import Any

# File paths on the server: no use to a client.
_PATH_FIELDS = ("vocab_file", "merges_file")


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's fields: the tokenizer's ``init_kwargs`` (less file paths), ``tokenizer_class``
    and ``chat_template``."""
    config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _PATH_FIELDS}
    info = _jsonable(config)
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


def _jsonable(value: Any) -> Any:
    """Special tokens (``AddedToken``) as their text; anything else JSON cannot hold as text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
