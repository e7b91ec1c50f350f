"""The one place a request is checked and tokenized, for every way in (``LLM``, ``AsyncLLM``,
the server): what needs this engine (its vocabulary, ``max_model_len``, the tokenizer, the
structured-output backend), before anything is queued. ``SamplingParams`` checks the rest
when it is built. A ``ProcessedRequest`` is queued without being checked again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from pagelm.config import EngineConfig
from pagelm.multimodal import MultiModalFeature, MultiModalProcessor, check_image
from pagelm.plugin_manager import get_plugin_manager
from pagelm.registry import raise_problems
from pagelm.sampling_params import INT64_MAX, INT64_MIN, GuidedDecodingParams, SamplingParams, check_bad_words_token_ids, num_logprobs

# vLLM's prompt shapes: a string, or {"prompt_token_ids": [...]} (TokensPrompt), or
# {"prompt": "..."} (TextPrompt); either dict may carry {"multi_modal_data": {"image": ...}}.
PromptType = Union[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A prompt tokenized and checked with its sampling parameters and priority."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    mm_features: tuple[MultiModalFeature, ...] = ()


class InputProcessor:
    def __init__(
        self, config: EngineConfig, tokenizer: Any, vocab_size: int, max_model_len: int,
        mm_processor: MultiModalProcessor | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # A vision-language model's processor (None: the model takes no images).
        self.mm_processor = mm_processor

    @property
    def max_logprobs(self) -> int:
        """The most ``logprobs`` / ``prompt_logprobs`` a request may ask for: the config's
        ``max_logprobs`` (-1: no limit of its own), never beyond the vocabulary, whose size a
        top-k cannot exceed (it raised in the step, failing every request in it)."""
        limit = self.config.max_logprobs
        return self.vocab_size if limit < 0 else min(limit, self.vocab_size)

    def process(self, prompt: PromptType, params: SamplingParams, priority: int = 0) -> ProcessedRequest:
        """Tokenize ``prompt`` and check it with ``params``; ``ValueError`` names the problem."""
        processed = self.process_prompt(prompt, params, priority)
        self.check_params(params, priority)
        return processed

    def process_prompt(self, prompt: PromptType, params: SamplingParams, priority: int = 0) -> ProcessedRequest:
        """``process`` without ``check_params`` (``LLM.generate`` checks each distinct one once)."""
        text, token_ids = self.truncate(*self.tokenize(prompt), params)
        token_ids, features = self.multimodal(prompt, token_ids, params)
        self.check_prompt(token_ids)
        return ProcessedRequest(text, token_ids, params, priority, features)

    def multimodal(
        self, prompt: PromptType, token_ids: list[int], params: SamplingParams | None = None
    ) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """The prompt's images (``prompt["multi_modal_data"]["image"]``: one image or a list)
        checked and described, and its image placeholders expanded to one position per
        embedding; ``ValueError`` names the problem. A text-only model's prompt passes
        untouched unless it carries images."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if self.mm_processor is None:
            if data:
                raise ValueError("multi_modal_data: this model takes no images")
            return token_ids, ()
        if data is None and self.mm_processor.placeholder_token_id not in token_ids:
            return token_ids, ()
        if data is not None and (not isinstance(data, dict) or set(data) - {"image"}):
            raise ValueError(f"multi_modal_data must be {{'image': PIL.Image or a list of them}}, got keys "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        images = (data or {}).get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.config.image_limit:
            raise ValueError(
                f"multi_modal_data has {len(images)} images; limit_mm_per_prompt allows at most "
                f"{self.config.image_limit} per prompt"
            )
        if images and params is not None and params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot be used with images (it could cut an image in two)")
        images = [check_image(img, f"multi_modal_data.image[{i}]") for i, img in enumerate(images)]
        token_ids, features = self.mm_processor.process(token_ids, images)
        return token_ids, tuple(features)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt" in prompt):
            text = prompt if isinstance(prompt, str) else prompt["prompt"]
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: prompts must be {'prompt_token_ids': [...]}, not text")
            return text, self.tokenizer.encode(text)
        raise ValueError(
            "prompt must be a string, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}"
        )

    def truncate(self, text: str | None, token_ids: list[int], params: SamplingParams) -> tuple[str | None, list[int]]:
        """``params.truncate_prompt_tokens``: keep the prompt's last k tokens (vLLM's left
        truncation; -1: as many as leave room for ``max_tokens``). A truncated prompt has no
        text any more (its text is the whole prompt's)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return text, token_ids
        room = self.max_model_len - (params.max_tokens or 1)
        if k == -1:
            k = max(room, 1)
        elif k > room:
            raise ValueError(
                f"truncate_prompt_tokens must be at most max_model_len - max_tokens = {self.max_model_len} - "
                f"{params.max_tokens or 1} = {room}, got {k}"
            )
        if len(token_ids) <= k:
            return text, token_ids
        return None, token_ids[-k:]

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; with max_model_len={self.max_model_len} it must "
                f"have at most {self.max_model_len - 1} so one token can be generated"
            )

    def check_params(self, params: SamplingParams, priority: int = 0) -> None:
        """What ``SamplingParams`` cannot check alone: limits of this engine and its model.
        Each message starts with the parameter's name."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be an integer in [{INT64_MIN}, {INT64_MAX}], got {priority!r}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; with skip_tokenizer_init=True use stop_token_ids")
        vocab_bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if vocab_bad:
            raise ValueError(f"stop_token_ids {vocab_bad} are outside the vocabulary [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            wanted = num_logprobs(asked, self.vocab_size)
            if wanted is not None and wanted > self.max_logprobs:
                whole = f" (the whole vocabulary, {wanted})" if asked == -1 else ""
                raise ValueError(
                    f"{name} must be at most {self.max_logprobs} (the engine's max_logprobs), got {asked}{whole}"
                )
        if params.guided_decoding is not None:
            self.check_guided_decoding(params.guided_decoding)
        self.check_token_lists(params)

    def check_guided_decoding(self, params: GuidedDecodingParams) -> None:
        """Whether this engine can serve the constraint: a tokenizer, a backend plugin that
        can run here (e.g. its library installed) and accepts the constraint's syntax."""
        if self.config.skip_tokenizer_init:
            raise ValueError("guided_decoding needs the tokenizer; the engine has skip_tokenizer_init=True")
        backends = get_plugin_manager().collect("structured output backend")
        name = self.config.structured_output_backend
        if not len(backends):
            raise ValueError(
                f"guided_decoding needs a structured-output backend plugin, and none is registered "
                f"(structured_output_backend={name!r}; is it in PAGELM_DISABLE_PLUGINS?)"
            )
        backend_cls = backends.get(name)
        raise_problems(f"guided_decoding: structured_output_backend={name!r}", backend_cls.validate(self.config))
        backend_cls.validate_request(params)

    def check_token_lists(self, params: SamplingParams) -> None:
        """logit_bias and allowed_token_ids within the vocabulary (they index the logits);
        bad_words tokenized into ``params.bad_words_token_ids`` as vLLM does, each word both as
        it stands and after a space (a word inside the text)."""
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = sorted({t for t in ids if t >= self.vocab_size})
            if outside:
                raise ValueError(f"{name} has token ids {outside[:8]} outside the vocabulary [0, {self.vocab_size})")
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.bad_words_token_ids:
            check_bad_words_token_ids(params.bad_words_token_ids)
            outside = sorted({t for w in params.bad_words_token_ids for t in w if t >= self.vocab_size})
            if outside:
                raise ValueError(f"bad_words tokenize to ids {outside[:8]} outside the vocabulary [0, {self.vocab_size})")
        if params.allowed_token_ids is not None:
            banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
            if set(params.allowed_token_ids) <= banned:
                raise ValueError("allowed_token_ids leaves no token to sample: bad_words bans every one of them")

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; the engine has skip_tokenizer_init=True")
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words entry {word!r} tokenizes to no token")
            out.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            # Only where the space makes another word of the same length (vLLM's rule).
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return out
