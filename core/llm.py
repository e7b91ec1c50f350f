"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagelm.config import EngineConfig
from pagelm.engine.input_processor import PromptType
from pagelm.engine.llm_engine import LLMEngine
from pagelm.multimodal import content_parts_to_text, decode_data_url
from pagelm.outputs import RequestOutput
from pagelm.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """An engine for offline batched generation.

    Keyword arguments are :class:`pagelm.config.EngineConfig` fields with vLLM's names
    (``dtype``, ``block_size``, ``enable_prefix_caching``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ...) plus ``num_kv_blocks``,
    ``attention_backend``, ``scheduling_policy`` and ``device``.
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine = LLMEngine(self.config)
        self._counter = itertools.count()
        self._shut_down = False

    # ---- lifetime ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine (its grammar workers, the ``pagelm_engine_shutdown`` hook). Safe to
        call twice; the engine takes no more requests after it."""
        if not self._shut_down:
            self._shut_down = True
            self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order. Every prompt is
        validated before any is queued, so bad input raises without leaving work behind."""
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; create a new one to generate again")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(priority if priority is not None else 0, len(prompts), "priority")
        salts = _per_prompt(cache_salt, len(prompts), "cache_salt")
        inputs = self.engine.inputs
        processed = [inputs.process_prompt(p, sp, prio) for p, sp, prio in zip(prompts, params, priorities)]
        # Once per distinct pair: one SamplingParams shared by every prompt is the usual case,
        # and checking a guided one parses its constraint.
        for sp, prio in {(id(sp), id(prio)): (sp, prio) for sp, prio in zip(params, priorities)}.values():
            inputs.check_params(sp, prio)

        ids = [str(next(self._counter)) for _ in prompts]
        for req_id, request, salt in zip(ids, processed, salts):
            self.engine.add_processed(req_id, request, cache_salt=salt)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template (with
        ``chat_template_kwargs`` as more template variables). ``continue_final_message``: leave
        the last message open for the model to continue, instead of a generation prompt.
        A vision-language model takes image content parts: ``{"type": "image_pil",
        "image_pil": PIL.Image}`` or ``{"type": "image_url", "image_url": {"url": "data:..."}}``
        (each becomes the model's image placeholder in the rendered text)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (its chat template); the engine has skip_tokenizer_init=True")
        mm = self.engine.inputs.mm_processor
        prompts = []
        for conv in conversations:
            conv, images = _flatten_images(conv, mm.placeholder_text if mm is not None else None)
            text = tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, chat_template=chat_template, **(chat_template_kwargs or {}),
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompt = {"prompt": text, "prompt_token_ids": ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]


def _flatten_images(conversation: Conversation, placeholder: str | None) -> tuple[Conversation, list]:
    """Messages whose content parts are flattened to text (images as ``placeholder``), and
    the images in order (``image_url`` parts: ``data:`` URLs, decoded here)."""
    flat, images = [], []
    for i, message in enumerate(conversation):
        if not isinstance(message.get("content"), list):
            flat.append(message)
            continue
        text, found = content_parts_to_text(message["content"], placeholder, f"messages[{i}].content")
        images += [decode_data_url(x, f"messages[{i}] image_url") if isinstance(x, str) else x for x in found]
        flat.append({**message, "content": text})
    return flat, images


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts; pass one or one per prompt")
        return list(value)
    return [value] * n
