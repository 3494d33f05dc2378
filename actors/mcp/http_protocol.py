"""uvicorn's httptools protocol with a response's head and body sent in one socket write.

uvicorn writes a response's status line and headers to the transport as soon as the app sends
``http.response.start``, and the body as a second write when ``http.response.body`` follows; on
uvloop each write is its own ``send`` system call on the spot, and on loopback each one also wakes
the reader. The web front's aiohttp holds the head back and sends it with the first body chunk. Under
``bench/mcp.py``'s read load the head's write alone was about a tenth of the MCP process's CPU.

:class:`CoalescingHttpToolsProtocol` (uvicorn's ``http=`` setting takes a protocol class) gives
uvicorn a transport that holds back one write until the next write or the end of the current event
loop step, whichever comes first, and then sends what it held together with that next write (one
``writelines``, so one system call). Bytes go out in the order written and never later than the end
of the step they were written in, so streams (SSE) and flow control behave as before; closing or
``write_eof`` first sends what is held, aborting drops it (as the transport's own buffer is dropped).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HoldOneWrite(asyncio.Transport):
    """A transport wrapper: a write waits for the next write or the end of the loop step, then both go
    out in one system call. Everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush_handle: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if self._held is None:
            # bytes(): the caller may reuse a bytearray once write() returns.
            self._held = bytes(data)
            self._flush_handle = self._loop.call_soon(self._flush)
            return
        held = self._take()
        self._transport.writelines([held, data])

    def writelines(self, list_of_data: Any) -> None:
        held = self._take() if self._held is not None else None
        lines = list(list_of_data)
        self._transport.writelines([held, *lines] if held is not None else lines)

    def _take(self) -> bytes:
        """What is held (there is something), no longer held nor scheduled."""
        held, self._held = self._held, None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        assert held is not None
        return held

    def _flush(self) -> None:
        self._flush_handle = None
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def flush(self) -> None:
        """Send what is held now."""
        if self._held is not None:
            self._transport.write(self._take())

    def close(self) -> None:
        self.flush()  # the transport sends its buffer before it closes; what is held goes first
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        if self._held is not None:
            self._take()
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + (len(self._held) if self._held is not None else 0)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through :class:`HoldOneWrite`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HoldOneWrite(transport, self.loop))
