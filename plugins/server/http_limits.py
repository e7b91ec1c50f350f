"""A bound on the request head (request line + headers) for uvicorn: a head larger than
``--max-header-bytes``, or with more than ``MAX_HEADER_COUNT`` headers, is a 431 in the
OpenAI error format before it is parsed any further.

uvicorn's fast HTTP parser (httptools) keeps a header in memory until it ends, however long:
a 1 GB header was read whole (vLLM's CVE-2025-48956 class), and an ASGI middleware only sees
headers once they are all in. So the count is taken on the bytes as they arrive, in the
protocol, before the parser gets them. Without httptools uvicorn uses h11, whose own limit
(``h11_max_incomplete_event_size``) is set to the same number (h11 answers it with a 400).
"""

from __future__ import annotations

import asyncio
import json

from pagelm.plugins.server.errors import APIError

# vLLM's default for h11; a browser sends about 20.
MAX_HEADER_COUNT = 256
# After a 431 the rest of what the client sends is read and dropped (closing with unread
# data resets the connection, and the client may then never see the 431), for this long.
_DRAIN_SECONDS = 5.0


def uvicorn_http_options(max_header_bytes: int) -> dict:
    """``uvicorn.Config`` keyword arguments that bound request heads to ``max_header_bytes``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn's h11 protocol, with h11's limits
        return {"http": "h11", "h11_max_incomplete_event_size": max_header_bytes}

    class HeadLimitedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol, counting each request's head as it arrives."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._in_head, self._head_bytes, self._head_lines, self._tail = True, 0, 0, b""
            self._refused = False

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # dropped: the 431 is out and the connection closing
            if self._in_head and not self._count_head(data):
                self._refuse()
                return
            super().data_received(data)

        def on_message_complete(self) -> None:
            self._in_head, self._head_bytes, self._head_lines, self._tail = True, 0, 0, b""
            super().on_message_complete()

        def _count_head(self, data: bytes) -> bool:
            """Add what of ``data`` belongs to the head; False once it is over a limit."""
            joined = self._tail + data  # the blank line that ends the head may span two reads
            end = joined.find(b"\r\n\r\n")
            if end < 0:
                self._head_bytes += len(data)
                self._head_lines += data.count(b"\n")
                self._tail = joined[-3:]
            else:
                head = end + 4 - len(self._tail)  # of this read
                self._head_bytes += head
                self._head_lines += data.count(b"\n", 0, max(head - 2, 0))
                self._in_head, self._tail = False, b""
            # Lines = the request line + one per header.
            return self._head_bytes <= max_header_bytes and self._head_lines <= MAX_HEADER_COUNT + 1

        def _refuse(self) -> None:
            self._refused = True
            if self._head_lines > MAX_HEADER_COUNT + 1:
                message = f"the request has more than {MAX_HEADER_COUNT} headers"
            else:
                message = f"the request's headers are larger than the server's --max-header-bytes={max_header_bytes}"
            body = json.dumps(APIError(message, 431, code="request_header_fields_too_large").body()).encode()
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
            )
            if self.transport.can_write_eof():
                self.transport.write_eof()  # the client reads the 431 and EOF; we drop the rest
                asyncio.get_running_loop().call_later(_DRAIN_SECONDS, self.transport.close)
            else:
                self.transport.close()

    return {"http": HeadLimitedHttpToolsProtocol}
