"""Two corpora on one broker never cross-talk (issue 9, item 0; SPEC §1).

Two deployments of the Procfile's processes (web, writer, publisher each), with two different
PostgreSQL databases, share ONE RabbitMQ virtual host, as two operators sharing a broker would. Each
node's commands reach only its own writers, each hub and each integration queue bound as the README
says (``tm.events.<corpus_id>``) sees only its own corpus's events, while ``tm.events`` still carries
both. A foreign command or change batch (what the hubs consume, on ``tm.hub.<corpus_id>``) put on the
broker by hand is refused and kept, with the reason, in ``tm.dead.letters``.

Before corpus-bound names, both writers competed for the one queue ``tm.commands.writer``: half of
each node's writes reached the other corpus's writer, which answered 500 (its database does not
know the author), and each hub passed the other corpus's events to its streams.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import asyncpg
import orjson
import pytest

from actors.writer import writer_queue
from infra.bus.base import Delivery
from protocol.commands import WriteResult
from protocol.routing import CorpusScope
from tests import services
from tests.corpus_fixtures import Agent, Stack
from tests.db_fixtures import fresh_database
from tests.deployment import WAIT, Deployment, deployment
from tests.sse import frames
from tests.test_scale_out import assert_stream_exact, durable_queue, register, sse_followers, until

pytestmark = [pytest.mark.timeout(300)]

#: Writes sent to each node, all at once.
WRITES = 20


@pytest.fixture
def own_vhost(rabbitmq_url: str) -> Iterator[str]:
    """A virtual host of this test's own: its ``tm.dead.letters`` holds only this test's dead letters."""
    with services.private_vhost(rabbitmq_url) as url:
        yield url


@pytest.fixture
async def second_database_url(postgres_url: str) -> AsyncIterator[str]:
    """Another fresh database on the same server: the second corpus."""
    async with fresh_database(postgres_url) as dsn:
        yield dsn


async def start_node(dep: Deployment, suffix: str) -> str:
    """A writer, a web front and a publisher of one deployment; returns the web front's URL."""
    await dep.start("writer", f"writer-{suffix}")
    web = await dep.start("web", f"web-{suffix}")
    publisher = await dep.start("publisher", f"pub-{suffix}")
    await publisher.wait_for_line(r"publisher\.active", timeout=WAIT)
    assert web.proc.returncode is None
    return dep.urls[f"web-{suffix}"]


async def identity_of(session: aiohttp.ClientSession, base: str) -> tuple[str, str]:
    async with session.get(base + "/corpus") as resp:
        body = await resp.json()
        assert resp.status == 200, body
    return str(body["corpus_id"]), str(body["lineage"])


async def write_all(session: aiohttp.ClientSession, base: str, agent: Agent, label: str) -> list[tuple[int, Any]]:
    """``WRITES`` conversations at once, each answered exactly once (no retries: a 500 stays a 500)."""

    async def one(i: int) -> tuple[int, Any]:
        async with session.post(base + "/conversations", json={"subject": f"{label}-{i}", "content": "x"},
                                headers=agent.headers(str(uuid.uuid4()))) as resp:
            return resp.status, await resp.json()

    return list(await asyncio.gather(*(one(i) for i in range(WRITES))))


async def column(database_url: str, sql: str) -> list[Any]:
    """The first column of ``sql``'s rows in the database at ``database_url``."""
    conn = await asyncpg.connect(database_url)
    try:
        return [r[0] for r in await conn.fetch(sql)]
    finally:
        await conn.close()


async def subjects(database_url: str) -> list[str]:
    return await column(database_url, "select subject from conversations order by subject")


async def sequences(database_url: str) -> list[int]:
    return await column(database_url, "select sequence from changes order by sequence")


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_two_corpora_on_one_vhost_never_cross_talk(
        tmp_path: Path, rabbitmq_url: str, database_url: str, second_database_url: str) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with deployment(tmp_path / "a", rabbitmq_url, database_url) as dep_a, \
            deployment(tmp_path / "b", rabbitmq_url, second_database_url) as dep_b, \
            aiohttp.ClientSession() as session:
        base_a, base_b = await start_node(dep_a, "a"), await start_node(dep_b, "b")
        (corpus_a, _), (corpus_b, _) = await identity_of(session, base_a), await identity_of(session, base_b)
        assert corpus_a != corpus_b
        agent_a, agent_b = await register(session, base_a), await register(session, base_b)
        async with durable_queue(rabbitmq_url, "#", f"tm.events.{corpus_a}", corpus_a) as queue_a, \
                durable_queue(rabbitmq_url, "#", f"tm.events.{corpus_b}", corpus_b) as queue_b, \
                durable_queue(rabbitmq_url, "#") as everything, \
                sse_followers([base_a, base_b], [corpus_a, corpus_b]) as (sse_a, sse_b):
            answers_a, answers_b = await asyncio.gather(write_all(session, base_a, agent_a, "a"),
                                                        write_all(session, base_b, agent_b, "b"))
            for label, answers in (("a", answers_a), ("b", answers_b)):
                statuses = [status for status, _ in answers]
                assert statuses == [201] * WRITES, f"node {label}: {statuses}: {[b for s, b in answers if s != 201][:3]}"

            # Each write landed in its own database only.
            assert await subjects(database_url) == sorted(f"a-{i}" for i in range(WRITES))
            assert await subjects(second_database_url) == sorted(f"b-{i}" for i in range(WRITES))

            history_a, history_b = await sequences(database_url), await sequences(second_database_url)
            assert len(history_a) == len(history_b) == WRITES
            for follower, history in ((sse_a, history_a), (sse_b, history_b)):
                await follower.until_covers(history, f"SSE on {follower.base} has its corpus's changes")
            for queue, history in ((queue_a, history_a), (queue_b, history_b)):
                await queue.until_covers(history, "the corpus's integration queue has its changes")
            # tm.events carries both corpora (SPEC §1: integrations may still bind it).
            await until(lambda: len(everything.sequences) >= 2 * WRITES, "tm.events carries both corpora")

            # A sentinel write on each node, behind everything: once it has arrived everywhere, any
            # cross-talk would have arrived too (each queue and stream is in order).
            for base, agent, label in ((base_a, agent_a, "a"), (base_b, agent_b, "b")):
                async with session.post(base + "/conversations", json={"subject": f"{label}-end", "content": "x"},
                                        headers=agent.headers(str(uuid.uuid4()))) as resp:
                    assert resp.status == 201, await resp.text()
            history_a, history_b = await sequences(database_url), await sequences(second_database_url)
            for follower, history in ((sse_a, history_a), (sse_b, history_b)):
                await follower.until_covers(history, "the sentinel reached the stream")
                assert_stream_exact(follower, history)
            for queue, history, corpus in ((queue_a, history_a, corpus_a), (queue_b, history_b, corpus_b)):
                await queue.until_covers(history, "the sentinel reached the integration queue")
                assert not queue.problems, queue.problems[:3]
                assert sorted(set(queue.sequences)) == history
                assert set(queue.corpus_ids) == {corpus}
            await until(lambda: len(everything.sequences) >= len(history_a) + len(history_b),
                        "tm.events carries both sentinels")
            assert sorted(everything.corpus_ids) == sorted([corpus_a] * len(history_a) + [corpus_b] * len(history_b))
            assert not everything.problems, everything.problems[:3]


async def _dead_letters(amqp_url: str, want: int) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """The first ``want`` messages of ``tm.dead.letters`` (the test's own vhost: all of them are its own)."""
    connection = await aio_pika.connect(amqp_url)
    out: list[aio_pika.abc.AbstractIncomingMessage] = []
    try:
        channel = await connection.channel()
        queue = await channel.get_queue("tm.dead.letters", ensure=True)
        async with queue.iterator() as messages, asyncio.timeout(WAIT):
            async for message in messages:
                await message.ack()
                out.append(message)
                if len(out) >= want:
                    break
    finally:
        await connection.close()
    return out


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_a_foreign_command_and_a_foreign_event_are_dead_lettered_with_the_reason(
        tmp_path: Path, own_vhost: str, database_url: str) -> None:
    """Put on the broker by hand under this corpus's names but naming another corpus: the writer
    answers the command 503 (never 500) and writes nothing, the hub passes the event to no stream,
    and both wait in ``tm.dead.letters`` with the reason."""
    async with deployment(tmp_path, own_vhost, database_url) as dep, aiohttp.ClientSession() as session:
        base = await start_node(dep, "a")
        corpus, lineage = await identity_of(session, base)
        stranger = str(uuid.uuid4())
        async with session.get(base + "/corpus/stream?after=0") as stream:
            assert stream.status == 200
            reader = frames(stream)
            async for frame in reader:
                if frame.event == "ready":
                    break
            connection = await aio_pika.connect(own_vhost)
            try:
                channel = await connection.channel(publisher_confirms=True)
                command = {"operation": "conversation.create", "target": None,
                           "body": {"subject": "smuggled", "content": "x"}, "author_id": str(uuid.uuid4()),
                           "author_name": "stranger", "token": "t-1"}
                callback = await channel.declare_queue("", exclusive=True)
                exchange = await channel.get_exchange("tm.commands")
                await exchange.publish(aio_pika.Message(
                    orjson.dumps(command), type="corpus.write", content_type="application/json",
                    headers={"x-corpus-id": stranger, "x-corpus-lineage": lineage},
                    correlation_id="c-1", reply_to=callback.name), routing_key=f"{corpus}.conversation.create")
                event = {"schema_version": 1, "sequence": 1, "type": "conversation.created", "partition": 0,
                         "corpus_id": stranger, "lineage": lineage, "occurred_at": "2026-01-01T00:00:00Z",
                         "data": {"conversation": {"subject": "smuggled"}}}
                # What the hubs consume: a change batch on the corpus's internal hub exchange.
                batch = {"corpus_id": stranger, "lineage": lineage, "after": 0,
                         "changes": [[1, "conversation.created", 0, orjson.dumps(event).decode()]]}
                hub_feed = await channel.get_exchange(f"tm.hub.{corpus}")
                await hub_feed.publish(aio_pika.Message(
                    orjson.dumps(batch), type="corpus.change-batch", content_type="application/json",
                    headers={"x-corpus-id": stranger, "x-corpus-lineage": lineage, "x-corpus-sequence": 1}),
                    routing_key="batch")
                async with callback.iterator() as replies, asyncio.timeout(WAIT):
                    async for reply in replies:
                        answer = orjson.loads(reply.body)
                        break
                assert reply.type == "system.error" and (answer["status"], answer["code"]) == (503, "lineage_unavailable")
                assert (reply.headers or {}).get("x-corpus-id") == corpus
            finally:
                await connection.close()

            dead = await _dead_letters(own_vhost, 2)
            by_type = {m.type: m for m in dead}
            assert set(by_type) == {"corpus.write", "corpus.change-batch"}
            for message in dead:
                reason = str((message.headers or {}).get("x-tm-dead-reason"))
                assert reason.startswith("foreign message: x-corpus-id is") and stranger in reason, reason
            assert (by_type["corpus.write"].headers or {}).get("x-tm-dead-queue") == f"tm.commands.writer.{corpus}"
            assert str((by_type["corpus.change-batch"].headers or {}).get("x-tm-dead-queue")).startswith("tm.hub.")
            assert await sequences(database_url) == []

            # The stream saw nothing of it: the next frame is a real write's.
            agent = await register(session, base)
            async with session.post(base + "/conversations", json={"subject": "native", "content": "x"},
                                    headers=agent.headers(str(uuid.uuid4()))) as resp:
                assert resp.status == 201, await resp.text()
            async with asyncio.timeout(WAIT):
                async for frame in reader:
                    if frame.id is not None:
                        envelope = frame.json()
                        assert (envelope["corpus_id"], envelope["data"]["conversation"]["subject"]) == (corpus, "native")
                        break


async def test_a_reply_from_another_corpus_writer_is_never_passed_on(stack: Stack) -> None:
    """A writer of another corpus answering on this corpus's queue (a misbound queue, an older
    writer): its 201 must not become this node's answer. The node's own writer is stopped and a
    stand-in consumer of the corpus's queue answers every command with a foreign-corpus 201."""
    await stack.writer.stop(grace=2)
    foreign = CorpusScope(str(uuid.uuid4()), str(uuid.uuid4()))

    async def impostor(delivery: Delivery) -> None:
        await stack.bus.reply(delivery, WriteResult(status=201, body="{}", sequence=1), headers=foreign.headers())

    consumer = await stack.bus.consume(writer_queue(stack.identity.scope).name, impostor, prefetch=4)
    try:
        alice = await stack.register()
        reply = await stack.post(alice, "/conversations", {"subject": "s", "content": "c"})
        assert reply.status == 503, reply.body
        assert reply.body["error"]["code"] == "lineage_unavailable"
    finally:
        await consumer.drain(2)
