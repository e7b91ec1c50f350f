"""Images of chat requests: ``image_url`` content parts as ``data:`` URLs (base64) or
http(s) URLs, fetched with a size and a time limit. Every failure is a ``ValueError`` that
names the part, which the server answers with a 400 (see ``docs/multimodal.md``)."""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagelm.multimodal import decode_data_url, decode_image

if TYPE_CHECKING:
    from PIL import Image

DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ImageFetcher:
    """``max_bytes``: the largest image file taken (a data URL's decoded payload too);
    ``timeout_s``: the most one http(s) fetch may take, connecting and reading together;
    ``allow_http``: whether http(s) URLs are fetched at all (``data:`` URLs always work);
    ``allowed_domains``: the hosts http(s) URLs may name (None: any; a server reachable by
    untrusted clients should list them, or it fetches whatever its own network can reach)."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    allow_http: bool = True
    allowed_domains: tuple[str, ...] | None = None

    def load(self, url: str, what: str) -> "Image.Image":
        if url.startswith("data:"):
            if len(url) * 3 // 4 > self.max_bytes + 4:
                raise ValueError(f"{what}: the image is larger than {self.max_bytes} bytes")
            return decode_data_url(url, what)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{what} must be a data:image/...;base64 URL or an http(s) URL, got {url[:40]!r}")
        if not self.allow_http:
            raise ValueError(f"{what}: this server does not fetch http(s) URLs; send the image as a data: URL")
        host = urllib.parse.urlsplit(url).hostname
        if self.allowed_domains is not None and host not in self.allowed_domains:
            raise ValueError(f"{what}: {host!r} is not among the allowed media domains ({', '.join(self.allowed_domains)})")
        return decode_image(self._fetch(url, what), what)

    def _fetch(self, url: str, what: str) -> bytes:
        """The body at ``url``, read in chunks so that neither a large body nor a slow one
        (a server that trickles bytes) holds the worker past the limits."""
        deadline = time.monotonic() + self.timeout_s
        request = urllib.request.Request(url, headers={"User-Agent": "pagelm"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                declared = response.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise ValueError(f"{what}: the image at {url} is {declared} bytes; at most {self.max_bytes} are allowed")
                body = bytearray()
                while chunk := response.read(64 << 10):
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise ValueError(f"{what}: the image at {url} is larger than {self.max_bytes} bytes")
                    if time.monotonic() > deadline:
                        raise ValueError(f"{what}: fetching {url} took longer than {self.timeout_s} s")
                return bytes(body)
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise ValueError(f"{what}: could not fetch {url}: {reason}") from None
