"""Model names to local directories: a local directory is used as it is; a hub id
(``org/name``) is downloaded through ``huggingface_hub`` (only config, safetensors and tokenizer
files), or taken from the local Hugging Face cache. When the hub cannot be reached the answer
comes within seconds, never a hang."""

from __future__ import annotations

import concurrent.futures
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

# Everything the engine reads from a model repository, nothing else (no .bin/.pth duplicates).
ALLOW_PATTERNS = [
    "*.json",  # config, generation_config, tokenizer(_config), special tokens, safetensors index
    "*.safetensors",
    "tokenizer.model",  # SentencePiece
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",  # chat templates kept beside the tokenizer
]

# The hub's own rule (huggingface_hub's validate_repo_id): each part starts and ends with a word
# character, no ".." or "--". So "./model", "../model" and "~/model" are paths, never hub ids.
_REPO_ID = re.compile(r"^(?!.*(\.\.|--))\w([\w.\-]*\w)?/\w([\w.\-]*\w)?$")


class ModelResolutionError(RuntimeError):
    """The model is neither a local directory nor obtainable from the hub or its cache."""


def resolve_model(model: str, *, revision: str | None = None, timeout: float = 5.0) -> str:
    """The local directory holding ``model``. Raises ``ModelResolutionError`` with a message
    saying what to do when it cannot be had."""
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists() or not _REPO_ID.match(model):
        raise ModelResolutionError(
            f"model {model!r} is not a local model directory and does not look like a hub id (org/name)"
        )
    from huggingface_hub import constants, snapshot_download

    offline = constants.HF_HUB_OFFLINE
    reachable = not offline and hub_reachable(constants.ENDPOINT, timeout)
    try:
        return snapshot_download(
            model, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=not reachable,
            etag_timeout=timeout,
        )
    except Exception as exc:
        if not reachable:
            why = "HF_HUB_OFFLINE is set" if offline else f"{constants.ENDPOINT} cannot be reached"
            raise ModelResolutionError(
                f"model {model!r}: {why} and it is not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}); download it where the hub is reachable "
                "(`hf download ...`) or pass a local model directory"
            ) from exc
        raise ModelResolutionError(f"model {model!r} could not be downloaded from the hub: {exc}") from exc


def hub_reachable(endpoint: str, timeout: float) -> bool:
    """A TCP connection to the hub within ``timeout`` seconds, name lookup included (which
    socket timeouts do not cover, hence the thread)."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)

    def connect() -> None:
        socket.create_connection((url.hostname, port), timeout=timeout).close()

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(connect).result(timeout=timeout)
        return True
    except Exception:
        return False
    finally:
        pool.shutdown(wait=False)
