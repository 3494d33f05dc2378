"""The bus's batch form of request/reply, on both buses: the writes of one event-loop turn travel as
one command message and come back as one reply, and every member keeps its own answer, error,
deadline and dead letter (an undecodable member is dead-lettered alone with its reason)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from typing import ClassVar

import orjson

from actors.commands import WRITE_BATCH, submit_write
from actors.writer import CorpusWriter, writer_queue
from infra.bus import MemoryBus
from infra.bus.base import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_REASON_HEADER,
    DEADLINE_HEADER,
    Bus,
    Delivery,
    Headers,
    HeaderValue,
    QueueKind,
    QueueSpec,
)
from infra.config import Settings
from infra.db import CorpusIdentity, Database, ensure_identity
from infra.ratelimit import local_bucket, write_budget
from protocol import corpus
from protocol.commands import WriteCommand, WriteResult
from protocol.errors import LineageMismatch, RequestTimeout
from protocol.messages import BusMessage, ErrorReply, Ping, Pong, RequestBatch, encode_message, register

WAIT = 30.0


@register
@dataclasses.dataclass(frozen=True, slots=True)
class Picky(BusMessage):
    """A test command whose decoder refuses an empty label: a member the receiving bus cannot decode."""

    TYPE: ClassVar[str] = "test.picky"
    label: str

    def __post_init__(self) -> None:
        if not self.label:
            raise ValueError("label must not be empty")


async def _author(db: Database) -> str:
    author = uuid.uuid4()
    await db.pool.execute("insert into agents (agent_id, name, credential_hash) values ($1, 'batcher', $2)",
                          author, hashlib.sha256(author.bytes).digest())
    return str(author)


def _create(author: str, token: str, subject: str = "s") -> WriteCommand:
    return WriteCommand(operation="conversation.create", target=None, body={"subject": subject, "content": "c"},
                        author_id=author, author_name="batcher", token=token)


async def _spy(bus: Bus, exchange: str, pattern: str) -> str:
    """A queue that gets a copy of every message ``pattern`` matches on ``exchange`` (read raw)."""
    queue = await bus.declare_queue(QueueSpec(f"test.spy.{uuid.uuid4().hex[:8]}", QueueKind.NODE))
    await bus.bind(queue, exchange, pattern)
    return queue


async def _drain_raw(bus: Bus, queue: str, *, want: int) -> list[object]:
    """The raw messages of ``queue``: ``want`` of them, then whatever else arrives within 0.5 s."""
    got: list[object] = []
    deadline = time.monotonic() + WAIT
    while len(got) < want and time.monotonic() < deadline:
        raw = await bus.fetch_raw(queue, timeout=max(deadline - time.monotonic(), 0.01))  # type: ignore[attr-defined]
        if raw is not None:
            got.append(raw)
    while (raw := await bus.fetch_raw(queue, timeout=0.5)) is not None:  # type: ignore[attr-defined]
        got.append(raw)
    return got


async def test_a_mixed_batch_answers_each_member_and_dead_letters_the_undecodable_one_alone(
        bus: Bus, db: Database) -> None:
    """Three writes, a write that fails validation past the edge and a member the writer cannot decode,
    sent in one turn: one command message, each member its own answer (201s, 422, 400), the two bad
    ones dead-lettered one by one with their reasons, only the good writes committed."""
    identity = await ensure_identity(db, None, None)
    scope = identity.scope
    author = await _author(db)
    spy = await _spy(bus, COMMANDS_EXCHANGE, f"{scope.corpus_id}.#")
    dead = await _spy(bus, DEAD_EXCHANGE, writer_queue(scope).name)
    writer = CorpusWriter(bus, node_id="w", db=db, identity=identity)
    await writer.start()
    batch_key = scope.command_key(WRITE_BATCH)
    try:
        good = [_create(author, f"t-{i}", f"subject {i}") for i in range(3)]
        forged = _create(author, "t-forged", "")
        _, picky_body = encode_message(Picky(label="x"))
        bad_body = picky_body.replace(b'"x"', b'""')
        replies = await asyncio.gather(
            *(bus.request(COMMANDS_EXCHANGE, scope.command_key(c.operation), c, timeout=WAIT,
                          headers=scope.headers(), batch_key=batch_key) for c in [*good, forged]),
            bus.request_raw(COMMANDS_EXCHANGE, scope.command_key(Picky.TYPE), Picky.TYPE,
                            bad_body, timeout=WAIT, headers=scope.headers(), batch_key=batch_key))
        *written, refused, undecodable = (r.message for r in replies)
        assert all(isinstance(w, WriteResult) and w.status == 201 for w in written), written
        results = [w for w in written if isinstance(w, WriteResult)]  # all of them (asserted above), typed
        subjects = [orjson.loads(w.body)["conversation"]["subject"] for w in results]
        assert subjects == ["subject 0", "subject 1", "subject 2"]  # each requester got its own answer
        assert isinstance(refused, ErrorReply) and (refused.status, refused.code) == (422, "validation_failed")
        assert isinstance(undecodable, ErrorReply)
        assert (undecodable.status, undecodable.code) == (400, "undecodable_command")
        for reply in replies[:4]:
            assert scope.refusal(reply.headers) is None  # the writer's own corpus headers, per member

        sent = await _drain_raw(bus, spy, want=1)
        assert [m.type_name for m in sent] == [RequestBatch.TYPE]  # type: ignore[attr-defined]
        letters = await _drain_raw(bus, dead, want=2)
        by_type = {m.type_name: m for m in letters}  # type: ignore[attr-defined]
        assert sorted(by_type) == sorted([Picky.TYPE, WriteCommand.TYPE])  # members alone, never the batch
        assert "label must not be empty" in str(by_type[Picky.TYPE].headers[DEAD_REASON_HEADER])  # type: ignore[attr-defined]
        assert by_type[Picky.TYPE].body == bad_body  # type: ignore[attr-defined]
        assert "failed validation past the edge" in str(
            by_type[WriteCommand.TYPE].headers[DEAD_REASON_HEADER])  # type: ignore[attr-defined]
        assert await db.pool.fetchval("select count(*) from changes") == 3
    finally:
        await writer.stop(grace=2)


async def test_each_member_keeps_its_own_deadline(bus: Bus, db: Database) -> None:
    """A member whose deadline has passed is skipped by the writer (its requester times out alone and
    nothing is written for it) while the live members of the same batch are committed; the batch
    message carries the latest member's deadline."""
    identity = await ensure_identity(db, None, None)
    scope = identity.scope
    author = await _author(db)
    spy = await _spy(bus, COMMANDS_EXCHANGE, scope.command_key(WRITE_BATCH))
    writer = CorpusWriter(bus, node_id="w", db=db, identity=identity)
    await writer.start()
    batch_key = scope.command_key(WRITE_BATCH)
    try:
        past: dict[str, HeaderValue] = {**scope.headers(), DEADLINE_HEADER: int((time.time() - 5) * 1000)}
        started = time.time()

        async def send(command: WriteCommand, timeout: float, headers: Headers) -> object:
            try:
                return (await bus.request(COMMANDS_EXCHANGE, scope.command_key(command.operation), command,
                                          timeout=timeout, headers=headers, batch_key=batch_key)).message
            except RequestTimeout as e:
                return e

        short, late, long = await asyncio.gather(
            send(_create(author, "t-short"), 5, scope.headers()),
            send(_create(author, "t-late"), 2, past),
            send(_create(author, "t-long"), 20, scope.headers()))
        assert isinstance(short, WriteResult) and short.status == 201
        assert isinstance(long, WriteResult) and long.status == 201
        assert isinstance(late, RequestTimeout)  # skipped, so unanswered: the outcome is unknown
        rows = await db.pool.fetch("select token from operations order by token")
        assert [r["token"] for r in rows] == ["t-long", "t-short"]

        [batch] = await _drain_raw(bus, spy, want=1)
        assert batch.type_name == RequestBatch.TYPE  # type: ignore[attr-defined]
        deadline = int(batch.headers[DEADLINE_HEADER])  # type: ignore[attr-defined]
        # The 20 s member's deadline, not the others'.
        assert started + 19 <= deadline / 1000 <= time.time() + 20
    finally:
        await writer.stop(grace=2)


async def _answer_pings(bus: Bus, queue: str) -> object:
    async def handle(delivery: Delivery) -> None:
        assert isinstance(delivery.message, Ping)
        await bus.reply(delivery, Pong(nonce=delivery.message.nonce, responder=delivery.routing_key))

    return await bus.consume(queue, handle, prefetch=10)


async def test_a_batch_is_bounded_in_count_and_bytes() -> None:
    """Seven requests of one turn with at most three a batch: three messages (3, 3, then the last
    alone as itself); a request larger than the byte bound goes alone; every answer reaches its own
    requester, with its own routing key."""
    async with MemoryBus(max_batch_count=3, max_batch_bytes=200) as bus:
        await bus.declare_exchange("test.batches")
        work = await bus.declare_queue(QueueSpec("test.batches.work", QueueKind.WORK))
        await bus.bind(work, "test.batches", "#")
        spy = await _spy(bus, "test.batches", "#")
        consumer = await _answer_pings(bus, work)
        replies = await asyncio.gather(*(bus.request("test.batches", f"ping.{i}", Ping(nonce=f"n{i}"), timeout=WAIT,
                                                     batch_key="pings") for i in range(7)))
        assert [(r.message.nonce, r.message.responder) for r in replies] == [  # type: ignore[attr-defined]
            (f"n{i}", f"ping.{i}") for i in range(7)]
        sent = await _drain_raw(bus, spy, want=3)
        assert [m.type_name for m in sent] == [RequestBatch.TYPE, RequestBatch.TYPE, Ping.TYPE]  # type: ignore[attr-defined]
        assert [len(orjson.loads(m.body)["members"]) for m in sent[:2]] == [3, 3]  # type: ignore[attr-defined]

        big = "x" * 300
        pair = await asyncio.gather(
            bus.request("test.batches", "ping.big", Ping(nonce=big), timeout=WAIT, batch_key="pings"),
            bus.request("test.batches", "ping.small", Ping(nonce="small"), timeout=WAIT, batch_key="pings"))
        assert [r.message.nonce for r in pair] == [big, "small"]  # type: ignore[attr-defined]
        sent = await _drain_raw(bus, spy, want=2)
        assert sorted(m.type_name for m in sent) == [Ping.TYPE, Ping.TYPE]  # type: ignore[attr-defined]
        await consumer.drain(1)  # type: ignore[attr-defined]


async def test_requests_of_one_turn_share_one_message_and_one_reply(bus: Bus) -> None:
    """Twenty requests made together: one request message, one reply message, twenty answers each
    matched to its own requester; a request without a batch key still travels alone."""
    exchange = f"test.batch.{uuid.uuid4().hex[:8]}"
    await bus.declare_exchange(exchange)
    work = await bus.declare_queue(QueueSpec(f"test.batch.{uuid.uuid4().hex[:8]}", QueueKind.WORK))
    await bus.bind(work, exchange, "#")
    spy = await _spy(bus, exchange, "#")

    async def handle(delivery: Delivery) -> None:
        assert isinstance(delivery.message, Ping)
        await bus.reply(delivery, Pong(nonce=delivery.message.nonce, responder="r"))

    consumer = await bus.consume(work, handle, prefetch=10)
    delivered_before = bus.stats.delivered
    batches_before = (bus.stats.request_batches, bus.stats.batched_requests)
    try:
        replies = await asyncio.gather(*(bus.request(exchange, "ping", Ping(nonce=f"n{i}"), timeout=WAIT,
                                                     batch_key="ping.batch") for i in range(20)))
        assert [r.message.nonce for r in replies] == [f"n{i}" for i in range(20)]  # type: ignore[attr-defined]
        assert len({r.correlation_id for r in replies}) == 20
        sent = await _drain_raw(bus, spy, want=1)
        assert [(m.type_name, m.routing_key) for m in sent] == [(RequestBatch.TYPE, "ping.batch")]  # type: ignore[attr-defined]
        # One consumed delivery (the batch) and twenty answers resolved from one reply message.
        assert bus.stats.delivered - delivered_before == 1 + 20
        assert (bus.stats.request_batches, bus.stats.batched_requests) == (batches_before[0] + 1, batches_before[1] + 20)
        alone = await bus.request(exchange, "ping", Ping(nonce="alone"), timeout=WAIT)
        assert alone.message == Pong(nonce="alone", responder="r")
        sent = await _drain_raw(bus, spy, want=1)
        assert [m.type_name for m in sent] == [Ping.TYPE]  # type: ignore[attr-defined]
    finally:
        await consumer.drain(1)



@dataclasses.dataclass
class _Node:
    """What :func:`submit_write` needs of a node: real settings, bus, database and identity."""

    settings: Settings
    bus: Bus
    db: Database
    identity: CorpusIdentity | None
    identity_error: LineageMismatch | None = None


@dataclasses.dataclass(frozen=True)
class _Agent:
    agent_id: str
    name: str = "batcher"
    onboarded: bool = True


async def test_the_writes_of_one_turn_leave_a_node_as_one_command_message(bus: Bus, db: Database) -> None:
    """The submit path both fronts share: ten writes started together are one message on
    ``tm.commands`` (routing key ``<corpus_id>.batch``), each answered with its own 201, all committed."""
    identity = await ensure_identity(db, None, None)
    scope = identity.scope
    author = await _author(db)
    spy = await _spy(bus, COMMANDS_EXCHANGE, f"{scope.corpus_id}.#")
    writer = CorpusWriter(bus, node_id="w", db=db, identity=identity)
    await writer.start()
    settings = Settings(writes_per_second=1000)
    node = _Node(settings, bus, db, identity)
    admission = local_bucket(write_budget(settings.writes_per_second))
    try:
        results = await asyncio.gather(*(
            submit_write(node, admission, _Agent(author), corpus.OP_CREATE_CONVERSATION, None,
                         {"subject": f"s{i}", "content": "c"}, f"t-{i}") for i in range(10)))
        assert [r.status for r in results] == [201] * 10
        assert len({r.sequence for r in results}) == 10
        [sent] = await _drain_raw(bus, spy, want=1)
        assert (sent.type_name, sent.routing_key) == (RequestBatch.TYPE, scope.command_key(WRITE_BATCH))  # type: ignore[attr-defined]
        members = orjson.loads(sent.body)["members"]  # type: ignore[attr-defined]
        assert [m["routing_key"] for m in members] == [scope.command_key(corpus.OP_CREATE_CONVERSATION)] * 10
        assert await db.pool.fetchval("select count(*) from changes") == 10
    finally:
        await writer.stop(grace=2)


async def test_a_member_that_fails_brings_the_batch_back_and_every_member_is_answered(bus: Bus) -> None:
    """A member whose handler raises does not hold the others' answers: the batch reply carries them,
    then the whole batch comes back (redelivered) and the failed member is answered too."""
    exchange = f"test.batch.{uuid.uuid4().hex[:8]}"
    await bus.declare_exchange(exchange)
    work = await bus.declare_queue(QueueSpec(f"test.batch.{uuid.uuid4().hex[:8]}", QueueKind.WORK))
    await bus.bind(work, exchange, "#")
    handled: list[tuple[str, bool]] = []

    async def handle(delivery: Delivery) -> None:
        assert isinstance(delivery.message, Ping)
        handled.append((delivery.message.nonce, delivery.redelivered))
        if delivery.message.nonce == "flaky" and not delivery.redelivered:
            raise RuntimeError("a transient failure")
        await bus.reply(delivery, Pong(nonce=delivery.message.nonce, responder=str(delivery.delivery_count)))

    consumer = await bus.consume(work, handle, prefetch=10)
    try:
        answered: list[str] = []

        async def ask(nonce: str) -> Pong:
            reply = await bus.request(exchange, "ping", Ping(nonce=nonce), timeout=WAIT, batch_key="ping.batch")
            answered.append(nonce)
            assert isinstance(reply.message, Pong)
            return reply.message

        pongs = await asyncio.gather(ask("a"), ask("flaky"), ask("b"))
        assert [p.nonce for p in pongs] == ["a", "flaky", "b"]
        assert pongs[1].responder == "2"  # answered by the second delivery of the batch
        assert answered.index("flaky") == 2  # the others did not wait for it
        assert handled[:3] == [("a", False), ("flaky", False), ("b", False)]
        assert ("flaky", True) in handled[3:]
    finally:
        await consumer.drain(1)


async def test_a_batch_message_without_a_member_list_is_dead_lettered_and_the_consumer_goes_on(bus: Bus) -> None:
    """``{"members": null}`` (or a number) decoded, then failed where the bus splits it, leaving the
    message unsettled and holding a prefetch slot: a prefetch's worth of them stopped the consumer.
    Now the codec refuses it: answered 400 ``undecodable_command``, dead-lettered with its reason."""
    exchange = f"test.batch.{uuid.uuid4().hex[:8]}"
    await bus.declare_exchange(exchange)
    work = await bus.declare_queue(QueueSpec(f"test.batch.{uuid.uuid4().hex[:8]}", QueueKind.WORK))
    await bus.bind(work, exchange, "#")
    dead = await _spy(bus, DEAD_EXCHANGE, work)

    async def handle(delivery: Delivery) -> None:
        assert isinstance(delivery.message, Ping)
        await bus.reply(delivery, Pong(nonce=delivery.message.nonce, responder="w"))

    consumer = await bus.consume(work, handle, prefetch=2)
    try:
        for body in (b'{"members": null}', b'{"members": 7}', b'{"members": "x"}'):
            reply = await bus.request_raw(exchange, "x.batch", RequestBatch.TYPE, body, timeout=WAIT)
            assert isinstance(reply.message, ErrorReply), reply.message
            assert (reply.message.status, reply.message.code) == (400, "undecodable_command")
        letters = await _drain_raw(bus, dead, want=3)
        assert [m.body for m in letters] == [b'{"members": null}', b'{"members": 7}', b'{"members": "x"}']  # type: ignore[attr-defined]
        assert all("must be a list" in str(m.headers[DEAD_REASON_HEADER]) for m in letters)  # type: ignore[attr-defined]
        # More than the prefetch of them went through: nothing is left holding a slot.
        pong = await bus.request(exchange, "ping", Ping(nonce="after"), timeout=WAIT)
        assert isinstance(pong.message, Pong) and pong.message.nonce == "after"
    finally:
        await consumer.drain(1)


async def test_a_member_that_is_not_utf8_goes_alone_and_fails_no_other_request(bus: Bus) -> None:
    """A batch embeds each member's body as JSON text: a raw body that is not UTF-8 cannot join one,
    and made every member of its batch fail; it now travels alone (refused by the consumer's codec,
    alone) while the other requests of the same turn are answered."""
    exchange = f"test.batch.{uuid.uuid4().hex[:8]}"
    await bus.declare_exchange(exchange)
    work = await bus.declare_queue(QueueSpec(f"test.batch.{uuid.uuid4().hex[:8]}", QueueKind.WORK))
    await bus.bind(work, exchange, "#")

    async def handle(delivery: Delivery) -> None:
        assert isinstance(delivery.message, Ping)
        await bus.reply(delivery, Pong(nonce=delivery.message.nonce, responder="w"))

    consumer = await bus.consume(work, handle, prefetch=10)
    try:
        good, bad = await asyncio.gather(
            bus.request(exchange, "ping", Ping(nonce="good"), timeout=WAIT, batch_key="ping.batch"),
            bus.request_raw(exchange, "ping", Ping.TYPE, b'{"nonce": "\xff"}', timeout=WAIT, batch_key="ping.batch"))
        assert isinstance(good.message, Pong) and good.message.nonce == "good"
        assert isinstance(bad.message, ErrorReply) and bad.message.code == "undecodable_command"
    finally:
        await consumer.drain(1)


async def test_a_member_waits_for_its_batchs_publish_only_up_to_its_own_deadline() -> None:
    """A queue that refuses everything (full, reject-publish): the batch's publish retries until the
    latest member's deadline. A member with an earlier one gives up at its own (outcome unknown: it
    may yet be published), not at the other's; the member whose deadline bounds the publish gets the
    publish's own failure (the broker refused it), not an unknown outcome."""
    async with MemoryBus(max_queue_length=1) as bus:
        await bus.declare_exchange("t.x")
        work = await bus.declare_queue(QueueSpec("t.work", QueueKind.WORK))
        await bus.bind(work, "t.x", "#")
        await bus.publish("t.x", "c.fill", Ping(nonce="fill"))  # full, and nobody consumes

        async def ask(timeout: float) -> tuple[str, float]:
            started = time.monotonic()
            try:
                await bus.request("t.x", "c.ping", Ping(nonce=str(timeout)), timeout=timeout, batch_key="b")
            except Exception as e:  # noqa: BLE001 - the type is what is checked
                return type(e).__name__, time.monotonic() - started
            return "answered", time.monotonic() - started  # pragma: no cover - nobody consumes

        (short, short_took), (long, long_took) = await asyncio.gather(ask(1), ask(4))
        assert short == "RequestTimeout" and short_took < 3, (short, short_took)
        assert long != "RequestTimeout" and long_took >= 4, (long, long_took)
