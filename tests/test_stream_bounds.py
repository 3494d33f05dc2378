"""``GET /corpus/stream`` hardening: bounded catch-up, stream caps, strict resume points and lineage,
and the conversation filter over relationship events (live and in catch-up).

Runs on the write-path stack (tests/corpus_fixtures.py), on both backend pairs.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import uuid
from typing import Any

import aiohttp
import pytest

from tests.corpus_fixtures import Stack, publishing
from tests.sse import Frame, frames


async def _metric(stack: Stack, name: str) -> float:
    text = await (await stack.client.get("/metrics")).text()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def _until(predicate: Any, timeout: float = 30) -> None:
    """Wait until ``predicate()`` holds (checked every 20 ms, failing after ``timeout``)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def _ready(resp: aiohttp.ClientResponse, timeout: float = 30) -> list[Frame]:
    got: list[Frame] = []
    async with asyncio.timeout(timeout):
        async for frame in frames(resp):
            got.append(frame)
            if frame.event == "ready":
                return got
    raise AssertionError(f"no ready: {[f.event for f in got]}")


def _open(stack: Stack, query: str = "", headers: dict[str, str] | None = None) -> Any:
    return stack.client.get("/corpus/stream" + query, headers=headers or {},
                            timeout=aiohttp.ClientTimeout(total=None))


@pytest.mark.stack_env(TOASTMACHINE_STREAM_HEARTBEAT="0.3")
async def test_catch_up_stops_reading_the_history_when_the_client_stops_reading(stack: Stack) -> None:
    """A non-reading client on a long history: the server reads a few bounded pages, fills the
    socket, blocks, and is cut off by the watchdog; it never reads the history ahead of the socket."""
    from actors.web.stream import HUB

    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    big = "y" * 30_000
    history = 400
    for start in range(0, history, 25):
        await asyncio.gather(*(stack.message(alice, cid, content=big) for _ in range(min(25, history - start))))
    hub = stack.client.app[HUB]
    before = await _metric(stack, "toastmachine_stream_catchup_rows_total")
    host, port = stack.client.server.host, stack.client.server.port
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window; we never read it
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        await asyncio.get_running_loop().sock_sendall(
            sock, b"GET /corpus/stream?after=0 HTTP/1.1\r\nHost: node\r\n\r\n")
        await _until(lambda: hub.subscribers == 1)
        await _until(lambda: hub.subscribers == 0)  # stuck in a write: the watchdog cut it off
    read = await _metric(stack, "toastmachine_stream_catchup_rows_total") - before
    assert 0 < read < history / 2, f"{read} of {history} rows read for a client that read nothing"


@pytest.mark.stack_env(TOASTMACHINE_STREAM_MAX="2", TOASTMACHINE_STREAM_MAX_PER_CLIENT="10",
                       TOASTMACHINE_STREAM_HEARTBEAT="0.1")
async def test_the_node_cap_on_streams_answers_503_with_retry_after(stack: Stack) -> None:
    async with publishing(stack):
        open_ = [await _open(stack) for _ in range(2)]
        for resp in open_:
            assert resp.status == 200
            await _ready(resp)
        refused = await _open(stack)
        body = await refused.json()
        assert refused.status == 503 and refused.headers["Retry-After"] == "5"
        assert body["error"]["code"] == "too_many_streams" and body["error"]["retry_after"] == 5
        assert "Retry-After" in body["error"]["how_to_proceed"]
        open_[0].close()  # its slot is free once the server notices (at the next heartbeat at the latest)
        async with asyncio.timeout(30):
            while (again := await _open(stack)).status == 503:
                again.close()
                await asyncio.sleep(0.05)
        assert again.status == 200
        again.close()
        open_[1].close()
    assert 'toastmachine_stream_refused_total{cap="node"}' in await (await stack.client.get("/metrics")).text()


@pytest.mark.stack_env(TOASTMACHINE_STREAM_MAX_PER_CLIENT="1")
async def test_the_per_client_cap_on_streams_answers_503_with_retry_after(stack: Stack) -> None:
    async with publishing(stack):
        first = await _open(stack)
        await _ready(first)
        second = await _open(stack)
        assert second.status == 503 and second.headers["Retry-After"] == "5"
        assert (await second.json())["error"]["code"] == "too_many_streams"
        first.close()


@pytest.mark.stack_env(TOASTMACHINE_STREAM_MAX_PER_CLIENT="1", TOASTMACHINE_STREAM_HEARTBEAT="600")
async def test_a_dropped_stream_frees_its_slot_at_once_not_at_the_next_write(stack: Stack) -> None:
    """The client resets the connection as soon as the answer starts (a browser on a flaky network),
    and no change or heartbeat (ten minutes) is ever written to it: the handler is cancelled with
    the connection, so the client's one slot is free for its reconnect."""
    from actors.web.stream import STREAM_SLOTS

    slots = stack.client.app[STREAM_SLOTS]
    host, port = stack.client.server.host, stack.client.server.port
    async with publishing(stack):
        for attempt in range(5):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /corpus/stream HTTP/1.1\r\nHost: node\r\n\r\n")
            async with asyncio.timeout(10):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200"), attempt
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # RST: the server learns it only from the connection's loss
            await _until(lambda: slots.held == 0, timeout=20)
        again = await _open(stack)
        assert again.status == 200
        await _ready(again)
        again.close()


async def test_head_of_the_stream_is_headers_only_and_every_streamed_answer_has_a_trace_id(stack: Stack) -> None:
    """HEAD answers a GET's headers with no body (the connection stays usable for the next request),
    and the answers handlers stream themselves carry X-Trace-Id like every other."""
    alice = await stack.register()
    await stack.conversation(alice)
    host, port = stack.client.server.host, stack.client.server.port
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"HEAD /corpus/stream?after=0 HTTP/1.1\r\nHost: node\r\n\r\n"
                     b"GET /healthz HTTP/1.1\r\nHost: node\r\n\r\n")
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
            assert re.search(rb"(?im)^x-trace-id: \S+", head), head
            # Next on the wire: the second answer's status line, not stream bytes.
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            rest = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?im)^content-length: (\d+)", rest).group(1))  # type: ignore[union-attr]
            assert b'"ok"' in await reader.readexactly(length)
    finally:
        writer.close()
    async with publishing(stack):
        live = await _open(stack)
        assert live.status == 200 and live.headers.get("X-Trace-Id")
        live.close()
    for route in ("/corpus/changes.jsonl", "/corpus/snapshot.jsonl"):
        resp = await stack.client.get(route)
        assert resp.status == 200 and resp.headers.get("X-Trace-Id"), route
        await resp.read()


async def test_after_beyond_the_head_is_refused_with_guidance(stack: Stack) -> None:
    alice = await stack.register()
    await stack.conversation(alice)
    head = (await (await stack.client.get("/corpus")).json())["head_sequence"]
    resp = await _open(stack, f"?after={head + 1}")
    body = await resp.json()
    assert resp.status == 400 and body["error"]["field"] == "after"
    assert "GET /corpus" in body["error"]["how_to_proceed"] and "omit after" in body["error"]["how_to_proceed"]
    async with publishing(stack):
        at_head = await _open(stack, f"?after={head}")
        assert at_head.status == 200
        await _ready(at_head)
        at_head.close()


@pytest.mark.parametrize("route", ["/corpus/stream", "/corpus/changes.jsonl"])
async def test_lineage_is_checked_and_parameter_and_header_must_agree(stack: Stack, route: str) -> None:
    ours, other = str(stack.identity.lineage), str(uuid.uuid4())
    timeout = aiohttp.ClientTimeout(total=None)

    async def status(query: str, header: str | None = None) -> tuple[int, dict[str, Any]]:
        headers = {"X-Corpus-Lineage": header} if header else {}
        resp = await stack.client.get(route + query, headers=headers, timeout=timeout)
        try:
            if resp.status == 200:
                return 200, {}
            return resp.status, (await resp.json())["error"]
        finally:
            resp.close()

    async with publishing(stack):
        assert (await status(f"?lineage={ours}"))[0] == 200
        assert (await status("", ours))[0] == 200
        assert (await status(f"?lineage={ours}", ours))[0] == 200
        code, error = await status(f"?lineage={other}")
        assert (code, error["code"]) == (409, "lineage_mismatch")
        code, error = await status("", other)
        assert (code, error["code"]) == (409, "lineage_mismatch")
        code, error = await status(f"?lineage={ours}", other)
        assert (code, error["code"], error["field"]) == (400, "invalid_parameter", "lineage")


async def test_the_conversation_filter_includes_its_relationship_events(stack: Stack) -> None:
    alice = await stack.register()
    one = await stack.conversation(alice, "one")
    two = await stack.conversation(alice, "two")
    one_id, in_one, in_two = one["conversation"]["id"], one["message"]["id"], two["message"]["id"]

    async def relate(source: str, target: str, type_: str = "extends") -> str:
        reply = await stack.post(alice, "/relationships", {"type": type_, "source_message_id": source,
                                                           "target_message_id": target})
        assert reply.status == 201, reply.body
        return str(reply.body["relationship"]["id"])

    from_one = await relate(in_one, in_two)       # source in "one": in the filter
    await relate(in_two, in_one)                  # source in "two": not, though its target is in "one"
    async with publishing(stack):
        resp = await _open(stack, f"?after=0&conversation={one_id}")
        reader = frames(resp)
        caught_up: list[Frame] = []
        async with asyncio.timeout(30):
            async for frame in reader:
                if frame.event == "ready":
                    break
                if frame.id is not None:
                    caught_up.append(frame)
        assert [f.event for f in caught_up] == ["conversation.created", "relationship.asserted"]
        assert caught_up[-1].json()["data"]["relationship"]["id"] == from_one
        # Live: a new relationship from "one", one from "two", the retraction of the first, a message.
        live_rel = await relate(in_one, in_two, "supports")
        await relate(in_two, in_one, "supports")
        retracted = await stack.post(alice, f"/relationships/{from_one}/retractions", {})
        assert retracted.status == 201, retracted.body
        last = await stack.message(alice, one_id, content="the end")
        live: list[Frame] = []
        async with asyncio.timeout(30):
            async for frame in reader:
                if frame.id is not None:
                    live.append(frame)
                    if frame.event == "message.appended":
                        break
        resp.close()
    assert [f.event for f in live] == ["relationship.asserted", "relationship.retracted", "message.appended"]
    assert live[0].json()["data"]["relationship"]["id"] == live_rel
    assert live[1].json()["data"]["retraction"]["relationship_id"] == from_one
    assert live[2].json()["data"]["message"]["id"] == last["message"]["id"]


def _server_side(stack: Stack, sock: socket.socket) -> Any:
    """The node's handler of the connection ``sock`` is the client end of (None once it is closed)."""
    for handler in stack.client.server.runner.server.connections:  # type: ignore[union-attr]
        transport = handler.transport
        if transport is not None and transport.get_extra_info("peername") == sock.getsockname():
            return handler
    return None


async def _raw_stream(stack: Stack, query: str, *, until: bytes | None) -> socket.socket:
    """A stream on a raw socket with a small receive window; read up to ``until``, then never again."""
    host, port = stack.client.server.host, stack.client.server.port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    await loop.sock_sendall(sock, f"GET /corpus/stream{query} HTTP/1.1\r\nHost: node\r\n\r\n".encode())
    if until is not None:
        seen = b""
        async with asyncio.timeout(30):
            while until not in seen:
                chunk = await loop.sock_recv(sock, 65536)
                assert chunk, seen[-300:]
                seen += chunk
    return sock


@pytest.mark.stack_env(TOASTMACHINE_STREAM_HEARTBEAT="0.3")
async def test_a_live_client_cut_off_while_it_does_not_read_loses_its_connection_too(stack: Stack) -> None:
    """A live stream whose client stops reading overflows its hub queue and is cut off; its last
    bytes (the terminal event, the end of the body) then cannot drain. The node drops the
    connection within a bound instead of leaving it, and what is queued for it, open for good."""
    from actors.web.stream import FINISH_TIMEOUT, HUB

    hub = stack.client.app[HUB]
    hub.subscriber_queue = 3
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    async with publishing(stack):
        with await _raw_stream(stack, "", until=b"event: ready") as sock:
            (sub,) = hub._subscribers
            assert _server_side(stack, sock) is not None
            big = "x" * 60_000
            for _ in range(2_000):
                await stack.message(alice, cid, content=big)
                if sub.overflowed:
                    break
            assert sub.overflowed, "the client that stopped reading was never cut off"
            # Not a byte more is read: only the node can end this connection.
            await _until(lambda: _server_side(stack, sock) is None, timeout=FINISH_TIMEOUT + 15)
            await _until(lambda: hub.subscribers == 0, timeout=15)  # its handler unwinds after the close


@pytest.mark.stack_env(TOASTMACHINE_STREAM_HEARTBEAT="0.3")
async def test_a_catching_up_client_cut_off_mid_write_is_still_dropped_by_the_watchdog(stack: Stack) -> None:
    """A stream blocked in a catch-up write (its client stopped reading) whose hub queue overflows
    meanwhile: its subscription is closed, but the watchdog still sees the write stuck and drops
    the connection (it used to skip closed subscriptions, leaving the write blocked for good)."""
    from actors.web.stream import HUB

    hub = stack.client.app[HUB]
    hub.subscriber_queue = 3
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    big = "y" * 30_000
    for start in range(0, 200, 25):
        await asyncio.gather(*(stack.message(alice, cid, content=big) for _ in range(25)))
    # A heartbeat interval per tick: long enough for the overflow to come before the watchdog.
    hub.heartbeat = 600
    async with publishing(stack):
        with await _raw_stream(stack, "?after=0", until=None) as sock:
            await _until(lambda: hub.subscribers == 1)
            (sub,) = hub._subscribers
            await _until(lambda: sub.busy)
            while not sub.overflowed:
                await asyncio.gather(*(stack.message(alice, cid, content="live") for _ in range(5)))
            assert sub.closed and sub.busy
            for _ in range(2):  # two ticks finding the same write under way: stuck
                sub.tick()
            await _until(lambda: _server_side(stack, sock) is None, timeout=15)
            await _until(lambda: hub.subscribers == 0, timeout=15)


async def test_a_front_that_ended_its_streams_has_a_stream_still_starting_ended_too(stack: Stack) -> None:
    """The node stopping ends its front's subscriptions; a stream that subscribes after that (it was
    still starting) is ended as it subscribes, and another front's are left alone."""
    from actors.web.stream import HUB

    hub = stack.client.app[HUB]
    other = object()
    async with hub.subscribe(owner=other) as elsewhere:
        hub.end(stack.client.app)
        async with hub.subscribe(owner=stack.client.app) as late:
            assert late.closed and await late.take(10) is None
        assert not elsewhere.closed
