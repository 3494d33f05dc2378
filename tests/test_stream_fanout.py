"""The hub's fan-out to many streams: passes larger than one slice, live batches written by the hub
itself (the stream's sink), and the node's other work running between the slices of a pass.

Runs on the write-path stack (tests/corpus_fixtures.py), on both backend pairs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from actors.hub import FANOUT_SLICE, Batch
from actors.web.stream import HUB
from tests.corpus_fixtures import Stack, publishing
from tests.sse import Frame, frames

#: Streams in the many-streams test: more than two slices, so a pass spans three loop turns.
STREAMS = 2 * FANOUT_SLICE + 7


async def _ready(reader: AsyncIterator[Frame]) -> int:
    """Read up to ``ready``; the head it names."""
    async with asyncio.timeout(60):
        async for frame in reader:
            if frame.event == "ready":
                return int(frame.json()["sequence"])
    raise AssertionError("the stream ended before ready")


async def _ids_until(reader: AsyncIterator[Frame], last: int) -> list[int]:
    """The ids of the change frames up to and including sequence ``last``."""
    got: list[int] = []
    async with asyncio.timeout(60):
        async for frame in reader:
            if frame.id is not None:
                got.append(int(frame.id))
                if got[-1] >= last:
                    return got
    raise AssertionError(f"the stream ended after {got}")


@pytest.mark.stack_env(TOASTMACHINE_STREAM_MAX_PER_CLIENT=str(STREAMS + 10))
async def test_many_live_streams_each_get_their_changes_once_in_order(stack: Stack) -> None:
    """More streams than one slice of a pass, unfiltered and filtered, with bursts of concurrent
    writes (so batches hold several changes): every stream gets exactly the changes its filter
    passes, each once, in sequence order, whichever way (the hub's direct write or the stream's
    task) each batch went."""
    alice = await stack.register()
    first = (await stack.conversation(alice))["conversation"]["id"]
    second = (await stack.conversation(alice))["conversation"]["id"]
    # No connection limit: every stream holds its own connection for the whole test.
    async with publishing(stack), aiohttp.ClientSession(
            base_url=str(stack.client.make_url("")), connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None)) as session:
        queries = ["", "?types=message.appended", f"?conversation={second}"]
        responses = [await session.get("/corpus/stream" + queries[i % len(queries)]) for i in range(STREAMS)]
        readers = [frames(r) for r in responses]
        heads = await asyncio.gather(*(_ready(r) for r in readers))
        head = max(heads)
        assert min(heads) == head  # nothing was written while they opened
        for burst in range(4):
            await asyncio.gather(*(stack.message(alice, (first, second)[n % 2], content=f"b{burst}-{n}")
                                   for n in range(8)))
        rows = await stack.db.pool.fetch(
            "select sequence, type, conversation_id::text as conversation from changes where sequence > $1"
            " order by sequence", head)
        every = [r["sequence"] for r in rows]
        expected = {
            "": every,
            "?types=message.appended": [r["sequence"] for r in rows if r["type"] == "message.appended"],
            f"?conversation={second}": [r["sequence"] for r in rows if r["conversation"] == second],
        }
        assert len(expected[f"?conversation={second}"]) == 16
        got = await asyncio.gather(*(_ids_until(readers[i], expected[queries[i % len(queries)]][-1])
                                     for i in range(STREAMS)))
        for i, ids in enumerate(got):
            assert ids == expected[queries[i % len(queries)]], f"stream {i} ({queries[i % len(queries)]!r})"
        for r in responses:
            r.close()


async def test_a_pass_lets_other_work_run_between_its_slices(stack: Stack) -> None:
    """A pass over more subscribers than one slice serves one slice per loop turn: a callback that
    becomes ready during the first slice (as a write request's I/O would) runs before the second
    slice, not after the whole pass; every subscriber still gets the batch once."""
    hub = stack.client.app[HUB]
    loop = asyncio.get_running_loop()
    served: list[int] = []
    ran_after: list[int] = []
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]

    def sink_of(i: int):  # type: ignore[no-untyped-def]
        def sink(batch: Batch) -> bool:
            if not served:
                loop.call_soon(lambda: ran_after.append(len(served)))
            served.append(i)
            return True
        return sink

    async with publishing(stack), contextlib.AsyncExitStack() as subs_open:
        head = await stack.db.pool.fetchval("select max(sequence) from changes")
        async with asyncio.timeout(30):  # the hub has passed on what exists: the next pass is ours
            while hub.last_sequence != head:
                await asyncio.sleep(0.01)
        subs = [await subs_open.enter_async_context(hub.subscribe()) for _ in range(3 * FANOUT_SLICE)]
        for i, sub in enumerate(subs):
            sub.sink = sink_of(i)
        # Each subscriber's task parked in take() (they run before the write's answer comes back):
        # the hub then hands the batch to the sink.
        takers = [asyncio.create_task(sub.take(10)) for sub in subs]
        await stack.message(alice, cid, content="one")
        async with asyncio.timeout(30):
            while len(served) < len(subs):
                await asyncio.sleep(0.01)
        assert sorted(served) == list(range(len(subs)))  # each once
        assert ran_after == [FANOUT_SLICE]
        assert all(sub.pending == 0 for sub in subs)  # nothing was queued besides the sink
        for t in takers:
            t.cancel()


async def test_a_burst_of_changes_reaches_live_streams_once_in_order(stack: Stack) -> None:
    """Live streams open while changes pile up unpublished; then the publisher sends them all at
    once, so the hub's batches are big (bigger than one socket write of a stream, LIVE_BATCH, goes
    through the stream's task): every change still arrives once, in order, filtered or not."""
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    async with publishing(stack):
        async with asyncio.timeout(30):  # the stream starts at a head the hub has passed on
            while stack.client.app[HUB].last_sequence != await _head(stack):
                await asyncio.sleep(0.01)
    responses = [await stack.client.get("/corpus/stream" + q, timeout=aiohttp.ClientTimeout(total=None))
                 for q in ("", "?types=message.appended")]
    readers = [frames(r) for r in responses]
    head = (await asyncio.gather(*(_ready(r) for r in readers)))[0]
    for n in range(0, 300, 20):
        await asyncio.gather(*(stack.message(alice, cid, content=f"m{n + i}") for i in range(20)))
    expected = [r["sequence"] for r in await stack.db.pool.fetch(
        "select sequence from changes where sequence > $1 order by sequence", head)]
    assert len(expected) == 300
    async with publishing(stack):
        got = await asyncio.gather(*(_ids_until(r, expected[-1]) for r in readers))
    assert got == [expected, expected]
    for r in responses:
        r.close()


async def _head(stack: Stack) -> int:
    return int(await stack.db.pool.fetchval("select coalesce(max(sequence), 0) from changes"))
