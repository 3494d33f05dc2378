"""``GET /corpus/stream`` over real HTTP: catch-up, live hand-over, resume, filters, errors, slow clients.

The stack (tests/corpus_fixtures.py) runs the web front with its notification hub and a corpus
writer; the event publisher moves committed changes onto ``tm.events`` and, one batch per window,
onto the hubs' internal exchange, from where the hub fans them out. Every test runs on the embedded database with the in-process bus and on PostgreSQL with RabbitMQ.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.corpus_fixtures import Agent, Stack, publishing
from tests.sse import Frame, frames


async def _sequences(stack: Stack) -> list[int]:
    return [r["sequence"] for r in await stack.db.pool.fetch("select sequence from changes order by sequence")]


async def _open(stack: Stack, query: str = "", headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
    resp = await stack.client.get("/corpus/stream" + query, headers=headers or {}, timeout=aiohttp.ClientTimeout(total=None))
    return resp


async def _until_ready(reader: AsyncIterator[Frame], timeout: float = 30) -> list[Frame]:
    """Read frames up to and including ``ready``; return them."""
    got: list[Frame] = []
    async with asyncio.timeout(timeout):
        async for frame in reader:
            got.append(frame)
            if frame.event == "ready":
                return got
    raise AssertionError(f"the stream ended before ready: {[f.event for f in got]}")


async def _write(stack: Stack, agent: Agent, cid: str, n: int) -> None:
    for i in range(n):
        await stack.message(agent, cid, content=f"m{i}")


async def _collect(resp: aiohttp.ClientResponse, until: int, frames_out: list[Frame], timeout: float = 30) -> None:
    """Read frames until one with sequence ``until`` arrived."""
    async with asyncio.timeout(timeout):
        async for frame in frames(resp):
            frames_out.append(frame)
            if frame.id is not None and int(frame.id) >= until:
                return


async def test_catch_up_then_ready_then_live_without_gap_or_duplicate(stack: Stack) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    await _write(stack, alice, cid, 5)
    async with publishing(stack):
        resp = await _open(stack, "?after=0")
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["Cache-Control"] == "no-store" and resp.headers["X-Accel-Buffering"] == "no"
        reader = frames(resp)
        got = await _until_ready(reader)
        assert any("retry 3000" in c for c in got[0].comments)
        caught_up = [int(f.id) for f in got if f.id is not None]
        assert caught_up == await _sequences(stack)
        assert got[-1].json() == {"sequence": caught_up[-1]}
        # Live: writes keep arriving after ready.
        writer = asyncio.create_task(_write(stack, alice, cid, 10))
        live: list[Frame] = []
        async with asyncio.timeout(30):
            async for frame in reader:
                live.append(frame)
                if len([f for f in live if f.id]) == 10:
                    break
        await writer
        all_ids = caught_up + [int(f.id) for f in live if f.id is not None]
        assert all_ids == await _sequences(stack)
        first = live[0]
        assert first.event == "message.appended"
        envelope = first.json()
        assert envelope["sequence"] == int(first.id or -1) and envelope["type"] == "message.appended"
        resp.close()


async def test_without_a_cursor_the_stream_starts_at_the_head(stack: Stack) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    await _write(stack, alice, cid, 3)
    head = (await _sequences(stack))[-1]
    async with publishing(stack):
        resp = await _open(stack)
        reader = frames(resp)
        got = await _until_ready(reader)
        assert got[-1].json() == {"sequence": head}
        assert all(f.id is None for f in got), "a stream without a cursor must not replay history"
        await stack.message(alice, cid, content="new")
        async with asyncio.timeout(30):
            async for frame in reader:
                if frame.id is not None:
                    assert int(frame.id) > head
                    break
        resp.close()


@pytest.mark.stack_env(TOASTMACHINE_STREAM_HEARTBEAT="0.1")
async def test_resume_with_last_event_id_at_random_points_applies_every_sequence_once(stack: Stack) -> None:
    """The SPEC's resume contract, while writes keep arriving, across catch-up/live hand-overs."""
    rng = random.Random(7)
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    await _write(stack, alice, cid, 20)
    total = 120
    applied: list[int] = []
    async with publishing(stack):
        writer = asyncio.create_task(_write(stack, alice, cid, total))
        last: int | None = None
        try:
            while not writer.done() or (applied and applied[-1] < (await _sequences(stack))[-1]):
                headers = {"Last-Event-ID": str(last)} if last is not None else {}
                resp = await _open(stack, "" if last is not None else "?after=0", headers)
                budget = rng.randint(1, 25)  # drop the connection after this many changes
                async with asyncio.timeout(30):
                    async for frame in frames(resp):
                        if frame.id is not None:
                            applied.append(int(frame.id))
                            last = int(frame.id)
                            budget -= 1
                        # Heartbeats (every 0.1 s here) bring the loop back to this check when idle.
                        if budget == 0 or (writer.done() and last == (await _sequences(stack))[-1]):
                            break
                resp.close()
        finally:
            await writer
    assert applied == await _sequences(stack)


async def _publish_batch(stack: Stack, after: int, sequences: list[int]) -> None:
    """Publish the history's changes ``sequences`` to the hubs as one batch after ``after``, as the
    publisher would (no publisher runs in these tests: the test is the publisher)."""
    from protocol.events import ChangeBatch
    from protocol.routing import HUB_ROUTING_KEY

    rows = await stack.db.pool.fetch("select sequence, type, partition, event from changes "
                                     "where sequence = any($1::bigint[]) order by sequence", sequences)
    scope = stack.identity.scope
    batch = ChangeBatch(scope.corpus_id, scope.lineage, after,
                        [[r["sequence"], r["type"], r["partition"], r["event"]] for r in rows])
    await stack.bus.publish(scope.hub_exchange, HUB_ROUTING_KEY, batch, headers=scope.headers())


async def _take_until(sub: Any, sequence: int) -> list[Any]:
    """The changes a hub subscription hands over (heartbeats left out) up to ``sequence``."""
    got: list[Any] = []
    async with asyncio.timeout(30):
        while not got or got[-1][0].sequence < sequence:
            items = await sub.take(1000)
            assert items is not None, "the subscription ended"
            got.extend(item for item in items if item[0] is not None)
    return got


async def test_a_hub_fed_by_batches_passes_every_change_once_in_order_and_reads_lost_ones(stack: Stack) -> None:
    """Batches reach the hub twice (a publisher take-over republishes) or not at all (a bounded
    node queue, a failed publish): the hub passes each sequence on once, in order, reading a hole
    from the history exactly when a batch's ``after`` lies above the last change it passed on."""
    from actors.history import changes_after
    from actors.hub import sse_frame
    from actors.web.stream import HUB

    hub = stack.client.app[HUB]
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    await _write(stack, alice, cid, 6)
    seq = await _sequences(stack)
    resp = await _open(stack, f"?after={seq[-1]}")
    reader = frames(resp)
    await _until_ready(reader)
    async with hub.subscribe() as sub:
        await _publish_batch(stack, 0, seq[:2])        # the first batch the hub sees starts it
        await _publish_batch(stack, seq[1], seq[2:4])  # contiguous: no reading
        await _publish_batch(stack, 0, seq[:4])        # republished: every change a duplicate
        got = await _take_until(sub, seq[3])
        assert hub.holes_read == 0
        # The batch of seq[4:] is lost; the next one shows the hole through its ``after``.
        await _write(stack, alice, cid, 2)
        newer = (await _sequences(stack))[len(seq):]
        await _publish_batch(stack, seq[-1], newer)
        got += await _take_until(sub, newer[-1])
        assert hub.holes_read == 1
    history = await changes_after(stack.db, 0)
    assert [c.sequence for c, _ in got] == [c.sequence for c in history]
    # The frames are the history's own text, whether they came in a batch or from a hole.
    assert [frame for _, frame in got] == [sse_frame(c) for c in history]
    # And an open stream got the live ones (those after its start) once each, in order.
    live: list[int] = []
    async with asyncio.timeout(30):
        async for frame in reader:
            if frame.id is not None:
                live.append(int(frame.id))
                if live[-1] == newer[-1]:
                    break
    assert live == newer
    resp.close()


async def test_a_hub_without_subscribers_encodes_nothing_and_reads_no_hole(stack: Stack) -> None:
    """With nobody to tell, the hub only notes the last sequence: a hole is not read (a subscriber
    that comes later reads the history after it subscribes), and nothing is handed out that
    arrived before a subscriber came."""
    from actors.web.stream import HUB

    hub = stack.client.app[HUB]
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    await _write(stack, alice, cid, 4)
    seq = await _sequences(stack)
    assert hub.subscribers == 0
    await _publish_batch(stack, 0, seq[:1])
    await _publish_batch(stack, seq[2], seq[3:4])  # a hole, seen by nobody
    # A confirmed publish is not yet a handled delivery (on RabbitMQ): wait for the hub to take both.
    async with asyncio.timeout(30):
        while hub.batches < 2:
            await asyncio.sleep(0.01)
    async with hub.subscribe(frames=False) as sub:
        await _publish_batch(stack, seq[3], seq[4:])
        got = await _take_until(sub, seq[-1])
    assert [c.sequence for c, _ in got] == seq[4:]
    assert hub.holes_read == 0 and hub.last_sequence == seq[-1]
    assert all(frame == b"" for _, frame in got)  # a subscriber that reads no frames gets none
    # A stream opened now has everything from the history.
    resp = await _open(stack, "?after=0")
    assert [int(f.id) for f in await _until_ready(frames(resp)) if f.id is not None] == seq
    resp.close()


async def test_filters(stack: Stack) -> None:
    alice = await stack.register()
    one = (await stack.conversation(alice, "one"))["conversation"]["id"]
    two = await stack.conversation(alice, "two")
    claim = await stack.message(alice, one, content="a claim", kinds=["claim"])
    await stack.message(alice, one, content="a post")
    await stack.post(alice, "/relationships", {"type": "extends", "source_message_id": claim["message"]["id"],
                                               "target_message_id": two["message"]["id"]})
    head = (await _sequences(stack))[-1]

    async def seen(query: str) -> list[Frame]:
        resp = await _open(stack, query)
        got = await _until_ready(frames(resp))
        resp.close()
        return [f for f in got if f.id is not None]

    async with publishing(stack):
        kinds = await seen("?after=0&kinds=claim")
        assert [f.json()["data"]["message"]["content"] for f in kinds] == ["a claim"]
        types = await seen("?after=0&types=relationship.asserted,conversation.created")
        assert [f.event for f in types] == ["conversation.created", "conversation.created", "relationship.asserted"]
        conv = await seen(f"?after=0&conversation={one}")  # the relationship's source is in "one"
        assert [f.event for f in conv] == ["conversation.created", "message.appended", "message.appended",
                                           "relationship.asserted"]
        assert head == int(types[-1].id or 0)


@pytest.mark.parametrize(("query", "headers", "field"), [
    ("?after=-1", {}, "after"), ("?after=abc", {}, "after"), ("?after=%C2%B2", {}, "after"), ("", {"Last-Event-ID": "x"}, "Last-Event-ID"),
    ("?types=nope", {}, "types"), ("?kinds=", {}, "kinds"), ("?conversation=42", {}, "conversation"),
    ("?colour=red", {}, "colour"), ("?types=message.appended,message.appended", {}, "types"),
    ("?types=", {}, "types"), ("?types=message.appended,", {}, "types"), ("?kinds=claim,claim", {}, "kinds"),
    ("?kinds=claim,", {}, "kinds"), ("?after=1000000", {}, "after"), ("", {"Last-Event-ID": "1000000"}, "Last-Event-ID"),
    ("?lineage=nope", {}, "lineage"),
])
async def test_bad_parameters_answer_400_with_the_envelope(stack: Stack, query: str, headers: dict[str, str],
                                                           field: str) -> None:
    resp = await _open(stack, query, headers)
    body: Any = await resp.json()
    assert resp.status == 400
    assert body["error"]["code"] == "invalid_parameter" and body["error"]["field"] == field


@pytest.mark.parametrize("accept", ["application/json", "text/html", "text/plain", "text/event-stream;q=0"])
async def test_a_client_that_accepts_no_event_stream_gets_406(stack: Stack, accept: str) -> None:
    resp = await _open(stack, "?after=0", {"Accept": accept})
    body: Any = await resp.json()
    assert resp.status == 406 and body["error"]["code"] == "not_acceptable" and resp.headers["Vary"] == "Accept"
    for fine in ("text/event-stream", "*/*", "text/*, application/json;q=0.5"):
        ok = await _open(stack, "?after=0", {"Accept": fine})
        assert ok.status == 200 and ok.headers["Content-Type"].startswith("text/event-stream"), fine
        ok.close()


@pytest.mark.stack_env(TOASTMACHINE_STREAM_HEARTBEAT="0.05")
async def test_idle_stream_sends_heartbeats(stack: Stack) -> None:
    async with publishing(stack):
        resp = await _open(stack, "?after=0")
        beats = 0
        async with asyncio.timeout(30):
            async for frame in frames(resp):
                beats += "heartbeat" in frame.comments
                if beats == 2:
                    break
        resp.close()


@pytest.mark.stack_env(TOASTMACHINE_STREAM_HEARTBEAT="0.2")
async def test_a_client_that_stops_reading_is_dropped_by_the_heartbeat_watchdog(stack: Stack) -> None:
    """No timer per write: the hub's ticker finds a stream blocked in the same socket write at two
    ticks in a row, cuts its subscription off and aborts the connection, long before its queue
    (1,000 changes) would overflow."""
    from actors.web.stream import HUB

    hub = stack.client.app[HUB]
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    async with publishing(stack):
        resp = await _open(stack)
        await _until_ready(frames(resp))
        (sub,) = hub._subscribers
        big = "x" * 60_000
        for _ in range(900):  # fewer than the queue holds: only the watchdog can end this stream
            await stack.message(alice, cid, content=big)
            if sub.closed:
                break
        assert sub.closed and sub.overflowed, "the stuck stream was never cut off"
        assert sub.pending < hub.subscriber_queue
        # The connection was aborted: reading on ends with an error or an incomplete body, never a
        # clean end of the stream.
        with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)):
            async with asyncio.timeout(60):
                async for _ in frames(resp):
                    pass


async def test_a_client_that_does_not_keep_up_is_cut_off_with_a_resume_hint(stack: Stack) -> None:
    """The hub's per-client queue is bounded: a stalled reader is cut off, memory stays flat.

    The client stops reading; big changes fill the socket buffers until the server's writes block,
    then the client's hub queue (3 changes here) overflows. When the client reads again it gets what
    was in flight and then the terminal ``stream-error`` telling it how to resume.
    """
    from actors.web.stream import HUB

    hub = stack.client.app[HUB]
    hub.subscriber_queue = 3
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    async with publishing(stack):
        resp = await _open(stack)
        reader = frames(resp)
        await _until_ready(reader)
        big = "x" * 60_000
        for _ in range(2_000):
            await stack.message(alice, cid, content=big)
            if any(sub.overflowed for sub in hub._subscribers):
                break
        assert any(sub.overflowed for sub in hub._subscribers), "the stalled client was never cut off"
        got: list[Frame] = []
        async with asyncio.timeout(60):
            async for frame in reader:
                got.append(frame)
        assert got[-1].event == "stream-error", [f.event for f in got[-3:]]
        error = got[-1].json()["error"]
        assert error["code"] == "slow_consumer" and "Last-Event-ID" in error["how_to_proceed"]
        assert hub.subscribers == 0


@pytest.mark.stack_env(TOASTMACHINE_STREAM_HEARTBEAT="0.1")
async def test_changes_whose_batches_were_all_lost_reach_the_streams_on_a_quiet_corpus(stack: Stack) -> None:
    """The hub's queue loses its binding (an operator's mistake; on RabbitMQ a real unbind), so the
    publisher's batches reach no one and no later batch shows the hole. The hub's ticker, seeing no
    batch for a heartbeat interval, reads the publisher's cursor and the hole below it: an open
    stream still gets every change once, in order."""
    from actors.web.stream import HUB
    hub = stack.client.app[HUB]
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    async with publishing(stack):  # the hub has passed the head on: it stands at the cursor
        async with asyncio.timeout(30):
            while hub.last_sequence != (await _sequences(stack))[-1]:
                await asyncio.sleep(0.01)
    head = (await _sequences(stack))[-1]
    resp = await _open(stack, f"?after={head}")
    reader = frames(resp)
    await _until_ready(reader)
    assert hub.queue_name is not None
    assert await stack.bus.unbind(hub.queue_name, stack.identity.scope.hub_exchange, "#")
    batches = hub.batches
    await _write(stack, alice, cid, 3)
    written = [s for s in await _sequences(stack) if s > head]
    got: list[int] = []
    async with publishing(stack):
        async with asyncio.timeout(30):
            async for frame in reader:
                if frame.id is not None:
                    got.append(int(frame.id))
                    if got[-1] == written[-1]:
                        break
    assert got == written
    assert hub.batches == batches  # none of them came as a batch
    assert hub.holes_read >= 1
    resp.close()
