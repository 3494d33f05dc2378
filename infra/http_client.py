"""HTTP client plumbing: reading a response body whole, within a bound.

``aiohttp``'s ``StreamReader.read(n)`` returns what has arrived so far (up to ``n`` bytes), not the
whole body: a reader that wants the body must read until its end. :func:`read_capped` does, and
stops as soon as the body is known to exceed the bound (from ``Content-Length`` before reading, or
while reading), so a peer can never make us hold more than the bound plus one chunk.
"""

from __future__ import annotations

import aiohttp

#: Bytes taken from the connection at a time.
CHUNK_BYTES = 64 << 10


async def read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes | None:
    """The whole body of ``response``, or None when it is larger than ``max_bytes``."""
    if response.content_length is not None and response.content_length > max_bytes:
        return None
    body = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            return None
    return bytes(body)
