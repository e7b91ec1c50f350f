"""vLLM's ``POST /tokenize``: a prompt, or chat messages rendered exactly as
``/v1/chat/completions`` renders them, to token ids.

A client counts a chat request's prompt tokens before sending it (to fit a context, to
budget), so the messages go through the chat path's own rendering: the chat template with
the request's ``tools`` (checked as chat checks them), ``chat_template_kwargs``,
``continue_final_message`` and, with ``--trust-request-chat-template``, its
``chat_template``. Runs on a worker thread: a 5 MB prompt took seconds to tokenize.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagelm.plugins.server.errors import APIError
from pagelm.plugins.server.protocol import ChatCompletionRequest, TokenizeRequest, TokenizeResponse
from pagelm.plugins.server.tools import check_tools

if TYPE_CHECKING:
    from pagelm.plugins.server.serving import OpenAIServing

# Chat-only fields: meaningless with a prompt, so a 400 there rather than silently ignored.
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "tools", "chat_template", "chat_template_kwargs")


def tokenize(serving: OpenAIServing, body: TokenizeRequest) -> TokenizeResponse:
    tokenizer = serving.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt and messages", param="prompt")
    if body.messages is None:
        chat_only = next((name for name in _CHAT_FIELDS if name in body.model_fields_set), None)
        if chat_only is not None:
            raise APIError(f"{chat_only} applies to messages, not to a prompt", param=chat_only)
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer.encode(body.prompt, add_special_tokens=add_special)
    else:
        ids = _chat_ids(serving, body)
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=serving.engine.max_model_len, tokens=ids, token_strs=strs)


def _chat_ids(serving: OpenAIServing, body: TokenizeRequest) -> list[int]:
    # Only the fields the body set: chat's checks tell "set" from "defaulted"
    # (continue_final_message with an explicit add_generation_prompt is a 400).
    given = {name: getattr(body, name) for name in _CHAT_FIELDS if name in body.model_fields_set}
    chat = ChatCompletionRequest(messages=body.messages, **given)
    prompt = serving._chat_prompt(chat, check_tools(chat.tools) or None)
    if body.add_special_tokens:  # vLLM: special tokens on top of what the template wrote
        return serving.tokenizer.encode(prompt["prompt"], add_special_tokens=True)
    return prompt["prompt_token_ids"]
