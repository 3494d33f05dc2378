"""actors.mcp.http_protocol: the transport that sends a response's head with its body, over real sockets.

Every byte written arrives, in order, whether or not a second write follows; what is held goes out
by the end of the loop step it was written in, before a close, and not at all after an abort. The
MCP tests (test_mcp_tools, test_mcp_oauth, test_mcp_process...) run every answer through it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from actors.mcp.http_protocol import HoldOneWrite


class _Sink(asyncio.Protocol):
    """The peer: collects what arrives and notices the end of the stream."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.arrived = asyncio.Event()
        self.closed = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.arrived.set()

    def eof_received(self) -> bool | None:
        self.closed.set()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    async def until(self, size: int) -> bytes:
        while len(self.data) < size:
            self.arrived.clear()
            await self.arrived.wait()
        return bytes(self.data)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[HoldOneWrite, _Sink]]:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    _, sink = await loop.connect_accepted_socket(_Sink, theirs)
    held = HoldOneWrite(transport, loop)  # type: ignore[arg-type]
    yield held, sink
    held.abort()
    if not sink.closed.is_set():
        await sink.closed.wait()


async def test_head_and_body_arrive_in_order(pair: tuple[HoldOneWrite, _Sink]) -> None:
    held, sink = pair
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"
    held.write(bytearray(head))
    assert held.get_write_buffer_size() == len(head)  # held, counted as buffered
    held.write(b"hello")
    assert await sink.until(len(head) + 5) == head + b"hello"


async def test_a_lone_write_goes_out_at_the_end_of_the_step(pair: tuple[HoldOneWrite, _Sink]) -> None:
    held, sink = pair
    held.write(b"event: message\r\n\r\n")  # an SSE frame with nothing after it
    assert await sink.until(18) == b"event: message\r\n\r\n"
    held.write(b"a")
    held.write(b"b")
    held.write(b"c")  # held again after the pair went out
    held.writelines([b"d", b"e"])
    assert await sink.until(23) == b"event: message\r\n\r\nabcde"


async def test_close_sends_what_is_held_first(pair: tuple[HoldOneWrite, _Sink]) -> None:
    held, sink = pair
    held.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    held.close()
    await sink.closed.wait()
    assert bytes(sink.data) == b"HTTP/1.1 204 No Content\r\n\r\n"
    assert held.is_closing()


async def test_abort_drops_what_is_held(pair: tuple[HoldOneWrite, _Sink]) -> None:
    held, sink = pair
    held.write(b"never sent")
    held.abort()
    await sink.closed.wait()  # several loop steps: the held write's would have come first
    assert bytes(sink.data) == b""
