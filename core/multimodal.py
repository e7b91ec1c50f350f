"""The multimodal contract: what a vision-language model plugin provides, and what a request
with images carries through the engine.

An image in a prompt is one placeholder token; the model's ``MultiModalProcessor`` (API
process) expands it to one position per embedding the vision encoder makes of that image and
turns the image into the encoder's inputs. The request then carries one ``MultiModalFeature``
per image::

    prompt:  | text | img img img img img img | text | img img img | text |
                    ^ offset      length = 6 ^        ^ offset, length = 3

The scheduler runs the encoder for an image the first time a step covers any of its
positions (``pagelm.sched.encoder_cache``), the runner keeps its embeddings by
``identifier`` until the last position is computed, and the language model takes them in
place of the placeholders' token embeddings (``SupportsMultiModal``). ``identifier`` (a hash
of the image) is the encoder cache's key and joins the prefix-cache hash of every KV block the
image's positions touch, so two different images never share KV.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    from PIL import Image

# Images a prompt may carry when ``limit_mm_per_prompt`` does not say.
DEFAULT_IMAGE_LIMIT = 16
# The most pixels an image may have (width x height): a 20,000 x 20,000 image would take
# 1.2 GB decoded before the processor shrinks it.
MAX_IMAGE_PIXELS = 8192 * 8192


@dataclass(slots=True)
class MultiModalFeature:
    """One image of a request: where its placeholders sit and what the encoder needs."""

    modality: str  # "image"
    identifier: str  # sha256 hex of the image: encoder-cache key, prefix-cache extra key
    offset: int  # position of its first placeholder in the prompt
    length: int  # placeholder positions = embeddings the encoder makes of it
    data: dict[str, torch.Tensor] = field(default_factory=dict)  # the encoder's inputs

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its positions lies in ``[start, end)``."""
        return self.offset < end and start < self.offset + self.length

    # msgpack-able form, for the engine core's wire (tensors as raw bytes, never pickle)
    def to_wire(self) -> list:
        data = {k: [str(v.dtype).removeprefix("torch."), list(v.shape), v.contiguous().numpy().tobytes()]
                for k, v in self.data.items()}
        return [self.modality, self.identifier, self.offset, self.length, data]

    @classmethod
    def from_wire(cls, wire: list) -> "MultiModalFeature":
        modality, identifier, offset, length, data = wire
        tensors = {}
        for key, (dtype, shape, raw) in data.items():
            if dtype not in _WIRE_DTYPES:
                raise ValueError(f"multimodal feature tensor {key!r} has dtype {dtype!r}; allowed: {sorted(_WIRE_DTYPES)}")
            array = np.frombuffer(raw, dtype=_WIRE_DTYPES[dtype]).reshape(shape)
            tensors[key] = torch.from_numpy(array.copy())
        return cls(str(modality), str(identifier), int(offset), int(length), tensors)


_WIRE_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}


def image_hash(image: "Image.Image") -> str:
    """sha256 over the decoded pixels (mode, size, bytes): the same picture sent as PNG or
    JPEG-free copies hashes the same; any pixel that differs changes it."""
    h = hashlib.sha256()
    h.update(f"image|{image.mode}|{image.width}x{image.height}|".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def check_image(image: Any, what: str = "image") -> "Image.Image":
    """``image`` as an RGB ``PIL.Image``; ``ValueError`` naming ``what`` if it is not an image
    or is larger than ``MAX_IMAGE_PIXELS``."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"{what} must be a PIL.Image.Image, got {type(image).__name__}")
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"{what} is too large: {image.width} x {image.height} pixels, at most {MAX_IMAGE_PIXELS:,} are allowed"
        )
    if image.width < 1 or image.height < 1:
        raise ValueError(f"{what} is empty ({image.width} x {image.height})")
    return image.convert("RGB") if image.mode != "RGB" else image


def decode_image(raw: bytes, what: str = "image") -> "Image.Image":
    """Image file bytes (PNG, JPEG, ...) to an RGB image, the size checked before the pixels
    are decoded; ``ValueError`` naming ``what`` for a corrupt or non-image payload."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:  # header only: nothing decoded yet
                raise ValueError(
                    f"{what} is too large: {img.width} x {img.height} pixels, at most {MAX_IMAGE_PIXELS:,} are allowed"
                )
            img.load()
            return check_image(img, what)
    except Image.DecompressionBombError as exc:
        raise ValueError(f"{what} is too large: {exc}") from None  # PIL's own limit, met on open
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"{what} is not a readable image ({type(exc).__name__}: {exc})") from None


def decode_data_url(url: str, what: str = "image_url") -> "Image.Image":
    """A ``data:image/...;base64,...`` URL to an image (``ValueError`` naming ``what``)."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:") or not header.endswith(";base64"):
        raise ValueError(f"{what} must be a data:<mime>;base64,<data> URL or an http(s) URL")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} has invalid base64 data") from None
    return decode_image(raw, what)


def content_parts_to_text(content: Any, placeholder: str | None, where: str = "content") -> tuple[str, list]:
    """A chat message's content (a string or OpenAI content parts) as template text plus its
    images in order: each image part becomes the model's ``placeholder`` text. Image parts
    carry a PIL image (``{"type": "image_pil", "image_pil": img}``, ``{"type": "image",
    "image": img}``) or an ``image_url`` (returned unresolved, as its URL string, for the
    caller to fetch)."""
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts")
    pieces, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.{j}.text must be a string")
            pieces.append(part["text"])
            continue
        if kind not in ("image_url", "image_pil", "image"):
            raise ValueError(f"{where}.{j}.type must be 'text', 'image_url', 'image_pil' or 'image', got {kind!r}")
        if placeholder is None:
            raise ValueError(f"{where}.{j}: this model does not take images")
        if kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ValueError(f"{where}.{j}.image_url.url must be a string")
            images.append(url)
        else:
            images.append(part.get(kind))
        pieces.append(placeholder)
    return "".join(pieces), images


class MultiModalProcessor(ABC):
    """Per model, in the API process: a model's images to encoder inputs, and its prompt's
    placeholders to one position per embedding. One object per engine (made from the model
    directory, as Hugging Face's processors are)."""

    # What a chat message's image part becomes in the prompt text, and its token id.
    placeholder_text: ClassVar[str] = "<image>"

    def __init__(self, model_dir: Path, hf_config: Any, tokenizer: Any) -> None:
        self.model_dir, self.hf_config, self.tokenizer = model_dir, hf_config, tokenizer

    @property
    @abstractmethod
    def placeholder_token_id(self) -> int:
        """The token that stands for an image in the prompt (repeated once expanded)."""

    @abstractmethod
    def preprocess(self, image: "Image.Image") -> dict[str, torch.Tensor]:
        """The encoder's inputs for one image (e.g. ``{"pixel_values": [3, H, W]}``)."""

    @abstractmethod
    def num_embeddings(self, data: dict[str, torch.Tensor]) -> int:
        """How many embeddings (placeholder positions) the encoder makes of these inputs."""

    def dummy_inputs(self, num_embeddings: int) -> list[dict[str, torch.Tensor]]:
        """Optional (plugin API 2.12): encoder inputs of dummy images that together make at
        most ``num_embeddings`` embeddings, as the largest images this processor makes, so
        that encoding them costs what the worst step under that encoder budget costs (the
        profiling pass that sizes the GPU KV pool runs them). Default: none (the encoder's
        activations are then not counted)."""
        return []

    def dummy_features(self, num_embeddings: int) -> list[MultiModalFeature]:
        """``dummy_inputs`` as features the model's ``get_multimodal_embeddings`` takes."""
        features, offset = [], 0
        for i, data in enumerate(self.dummy_inputs(num_embeddings)):
            n = self.num_embeddings(data)
            features.append(MultiModalFeature("image", f"profile-{i}", offset, n, data))
            offset += n
        assert offset <= num_embeddings, f"dummy_inputs made {offset} embeddings, more than {num_embeddings}"
        return features

    def process(self, token_ids: Sequence[int], images: Sequence["Image.Image"]) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand the prompt's placeholders (one token per image, in order) and describe each
        image. A prompt whose placeholder runs are each exactly as long as their image's
        embeddings is taken as expanded already (token ids from an earlier expansion); any
        other count of images and placeholders is a ``ValueError``."""
        token = self.placeholder_token_id
        datas = [self.preprocess(image) for image in images]
        sizes = [self.num_embeddings(data) for data in datas]
        singles = [(i, i + 1) for i, t in enumerate(token_ids) if t == token]
        runs = singles if len(singles) == len(images) else _runs(token_ids, token)
        if len(runs) != len(images) or (runs is not singles and any(e - s != n for (s, e), n in zip(runs, sizes))):
            raise ValueError(
                f"the prompt has {len(singles)} image placeholder(s) ({self.placeholder_text!r}) but "
                f"multi_modal_data has {len(images)} image(s); each image needs one placeholder"
            )
        out: list[int] = []
        features: list[MultiModalFeature] = []
        previous_end = 0
        for (start, end), image, data, n in zip(runs, images, datas, sizes):
            out.extend(token_ids[previous_end:start])
            features.append(MultiModalFeature("image", image_hash(image), len(out), n, data))
            out.extend([token] * n)
            previous_end = end
        out.extend(token_ids[previous_end:])
        return out, features


def _runs(token_ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of ``token`` in ``token_ids``."""
    runs, i, n = [], 0, len(token_ids)
    while i < n:
        if token_ids[i] == token:
            j = i
            while j < n and token_ids[j] == token:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


@dataclass(slots=True)
class RequestPositions:
    """A request's own rotary positions, for a model whose positions are not simply each
    token's index (Qwen2-VL's M-RoPE: a (temporal, height, width) row each). Made once when
    the request joins the runner (again after a preemption), from its prompt and images::

        prompt tokens 0 .. P-1:   positions[:, i]         (rows x P, the model's layout)
        any later token i:        i + delta in every row  (decode; a text token after the
                                                           last image, as the prompt's are)
    """

    positions: np.ndarray  # int64 [rows, num_prompt_tokens]
    delta: int  # a token past the prompt sits at its index + delta

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]


class SupportsMultiModal(ABC):
    """What a vision-language model adds to the model contract (a mixin beside
    ``nn.Module``). Its ``forward(input_ids, positions, inputs_embeds=None)`` takes the
    merged embeddings when a step covers image positions; text-only steps never build them.

    A model whose rotary positions depend on the images (M-RoPE) sets
    ``position_rows`` (3 for M-RoPE) and implements ``get_input_positions``; its ``forward``
    then takes ``positions`` either as ``[num_tokens]`` (every row equal: text and decode
    steps, shifted by each request's ``delta``) or as ``[position_rows, num_tokens]`` (a step
    covering some request's prompt that has images)."""

    multimodal_processor: ClassVar[type[MultiModalProcessor]]
    # Rows of positions ``get_input_positions`` gives (1: positions are token indices).
    position_rows: ClassVar[int] = 1

    def get_input_positions(self, num_prompt_tokens: int, features: list[MultiModalFeature]) -> RequestPositions | None:
        """The rotary positions of a request with images (``features``, by offset), or None
        when they are the token indices (the default). Called once per request when it
        joins the runner, never per step or per token."""
        return None

    @abstractmethod
    def get_multimodal_embeddings(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Run the encoder (and projector) over ``features``' inputs, batched as the model
        likes: one ``[feature.length, hidden]`` tensor per feature, in order."""

    def merge_multimodal_embeddings(
        self, input_ids: torch.Tensor, multimodal_embeddings: torch.Tensor, is_multimodal: torch.Tensor
    ) -> torch.Tensor:
        """The language model's input embeddings for ``input_ids`` with
        ``multimodal_embeddings`` (``[is_multimodal.sum(), hidden]``, in token order) at the
        positions ``is_multimodal`` marks."""
        inputs_embeds = self.get_input_embeddings()(input_ids)
        # masked_scatter, not ``inputs_embeds[mask] = ...``: a boolean index waits for the
        # device to count the mask (a host sync); the scatter does not.
        return inputs_embeds.masked_scatter_(is_multimodal.unsqueeze(-1), multimodal_embeddings.to(inputs_embeds.dtype))
