"""The corpus writer's command path: ping round trip, deadlines, unknown commands, identity refusal,
foreign commands refused and dead-lettered, the single-corpus topology's binding removed."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

import orjson
import pytest

from actors.writer import CorpusWriter, writer_queue
from infra.bus.base import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_REASON_HEADER,
    Bus,
    Delivery,
    QueueKind,
    QueueSpec,
)
from infra.db import CorpusIdentity, Database, ensure_identity
from protocol.commands import WriteCommand
from protocol.errors import LineageMismatch, Unroutable
from protocol.messages import BusMessage, ErrorReply, Ping, Pong, Probe, register
from protocol.routing import LEGACY_WRITER_QUEUE, CorpusScope

#: The corpus of the writers under test (each test's writer queue is then its own).
IDENTITY = CorpusIdentity(uuid.uuid4(), uuid.uuid4())
SCOPE = IDENTITY.scope
WRITER_QUEUE = writer_queue(SCOPE)


async def ask(bus: Bus, message: BusMessage, *, timeout: float = 10, scope: CorpusScope = SCOPE,
              operation: str | None = None) -> Delivery:
    """A command of ``scope``'s corpus, as an ingress sends it: corpus routing key and headers."""
    return await bus.request(COMMANDS_EXCHANGE, scope.command_key(operation or message.TYPE), message,
                             timeout=timeout, headers=scope.headers())


async def test_ping_round_trip(bus: Bus) -> None:
    writer = CorpusWriter(bus, node_id="writer-under-test", identity=IDENTITY)
    await writer.start()
    try:
        nonce = uuid.uuid4().hex
        reply = await ask(bus, Ping(nonce=nonce))
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
    writer = CorpusWriter(bus, node_id="w", identity=IDENTITY)
    await writer.start()
    try:
        reply = await ask(bus, Probe(n=4242))
        assert isinstance(reply.message, ErrorReply)
        assert reply.message.code == "unknown_command" and reply.message.status == 400
        async with asyncio.timeout(10):
            d = await seen
        assert "no handler for command type 'system.probe'" in str(d.headers[DEAD_REASON_HEADER])
    finally:
        await writer.stop(grace=2)
        await watcher.drain(1)


async def test_a_writer_whose_identity_check_failed_takes_no_commands(bus: Bus) -> None:
    """It could only refuse them, and would take them from a healthy writer of the same corpus."""
    writer = CorpusWriter(bus, node_id="w", identity=None, identity_error=LineageMismatch("lineage differs"))
    await writer.start()
    try:
        # Its configured corpus, whichever it is, gets no queue and no binding from it.
        with pytest.raises(Unroutable):
            await ask(bus, Ping(nonce="x"), scope=CorpusIdentity(uuid.uuid4(), uuid.uuid4()).scope)
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
    writer = CorpusWriter(bus, node_id="w", identity=IDENTITY, prefetch=1)
    await writer.start()
    try:
        await bus.publish(COMMANDS_EXCHANGE, SCOPE.command_key(Probe.TYPE), Probe(n=1),
                          headers={**SCOPE.headers(), "x-deadline": int((time.time() - 5) * 1000)})
        reply = await ask(bus, Probe(n=2))
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


async def _watch_dead(bus: Bus, want: Callable[[Delivery], bool], *,
                      queue: str = WRITER_QUEUE.name) -> tuple[asyncio.Future[Delivery], Any]:
    dead = await bus.declare_queue(QueueSpec(f"test.dead.{uuid.uuid4().hex[:8]}", QueueKind.NODE))
    await bus.bind(dead, DEAD_EXCHANGE, queue)
    seen: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()

    async def on_dead(d: Delivery) -> None:
        if want(d) and not seen.done():
            seen.set_result(d)

    return seen, await bus.consume(dead, on_dead, prefetch=10)


async def test_undecodable_command_is_answered_at_once_and_dead_lettered(bus: Bus) -> None:
    dead = await bus.declare_queue(QueueSpec(f"test.dead.{uuid.uuid4().hex[:8]}", QueueKind.NODE))
    await bus.bind(dead, DEAD_EXCHANGE, WRITER_QUEUE.name)
    writer = CorpusWriter(bus, node_id="w", identity=IDENTITY)
    await writer.start()
    try:
        # The deadline is far away: an answer within it can only be the immediate error reply.
        reply = await ask(bus, _unchecked_fussy(-1), timeout=60)
        assert isinstance(reply.message, ErrorReply)
        assert (reply.message.status, reply.message.code) == (400, "undecodable_command")
        # The dead letter cannot be decoded either, so it is read raw.
        raw = await bus.fetch_raw(dead, timeout=10)  # type: ignore[attr-defined]
        assert raw is not None and raw.type_name == Fussy.TYPE
        assert "n must not be negative" in str(raw.headers[DEAD_REASON_HEADER])
    finally:
        await writer.stop(grace=2)


async def _refused_and_dead_lettered(bus: Bus, db: Database, command: WriteCommand) -> tuple[ErrorReply, str]:
    """Send ``command`` straight to a writer of the database's corpus (as a forged or outdated sender
    would); return the writer's error reply and the reason of the dead letter it left, and check
    that nothing was written."""
    identity = await ensure_identity(db, None, None)
    seen, watcher = await _watch_dead(bus, lambda d: isinstance(d.message, WriteCommand),
                                      queue=writer_queue(identity.scope).name)
    writer = CorpusWriter(bus, node_id="w", db=db, identity=identity)
    await writer.start()
    try:
        reply = await ask(bus, command, timeout=60, scope=identity.scope, operation=command.operation)
        assert isinstance(reply.message, ErrorReply), reply.message
        async with asyncio.timeout(10):
            dead = await seen
        assert await db.pool.fetchval("select count(*) from changes") == 0
        return reply.message, str(dead.headers[DEAD_REASON_HEADER])
    finally:
        await writer.stop(grace=2)
        await watcher.drain(1)


async def test_write_failing_validation_past_the_edge_is_answered_and_dead_lettered(bus: Bus, db: Database) -> None:
    forged = WriteCommand(operation="conversation.create", target=None, body={"subject": "", "content": "x"},
                          author_id=str(uuid.uuid4()), author_name="nobody", token="t-1")
    reply, reason = await _refused_and_dead_lettered(bus, db, forged)
    assert (reply.status, reply.code) == (422, "validation_failed")
    assert reply.extra == {"field": "subject"}
    assert "failed validation past the edge" in reason


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
        replies = await asyncio.gather(*(ask(bus, c, timeout=20, scope=identity.scope, operation=c.operation)
                                         for c in commands))
        assert all(r.message.status == 201 for r in replies)  # type: ignore[attr-defined]
        assert await db.pool.fetchval("select count(*) from changes") == 5
        assert await db.pool.fetchval("select count(distinct xmin::text) from changes") == 1
    finally:
        await writer.stop(grace=2)


async def test_a_batch_with_an_unknown_author_commits_the_rest_and_every_change_has_a_trace_id(
        bus: Bus, db: Database) -> None:
    """One transaction (the write budget on, as in production) for three commands: the two of an
    agent commit, the one of an unknown author is refused alone, and the batch is not retried
    command by command. A command whose ``x-trace-id`` is no trace id (20,000 characters), or that
    has none, gets a fresh one: every change, hence every event, carries a well-formed trace id."""
    from infra.ratelimit import write_budget

    identity = await ensure_identity(db, None, None)
    author = uuid.uuid4()
    await db.pool.execute("insert into agents (agent_id, name, credential_hash) values ($1, 'traced', $2)",
                          author, hashlib.sha256(b"a third fake credential").digest())
    writer = CorpusWriter(bus, node_id="w", db=db, identity=identity, max_batch=3, linger=30,
                          write_budget=write_budget(100))
    await writer.start()
    try:
        def command(author_id: uuid.UUID, token: str) -> WriteCommand:
            return WriteCommand(operation="conversation.create", target=None, body={"subject": token, "content": "c"},
                                author_id=str(author_id), author_name="traced", token=token)

        sends = [(command(author, "t-junk"), {"x-trace-id": "x" * 20_000}), (command(author, "t-none"), {}),
                 (command(uuid.uuid4(), "t-stranger"), {"x-trace-id": "f00dfeedf00dfeed"})]
        replies = await asyncio.gather(*(
            bus.request(COMMANDS_EXCHANGE, identity.scope.command_key(c.operation), c, timeout=30,
                        headers={**identity.scope.headers(), **h}) for c, h in sends))
        statuses = [getattr(r.message, "status", None) for r in replies]
        assert statuses == [201, 201, 401], [r.message for r in replies]
        rows = await db.pool.fetch("select trace_id, xmin::text as x from changes")
        assert len(rows) == 2 and len({r["x"] for r in rows}) == 1
        assert all(re.fullmatch(r"[A-Za-z0-9_-]{8,64}", r["trace_id"] or "") for r in rows), rows
    finally:
        await writer.stop(grace=2)


async def test_a_foreign_command_is_refused_dead_lettered_and_never_applied(bus: Bus, db: Database) -> None:
    """Commands that reach this corpus's writer queue but name another corpus or history (or none)
    in their headers, as a hand-published or misbound command would: each is answered 503
    ``lineage_unavailable`` (not 500) by a reply carrying this corpus's headers, is dead-lettered
    with the reason, and writes nothing; a command of this corpus still goes through."""
    identity = await ensure_identity(db, None, None)
    scope = identity.scope
    author = uuid.uuid4()
    await db.pool.execute("insert into agents (agent_id, name, credential_hash) values ($1, 'native', $2)",
                          author, hashlib.sha256(b"another fake credential").digest())
    seen: list[Delivery] = []
    got_all = asyncio.Event()

    def want(d: Delivery) -> bool:
        seen.append(d)
        if len(seen) == 3:
            got_all.set()
        return False

    _, watcher = await _watch_dead(bus, want, queue=writer_queue(scope).name)
    writer = CorpusWriter(bus, node_id="w", db=db, identity=identity)
    await writer.start()

    def command(token: str) -> WriteCommand:
        return WriteCommand(operation="conversation.create", target=None, body={"subject": "s", "content": "c"},
                            author_id=str(author), author_name="native", token=token)

    other_corpus = CorpusScope(str(uuid.uuid4()), scope.lineage).headers()
    other_lineage = CorpusScope(scope.corpus_id, str(uuid.uuid4())).headers()
    try:
        for token, headers in (("t-corpus", other_corpus), ("t-lineage", other_lineage), ("t-none", {})):
            reply = await bus.request(COMMANDS_EXCHANGE, scope.command_key("conversation.create"), command(token),
                                      timeout=30, headers=headers)
            assert isinstance(reply.message, ErrorReply), token
            assert (reply.message.status, reply.message.code) == (503, "lineage_unavailable"), token
            assert scope.refusal(reply.headers) is None  # the writer names its own corpus
        async with asyncio.timeout(10):
            await got_all.wait()
        reasons = sorted(str(d.headers[DEAD_REASON_HEADER]) for d in seen)
        assert all(r.startswith("foreign message:") for r in reasons), reasons
        assert any("x-corpus-id is" in r for r in reasons) and any("x-corpus-lineage is" in r for r in reasons)
        assert any("is missing" in r for r in reasons)
        assert await db.pool.fetchval("select count(*) from changes") == 0
        ok = await ask(bus, command("t-native"), timeout=30, scope=scope, operation="conversation.create")
        assert ok.message.status == 201  # type: ignore[attr-defined]
        assert scope.refusal(ok.headers) is None
    finally:
        await writer.stop(grace=2)
        await watcher.drain(1)


async def test_the_writer_unbinds_the_single_corpus_queue(bus: Bus) -> None:
    """An upgrade leaves ``tm.commands.writer`` bound ``#``; the first new writer cuts it off, so it
    stops collecting a copy of every corpus's commands (commands sent before stay for the operator)."""
    legacy = await bus.declare_queue(QueueSpec(LEGACY_WRITER_QUEUE, QueueKind.WORK))
    try:
        await bus.bind(legacy, COMMANDS_EXCHANGE, "#")
        await bus.publish(COMMANDS_EXCHANGE, "before.upgrade", Probe(n=1))
        writer = CorpusWriter(bus, node_id="w", identity=IDENTITY)
        await writer.start()
        try:
            await bus.publish(COMMANDS_EXCHANGE, SCOPE.command_key(Probe.TYPE), Probe(n=2), headers=SCOPE.headers())
            await bus.publish("", legacy, Probe(n=3))  # a sentinel behind anything that still arrived
            numbers = []
            for _ in range(2):
                raw = await bus.fetch_raw(legacy, timeout=10)  # type: ignore[attr-defined]
                assert raw is not None
                numbers.append(orjson.loads(raw.body)["n"])
            assert numbers == [1, 3]
        finally:
            await writer.stop(grace=2)
    finally:
        await bus.delete_queue(legacy)  # type: ignore[attr-defined]


async def test_a_command_of_an_unknown_author_is_refused_alone_and_dead_lettered(
        bus: Bus, db: Database, caplog: pytest.LogCaptureFixture) -> None:
    """A command of this corpus whose author this database does not know (forged on the broker, or
    a command of another corpus's agent) is refused 401 ``unknown_agent``, never 500, writes nothing,
    is kept in the dead letters with the reason, and logs no traceback or SQL (the database's
    foreign-key refusal used to fail the whole batch and be logged with its detail)."""
    stranger = WriteCommand(operation="conversation.create", target=None, body={"subject": "s", "content": "c"},
                            author_id=str(uuid.uuid4()), author_name="stranger", token="t-unknown-author")
    reply, reason = await _refused_and_dead_lettered(bus, db, stranger)
    assert (reply.status, reply.code) == (401, "unknown_agent"), reply
    assert reason.startswith("unknown author")
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert not any("violates" in r.getMessage() for r in caplog.records)
