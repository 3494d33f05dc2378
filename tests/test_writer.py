"""The corpus writer's command path: ping round trip, deadlines, unknown commands, identity refusal."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from actors.writer import WRITER_QUEUE, CorpusWriter
from infra.bus.base import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_REASON_HEADER,
    Bus,
    Delivery,
    QueueKind,
    QueueSpec,
)
from infra.db import Database, ensure_identity
from protocol.commands import WriteCommand
from protocol.errors import LineageMismatch
from protocol.messages import BusMessage, ErrorReply, Ping, Pong, Probe, register


async def test_ping_round_trip(bus: Bus) -> None:
    writer = CorpusWriter(bus, node_id="writer-under-test")
    await writer.start()
    try:
        nonce = uuid.uuid4().hex
        reply = await bus.request(COMMANDS_EXCHANGE, Ping.TYPE, Ping(nonce=nonce), timeout=10)
        assert reply.message == Pong(nonce=nonce, responder="writer-under-test")
    finally:
        await writer.stop(grace=2)


async def test_unknown_command_gets_an_error_reply_and_is_dead_lettered(bus: Bus) -> None:
    dead = await bus.declare_queue(QueueSpec(f"test.dead.{uuid.uuid4().hex[:8]}", QueueKind.NODE))
    await bus.bind(dead, DEAD_EXCHANGE, WRITER_QUEUE.name)
    seen: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()

    async def on_dead(d: Delivery) -> None:
        if isinstance(d.message, Probe) and d.message.n == 4242 and not seen.done():
            seen.set_result(d)

    watcher = await bus.consume(dead, on_dead, prefetch=10)
    writer = CorpusWriter(bus, node_id="w")
    await writer.start()
    try:
        reply = await bus.request(COMMANDS_EXCHANGE, Probe.TYPE, Probe(n=4242), timeout=10)
        assert isinstance(reply.message, ErrorReply)
        assert reply.message.code == "unknown_command" and reply.message.status == 400
        async with asyncio.timeout(10):
            d = await seen
        assert "no handler for command type 'system.probe'" in str(d.headers[DEAD_REASON_HEADER])
    finally:
        await writer.stop(grace=2)
        await watcher.drain(1)


async def test_identity_mismatch_refuses_commands(bus: Bus) -> None:
    writer = CorpusWriter(bus, node_id="w", identity_error=LineageMismatch("lineage differs"))
    await writer.start()
    try:
        reply = await bus.request(COMMANDS_EXCHANGE, Ping.TYPE, Ping(nonce="x"), timeout=10)
        assert isinstance(reply.message, ErrorReply)
        assert (reply.message.status, reply.message.code) == (503, "lineage_unavailable")
    finally:
        await writer.stop(grace=2)


async def test_expired_commands_are_skipped(bus: Bus) -> None:
    """Work whose requester already gave up is acked without effect; the next command is served.

    The writer runs with prefetch 1, so it handles commands strictly in order: had it handled the
    expired command, that command's dead letter would arrive before the live one's.
    """
    dead = await bus.declare_queue(QueueSpec(f"test.dead.{uuid.uuid4().hex[:8]}", QueueKind.NODE))
    await bus.bind(dead, DEAD_EXCHANGE, WRITER_QUEUE.name)
    first: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_dead(d: Delivery) -> None:
        if isinstance(d.message, Probe) and d.message.n in (1, 2) and not first.done():
            first.set_result(d.message.n)

    watcher = await bus.consume(dead, on_dead, prefetch=10)
    writer = CorpusWriter(bus, node_id="w", prefetch=1)
    await writer.start()
    try:
        await bus.publish(COMMANDS_EXCHANGE, Probe.TYPE, Probe(n=1),
                          headers={"x-deadline": int((time.time() - 5) * 1000)})
        reply = await bus.request(COMMANDS_EXCHANGE, Probe.TYPE, Probe(n=2), timeout=10)
        assert isinstance(reply.message, ErrorReply)
        async with asyncio.timeout(10):
            assert await first == 2
    finally:
        await writer.stop(grace=2)
        await watcher.drain(1)


@register
@dataclasses.dataclass(frozen=True, slots=True)
class Fussy(BusMessage):
    """A test command whose decoder refuses negative numbers: how a receiver meets a body it cannot decode."""

    TYPE: ClassVar[str] = "test.fussy"
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must not be negative")


def _unchecked_fussy(n: int) -> Fussy:
    # The sender's copy skips the check (an older or foreign sender); the receiver's decoder applies it.
    message = object.__new__(Fussy)
    object.__setattr__(message, "n", n)
    return message


async def _watch_dead(bus: Bus, want: Callable[[Delivery], bool]) -> tuple[asyncio.Future[Delivery], Any]:
    dead = await bus.declare_queue(QueueSpec(f"test.dead.{uuid.uuid4().hex[:8]}", QueueKind.NODE))
    await bus.bind(dead, DEAD_EXCHANGE, WRITER_QUEUE.name)
    seen: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()

    async def on_dead(d: Delivery) -> None:
        if want(d) and not seen.done():
            seen.set_result(d)

    return seen, await bus.consume(dead, on_dead, prefetch=10)


async def test_undecodable_command_is_answered_at_once_and_dead_lettered(bus: Bus) -> None:
    dead = await bus.declare_queue(QueueSpec(f"test.dead.{uuid.uuid4().hex[:8]}", QueueKind.NODE))
    await bus.bind(dead, DEAD_EXCHANGE, WRITER_QUEUE.name)
    writer = CorpusWriter(bus, node_id="w")
    await writer.start()
    try:
        # The deadline is far away: an answer within it can only be the immediate error reply.
        reply = await bus.request(COMMANDS_EXCHANGE, Fussy.TYPE, _unchecked_fussy(-1), timeout=60)
        assert isinstance(reply.message, ErrorReply)
        assert (reply.message.status, reply.message.code) == (400, "undecodable_command")
        # The dead letter cannot be decoded either, so it is read raw.
        raw = await bus.fetch_raw(dead, timeout=10)  # type: ignore[attr-defined]
        assert raw is not None and raw.type_name == Fussy.TYPE
        assert "n must not be negative" in str(raw.headers[DEAD_REASON_HEADER])
    finally:
        await writer.stop(grace=2)


async def test_write_failing_validation_past_the_edge_is_answered_and_dead_lettered(bus: Bus, db: Database) -> None:
    identity = await ensure_identity(db, None, None)
    seen, watcher = await _watch_dead(bus, lambda d: isinstance(d.message, WriteCommand))
    writer = CorpusWriter(bus, node_id="w", db=db, identity=identity)
    await writer.start()
    try:
        forged = WriteCommand(operation="conversation.create", target=None, body={"subject": "", "content": "x"},
                              author_id=str(uuid.uuid4()), author_name="nobody", token="t-1")
        reply = await bus.request(COMMANDS_EXCHANGE, forged.operation, forged, timeout=60)
        assert isinstance(reply.message, ErrorReply)
        assert (reply.message.status, reply.message.code) == (422, "validation_failed")
        assert reply.message.extra == {"field": "subject"}
        async with asyncio.timeout(10):
            d = await seen
        assert "failed validation past the edge" in str(d.headers[DEAD_REASON_HEADER])
        assert await db.pool.fetchval("select count(*) from changes") == 0
    finally:
        await writer.stop(grace=2)
        await watcher.drain(1)


async def test_group_commit_applies_a_burst_in_one_transaction(bus: Bus, db: Database) -> None:
    """With a linger, commands arriving together share one transaction (one xmin), each its own change."""
    identity = await ensure_identity(db, None, None)
    author = uuid.uuid4()
    await db.pool.execute("insert into agents (agent_id, name, credential_hash) values ($1, 'batcher', $2)",
                          author, hashlib.sha256(b"not a real credential").digest())
    writer = CorpusWriter(bus, node_id="w", db=db, identity=identity, max_batch=5, linger=30)
    await writer.start()
    try:
        commands = [WriteCommand(operation="conversation.create", target=None,
                                 body={"subject": f"s{i}", "content": "c"}, author_id=str(author),
                                 author_name="batcher", token=f"t-{i}") for i in range(5)]
        # The batch is full at 5, so it commits at once: the 30 s linger is never waited out.
        replies = await asyncio.gather(*(bus.request(COMMANDS_EXCHANGE, c.operation, c, timeout=20)
                                         for c in commands))
        assert all(r.message.status == 201 for r in replies)  # type: ignore[attr-defined]
        assert await db.pool.fetchval("select count(*) from changes") == 5
        assert await db.pool.fetchval("select count(distinct xmin::text) from changes") == 1
    finally:
        await writer.stop(grace=2)
