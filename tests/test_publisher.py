"""The event publisher: the change history, published to ``tm.events`` in order, at least once.

In-process tests run on the write-path ``stack`` (embedded PostgreSQL + in-process bus, and
PostgreSQL + RabbitMQ): they check what an integration binding its own queue receives (every
sequence, in order, with routing key, message_id, headers and the stored envelope as body), the
NOTIFY wake-up and the polling fallback, and the single-active hand-over between two instances.

Fault tests run real processes against PostgreSQL and RabbitMQ (a virtual host of this run's own):
the active publisher killed with SIGKILL mid-load, and the broker dropping every connection
mid-load. A durable queue bound to ``message.appended.*`` must end up holding every message
sequence of the history (after deduplication: republishing is allowed, losing is not).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import orjson
import pytest

from actors.publisher import EventPublisher, active_publisher, application_name, read_cursor
from infra.bus.base import EVENTS_EXCHANGE, Bus, Consumer, Delivery, QueueKind, QueueSpec
from infra.bus.rabbitmq import RabbitBus
from protocol.events import ChangeBatch, ChangeEvent
from protocol.messages import encode_message
from tests.bus_fixtures import cleanup_rabbit, unique_name
from tests.corpus_fixtures import Agent, Stack
from tests.deployment import Deployment, deployment
from tests.services import _rabbitmqctl, drop_broker_connections

#: Seconds any single condition of these tests may take.
WAIT = 30.0


# --- helpers ------------------------------------------------------------------------------------


@dataclass
class Received:
    """What a test queue bound on ``tm.events`` received, in arrival order."""

    deliveries: list[Delivery] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)
        self._changed.set()

    @property
    def sequences(self) -> list[int]:
        out = []
        for d in self.deliveries:
            assert isinstance(d.message, ChangeEvent), d.message
            out.append(d.message.sequence)
        return out

    async def until(self, predicate: Callable[[Received], bool], what: str, timeout: float = WAIT) -> None:
        """Wait until ``predicate(self)`` holds after a delivery; fail naming ``what`` on timeout."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate(self):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"not within {timeout}s: {what}; received {len(self.deliveries)}: "
                                 f"{self.sequences[-20:]}") from None


async def bind_queue(bus: Bus, pattern: str, kind: QueueKind = QueueKind.NODE) -> tuple[Received, Consumer]:
    received = Received()
    name = await bus.declare_queue(QueueSpec(name=unique_name("publisher"), kind=kind))
    await bus.bind(name, EVENTS_EXCHANGE, pattern)
    consumer = await bus.consume(name, received.handle, prefetch=500)
    return received, consumer


async def history(target: Any) -> list[asyncpg.Record]:
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(target, str):
            conn = await asyncpg.connect(target)
            stack.push_async_callback(conn.close)
        else:
            conn = await stack.enter_async_context(target.acquire())
        return list(await conn.fetch("select sequence, type, partition, event, trace_id from changes "
                                     "order by sequence"))


@contextlib.asynccontextmanager
async def running(publisher: EventPublisher) -> AsyncIterator[EventPublisher]:
    await publisher.start()
    try:
        yield publisher
    finally:
        await publisher.stop(grace=5)


async def until(predicate: Callable[[], Any], what: str, timeout: float = WAIT) -> None:
    """For conditions nothing signals (another process's state): poll until true, fail after ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            while not await predicate():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


async def write_some(stack: Stack, n: int) -> None:
    """``n`` messages plus one change of every other type."""
    alice, bob = await stack.register(), await stack.register()
    created = await stack.conversation(alice, "publisher test")
    cid, root = created["conversation"]["id"], created["message"]["id"]
    last = root
    for i in range(n):
        last = (await stack.message(alice if i % 2 else bob, cid, content=f"message {i}"))["message"]["id"]
    reply = await stack.post(bob, "/relationships", {"type": "extends", "source_message_id": last,
                                                     "target_message_id": root})
    assert reply.status == 201, reply.body
    done = await stack.post(bob, f"/relationships/{reply.body['relationship']['id']}/retractions", data=b"")
    assert done.status == 201, done.body


# --- in process, both backends --------------------------------------------------------------------


async def _publisher_seen(stack: Stack) -> tuple[dict[str, Any], dict[str, float]]:
    """What a web node's /readyz says of the publisher, and its publisher gauges on /metrics."""
    ready = await (await stack.client.get("/readyz")).json()
    text = await (await stack.client.get("/metrics")).text()
    gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("toastmachine_corpus_publisher_")}
    return ready["checks"]["publisher"], gauges


async def test_a_web_node_shows_whether_a_publisher_runs_and_how_far_behind_it_is(stack: Stack) -> None:
    """The publisher process serves no HTTP: with none running, writes still commit but nothing is
    followed, and every web node's /readyz detail and /metrics say so (no publisher, the changes
    waiting); once one runs and catches up, they show it active with nothing waiting."""
    await write_some(stack, 3)
    head = (await history(stack.db))[-1]["sequence"]
    detail, gauges = await _publisher_seen(stack)
    assert detail == {"status": "none_active", "cursor": 0, "lag_events": len(await history(stack.db))}
    assert gauges == {"toastmachine_corpus_publisher_cursor": 0.0, "toastmachine_corpus_publisher_active": 0.0,
                      "toastmachine_corpus_publisher_lag_events": float(detail["lag_events"])}
    assert (await stack.client.get("/readyz")).status == 200  # detail, not readiness: the node still serves
    async with running(EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="t-seen")) as publisher:
        async with asyncio.timeout(WAIT):
            await publisher.wait_cursor(head)
        detail, gauges = await _publisher_seen(stack)
    assert detail == {"status": "active", "cursor": head, "lag_events": 0}
    assert gauges["toastmachine_corpus_publisher_active"] == 1.0 and gauges["toastmachine_corpus_publisher_lag_events"] == 0


async def test_every_change_is_published_in_order_with_its_envelope_and_headers(stack: Stack) -> None:
    received, _ = await bind_queue(stack.bus, "#")
    await write_some(stack, 10)  # a backlog before the publisher starts
    # A long poll interval: the live writes below must arrive through NOTIFY, not a poll.
    async with running(EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="t1", poll_interval=60,
                                      window=7, batch_size=9)) as publisher:
        await write_some(stack, 15)
        rows = await history(stack.db)
        head = rows[-1]["sequence"]
        await received.until(lambda r: len(r.deliveries) >= len(rows), "every change published")
        async with asyncio.timeout(WAIT):
            await publisher.wait_cursor(head)
        assert publisher.active and publisher.status() == {"active": True, "cursor": head,
                                                            "published": len(rows)}
    assert await read_cursor(stack.db) == head
    assert received.sequences == [r["sequence"] for r in rows]
    assert {r["type"] for r in rows} == {"conversation.created", "message.appended", "relationship.asserted",
                                         "relationship.retracted"}
    lineage, corpus_id = str(stack.identity.lineage), str(stack.identity.corpus_id)
    for delivery, row in zip(received.deliveries, rows, strict=True):
        event = delivery.message
        assert isinstance(event, ChangeEvent)
        # Published on the corpus's own exchange, which tm.events carries (exchange-to-exchange).
        assert delivery.exchange == stack.identity.scope.events_exchange
        assert delivery.routing_key == f"{row['type']}.{row['partition']}"
        assert delivery.message_id == f"{lineage}:{row['sequence']}"
        assert delivery.headers["x-corpus-id"] == corpus_id
        assert delivery.headers["x-corpus-lineage"] == lineage
        assert delivery.headers["x-corpus-sequence"] == row["sequence"]
        assert delivery.headers["x-schema-version"] == 1
        assert row["trace_id"] and delivery.headers["x-trace-id"] == row["trace_id"]
        # The body is the stored envelope, byte for byte.
        assert encode_message(event)[1] == row["event"].encode()


async def hub_feed(stack: Stack) -> Received:
    """What reaches a queue bound to the hubs' internal exchange from now on."""
    await stack.bus.declare_exchange(stack.identity.scope.hub_exchange)
    batches = Received()
    feed = await stack.bus.declare_queue(QueueSpec(name=unique_name("hub-feed"), kind=QueueKind.NODE))
    await stack.bus.bind(feed, stack.identity.scope.hub_exchange, "#")
    await stack.bus.consume(feed, batches.handle, prefetch=500)
    return batches


async def test_each_window_reaches_the_hubs_as_one_batch_and_tm_events_keeps_one_message_per_change(
        stack: Stack) -> None:
    """Beside its events, the publisher sends each window once more, whole, to the hubs' internal
    exchange: one ``ChangeBatch`` per window, the stored envelopes verbatim, each ``after`` the end of
    the one before. ``tm.events`` is unchanged: one message per change, nothing of the batches."""
    scope = stack.identity.scope
    batches = await hub_feed(stack)
    events, _ = await bind_queue(stack.bus, "#")
    await write_some(stack, 10)  # a backlog: read at once, published in windows of 5
    backlog = len(await history(stack.db))
    start = await read_cursor(stack.db)
    async with running(EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="t-batches",
                                      poll_interval=60, window=5, batch_size=100)) as publisher:
        windows = [5] * (backlog // 5) + ([backlog % 5] if backlog % 5 else [])
        await batches.until(lambda r: len(r.deliveries) >= len(windows), "the backlog's batches")
        await write_some(stack, 3)  # live: woken by NOTIFY, windows of whatever each read finds
        rows = await history(stack.db)
        async with asyncio.timeout(WAIT):
            await publisher.wait_cursor(rows[-1]["sequence"])
        await events.until(lambda r: len(r.deliveries) >= len(rows), "every change on tm.events")

        def fed(r: Received) -> int:
            return sum(len(d.message.changes) for d in r.deliveries if isinstance(d.message, ChangeBatch))

        await batches.until(lambda r: fed(r) >= len(rows), "every change in a batch")
        published = publisher.hub_batches
    assert events.sequences == [r["sequence"] for r in rows]  # ChangeEvents only, one per change
    messages = [d.message for d in batches.deliveries if isinstance(d.message, ChangeBatch)]
    assert len(messages) == len(batches.deliveries)  # nothing but change batches on the hubs' exchange
    assert len(messages) == published and publisher.failed_hub_batches == 0
    assert [len(m.changes) for m in messages[:len(windows)]] == windows  # one batch per window
    after = start
    for delivery, message in zip(batches.deliveries, messages, strict=True):
        assert isinstance(message, ChangeBatch)
        assert (message.corpus_id, message.lineage, message.after) == (scope.corpus_id, scope.lineage, after)
        assert delivery.exchange == scope.hub_exchange and delivery.routing_key == "batch"
        assert delivery.headers["x-corpus-id"] == scope.corpus_id
        assert delivery.headers["x-corpus-lineage"] == scope.lineage
        assert delivery.headers["x-corpus-sequence"] == message.changes[-1][0]
        after = message.changes[-1][0]
    assert [c for m in messages for c in m.changes] == [
        [r["sequence"], r["type"], r["partition"], r["event"]] for r in rows]


async def test_a_window_past_a_mebibyte_reaches_the_hubs_in_parts_each_below_it(stack: Stack) -> None:
    from protocol.events import MAX_CHANGE_BATCH_BYTES

    batches = await hub_feed(stack)
    alice = await stack.register()
    cid = (await stack.conversation(alice, "big"))["conversation"]["id"]
    for _ in range(24):  # ~60 KB envelopes: about 1.5 MB in one window
        await stack.message(alice, cid, content="x" * 60_000)
    rows = await history(stack.db)
    start = await read_cursor(stack.db)
    async with running(EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="t-big",
                                      poll_interval=60, window=100, batch_size=100)) as publisher:
        async with asyncio.timeout(WAIT):
            await publisher.wait_cursor(rows[-1]["sequence"])
        await batches.until(lambda r: len(r.deliveries) >= publisher.hub_batches >= 2, "the window's parts")
    messages = [d.message for d in batches.deliveries if isinstance(d.message, ChangeBatch)]
    assert len(messages) == len(batches.deliveries) >= 2
    after = start
    for message in messages:
        assert message.after == after and sum(len(c[3].encode()) for c in message.changes) <= MAX_CHANGE_BATCH_BYTES
        after = message.changes[-1][0]
    assert [c[0] for m in messages for c in m.changes] == [r["sequence"] for r in rows]


async def test_a_change_that_cannot_be_published_stops_the_publisher_after_the_ones_before_it(stack: Stack) -> None:
    """A stored envelope that does not decode (a damaged history) stops the publisher at that
    change, loudly; the changes before it in the same read and window are published first and the
    cursor moves past them, so integrators are not held back by a change they come after."""
    from actors.publisher import PublisherError

    received, _ = await bind_queue(stack.bus, "#")
    await write_some(stack, 3)
    good = [r["sequence"] for r in await history(stack.db)]
    author = (await stack.db.pool.fetchrow("select author_id from changes order by sequence limit 1"))["author_id"]
    poison = await stack.db.pool.fetchval(
        "insert into changes (sequence, type, partition, conversation_id, author_id, occurred_at, event) "
        "values (nextval('change_sequence'), 'message.appended', 0, gen_random_uuid(), $1, now(), '{\"x\": 1}') "
        "returning sequence", author)
    async with running(EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="t-poison",
                                      poll_interval=60, window=100, batch_size=200)) as publisher:
        error = await asyncio.wait_for(publisher.crashed(), WAIT)
    assert isinstance(error, PublisherError) and f"change {poison} cannot be published" in str(error)
    await received.until(lambda r: len(r.deliveries) >= len(good), "the changes before the damaged one")
    assert received.sequences == good
    assert await read_cursor(stack.db) == good[-1]


async def test_polling_picks_up_changes_when_no_notification_comes(stack: Stack) -> None:
    async with stack.db.acquire() as conn:
        await conn.execute("alter table changes disable trigger changes_notify_publisher")
    received, _ = await bind_queue(stack.bus, "message.appended.*")
    async with running(EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="t2", poll_interval=0.2)) as publisher:
        await write_some(stack, 5)
        rows = [r for r in await history(stack.db) if r["type"] == "message.appended"]
        await received.until(lambda r: r.sequences == [x["sequence"] for x in rows], "polled changes published")
        assert publisher.active


async def test_one_publisher_is_active_and_another_takes_over_when_it_stops(stack: Stack) -> None:
    received, _ = await bind_queue(stack.bus, "#")
    first = EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="first", standby_interval=0.1)
    second = EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="second", standby_interval=0.1)
    async with running(first):
        async with asyncio.timeout(WAIT):
            await first.wait_cursor(0)
        async with running(second):
            await write_some(stack, 5)
            head = (await history(stack.db))[-1]["sequence"]
            async with asyncio.timeout(WAIT):
                await first.wait_cursor(head)
            assert first.active and not second.active and second.cursor is None
            assert await active_publisher(stack.db) == application_name("first")
            await first.stop(grace=5)
            await write_some(stack, 5)
            head = (await history(stack.db))[-1]["sequence"]
            async with asyncio.timeout(WAIT):
                await second.wait_cursor(head)
            assert second.active and await active_publisher(stack.db) == application_name("second")
    assert await active_publisher(stack.db) is None
    assert received.sequences == [r["sequence"] for r in await history(stack.db)]


# --- real processes under faults ----------------------------------------------------------------

#: Messages in each load, and client tasks sending them.
MESSAGES = 600
CLIENTS = 16
PUBLISHER_STARTED = r"ToastMachine running publisher"


@contextlib.asynccontextmanager
async def publisher_deployment(tmp_path: Path, amqp_url: str, database_url: str,
                               publishers: tuple[str, ...]) -> AsyncIterator[Deployment]:
    """A writer, a web front and the named publishers as separate processes (tests/deployment.py)."""
    async with deployment(tmp_path, amqp_url, database_url) as dep:
        await dep.start("writer", "writer")
        await dep.start("web", "web")
        for name in publishers:
            await dep.start("publisher", name)
        yield dep


async def _post(session: aiohttp.ClientSession, url: str, agent: Agent, body: Any) -> dict[str, Any]:
    """POST until 201, retrying the identical request with the same token on 5xx and errors."""
    token = str(uuid.uuid4())
    last: Any = None
    for attempt in range(40):
        try:
            async with session.post(url, json=body, headers=agent.headers(token),
                                    timeout=aiohttp.ClientTimeout(total=15)) as resp:
                text = await resp.text()
                if resp.status == 201:
                    return orjson.loads(text)  # type: ignore[no-any-return]
                assert resp.status >= 500, f"{resp.status} {text}"
                last = text
        except (aiohttp.ClientError, TimeoutError) as e:
            last = repr(e)
        await asyncio.sleep(min(0.5, 0.05 * 2 ** attempt))
    raise AssertionError(f"POST {url} never answered 201; last: {last}")


@dataclass
class Load:
    created: int = 0
    progressed: asyncio.Event = field(default_factory=asyncio.Event)


async def run_load(base: str, load: Load) -> None:
    """``MESSAGES`` messages from ``CLIENTS`` concurrent clients, each in a conversation of its own."""
    async with aiohttp.ClientSession() as session:
        async def client(i: int, count: int) -> None:
            async with session.post(base + "/register", json={"name": f"pub-{uuid.uuid4().hex[:10]}"}) as resp:
                body = await resp.json()
                assert resp.status == 201, body
            agent = Agent(agent_id=body["agent_id"], name=body["name"], credential=body["credential"])
            async with session.get(base + "/guide", headers=agent.headers()) as resp:
                assert resp.status == 200
            conv = await _post(session, base + "/conversations", agent, {"subject": f"load {i}", "content": "go"})
            url = f"{base}/conversations/{conv['conversation']['id']}/messages"
            for n in range(count):
                await _post(session, url, agent, {"content": f"c{i}-{n}"})
                load.created += 1
                load.progressed.set()

        await asyncio.gather(*(client(i, MESSAGES // CLIENTS) for i in range(CLIENTS)))


async def until_created(load: Load, count: int, loader: asyncio.Task[None]) -> None:
    async with asyncio.timeout(120):
        while load.created < count:
            if loader.done():
                loader.result()
                return
            load.progressed.clear()
            await load.progressed.wait()


@contextlib.asynccontextmanager
async def durable_queue(amqp_url: str, pattern: str) -> AsyncIterator[Received]:
    """A durable (quorum) queue bound on ``tm.events``, consumed by this test; deleted afterwards."""
    bus = RabbitBus(amqp_url, connection_name="test:publisher-queue")
    await bus.connect()
    try:
        received, consumer = await bind_queue(bus, pattern, kind=QueueKind.WORK)
        yield received
        await consumer.cancel()
    finally:
        await cleanup_rabbit(bus)
        await bus.close()


async def assert_every_message_sequence(received: Received, database_url: str) -> None:
    expected = sorted(r["sequence"] for r in await history(database_url) if r["type"] == "message.appended")
    assert len(expected) == MESSAGES // CLIENTS * CLIENTS
    await received.until(lambda r: set(r.sequences) >= set(expected), "every message sequence queued", 60)
    assert sorted(set(received.sequences)) == expected
    for d in received.deliveries:
        assert d.routing_key.startswith("message.appended.")
    # The README's consumer rule: keep the highest sequence applied, drop anything at or below it.
    # It loses nothing only if no event first arrives after a later one, faults included.
    highest, applied = 0, []
    for sequence in received.sequences:
        if sequence > highest:
            applied.append(sequence)
            highest = sequence
    assert applied == expected, "an event first arrived after a later one"


@pytest.mark.fault
@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.timeout(300)
async def test_active_publisher_killed_mid_load_the_standby_takes_over_and_nothing_is_lost(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    async with durable_queue(rabbitmq_url, "message.appended.*") as received, \
            publisher_deployment(tmp_path, rabbitmq_url, database_url, ("pub-a", "pub-b")) as dep:
        await until(dep.holder, "a publisher holds the lock")
        holder = await dep.holder()
        names = {application_name(n): n for n in ("pub-a", "pub-b")}
        assert holder in names
        active, standby = names[holder], ({"pub-a", "pub-b"} - {names[holder]}).pop()
        await dep.processes[standby].wait_for_line(r"publisher\.standby", timeout=WAIT)
        assert not any("publisher.active" in line for line in dep.processes[standby].output)

        load = Load()
        loader = asyncio.create_task(run_load(dep.urls["web"], load))
        try:
            await until_created(load, MESSAGES // 3, loader)
            await received.until(lambda r: len(r.deliveries) > 0, "events flowing before the kill")
            dep.processes[active].signal(signal.SIGKILL)
            await dep.processes[active].wait(timeout=WAIT)
            assert load.created < MESSAGES, "the kill did not land mid-load"
            # The standby notices within about its retry interval and takes over.
            await dep.processes[standby].wait_for_line(r"publisher\.active", timeout=WAIT)
            assert await dep.holder() == application_name(standby)
            await loader
        finally:
            if not loader.done():
                loader.cancel()
        await assert_every_message_sequence(received, database_url)


@pytest.mark.fault
@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.timeout(300)
async def test_broker_dropping_every_connection_mid_load_loses_no_event(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    async with durable_queue(rabbitmq_url, "message.appended.*") as received, \
            publisher_deployment(tmp_path, rabbitmq_url, database_url, ("pub-only",)) as dep:
        await until(dep.holder, "the publisher holds the lock")
        load = Load()
        loader = asyncio.create_task(run_load(dep.urls["web"], load))
        try:
            for fraction in (4, 2):
                await until_created(load, MESSAGES // fraction, loader)
                await drop_broker_connections(rabbitmq_url, "test: publisher under a broker fault")
            await loader
        finally:
            if not loader.done():
                loader.cancel()
        await assert_every_message_sequence(received, database_url)
        # The publisher survived on its own: same process, still the lock holder.
        assert await dep.holder() == application_name("pub-only")
        publisher = dep.processes["pub-only"]

        async def reconnected_twice() -> bool:
            return "\n".join(publisher.output).count("bus.reconnected") >= 2

        # Both faults hit the publisher; the second one's reconnect may still be under way.
        await until(reconnected_twice, "the publisher reconnected after both faults")
        output = "\n".join(publisher.output)
        assert output.count("publisher.active") == 1, output[-4000:]


@pytest.mark.fault
@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.parametrize("stack_backends", ["services"], indirect=True)
async def test_bus_down_longer_than_the_publish_timeout_the_cursor_waits_then_resumes(
        stack: Stack, rabbitmq_url: str) -> None:
    """While the broker refuses us, publishes time out, the cursor stays put, and the publisher
    retries from it; once the broker is back, every change arrives."""
    queue_bus = RabbitBus(rabbitmq_url, connection_name="test:publisher-queue")
    await queue_bus.connect()
    try:
        # A durable queue: it outlives the connections the fault closes.
        received, _ = await bind_queue(queue_bus, "#", kind=QueueKind.WORK)
        await write_some(stack, 10)
        expected = [r["sequence"] for r in await history(stack.db)]
        head = expected[-1]
        url = urlsplit(rabbitmq_url)
        vhost, user = url.path.lstrip("/"), url.username or "guest"
        _rabbitmqctl("clear_permissions", "-p", vhost, user)
        try:
            await drop_broker_connections(rabbitmq_url, "test: broker refuses the publisher")
            publisher = EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="t-down", publish_timeout=0.5)
            async with running(publisher):
                async def failed() -> bool:
                    return publisher.failed_windows >= 2
                await until(failed, "publishes failing while the broker refuses us")
                assert publisher.active and publisher.cursor == 0 == await read_cursor(stack.db)
                _rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
                async with asyncio.timeout(60):
                    await publisher.wait_cursor(head)
            await received.until(lambda r: set(r.sequences) >= set(expected),
                                 "every change queued after the outage", 60)
        finally:
            _rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        assert sorted(set(received.sequences)) == expected
        assert await read_cursor(stack.db) == head
    finally:
        await cleanup_rabbit(queue_bus)
        await queue_bus.close()


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_the_corpus_events_exchange_exists_before_the_first_change(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """An integrator binds its queue to tm.events.<corpus_id> on a fresh node, before any write:
    the active publisher declared it (a passive declare fails on an exchange nobody declared)."""
    import aio_pika

    async with publisher_deployment(tmp_path, rabbitmq_url, database_url, ("pub-a",)) as dep:
        await dep.processes["pub-a"].wait_for_line(r"publisher\.active", timeout=WAIT)
        conn = await asyncpg.connect(database_url)
        try:
            corpus_id = await conn.fetchval("select corpus_id from corpus_witness")
            assert await conn.fetchval("select count(*) from changes") == 0
        finally:
            await conn.close()
        broker = await aio_pika.connect(rabbitmq_url)
        try:
            channel = await broker.channel()
            exchange = await channel.get_exchange(f"tm.events.{corpus_id}", ensure=True)  # passive
            queue = await channel.declare_queue(exclusive=True)
            await queue.bind(exchange, "#")
        finally:
            await broker.close()


@pytest.mark.fault
@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.timeout(300)
async def test_a_publisher_cut_off_from_the_broker_hands_its_lock_to_one_that_is_not(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """The active publisher reaches PostgreSQL but not RabbitMQ (a forwarder in front of the broker,
    cut): it is not dead, so the standby could not take over by the lock alone. After
    HANDOVER_AFTER seconds of unconfirmed publishes it releases the lock, the standby (which
    reaches the broker) becomes active, and every event reaches an integrator's queue."""
    from urllib.parse import urlsplit

    from tests.tcp_proxy import TcpProxy

    server = urlsplit(rabbitmq_url)
    proxy = TcpProxy(server.hostname or "127.0.0.1", server.port or 5672)
    await proxy.up()
    via_proxy = rabbitmq_url.replace(server.netloc, f"{server.netloc.rpartition('@')[0]}@127.0.0.1:{proxy.port}")
    try:
        async with durable_queue(rabbitmq_url, "message.appended.*") as received, \
                deployment(tmp_path, rabbitmq_url, database_url) as dep:
            await dep.start("writer", "writer")
            await dep.start("web", "web")
            await dep.start("publisher", "pub-a", TOASTMACHINE_AMQP_URL=via_proxy)
            await dep.processes["pub-a"].wait_for_line(r"publisher\.active", timeout=WAIT)
            await dep.start("publisher", "pub-b")
            await dep.processes["pub-b"].wait_for_line(r"publisher\.standby", timeout=WAIT)

            await proxy.down()
            load = Load()
            loader = asyncio.create_task(run_load(dep.urls["web"], load))
            try:
                await dep.processes["pub-a"].wait_for_line(r"publisher\.handing_over", timeout=120)
                await dep.processes["pub-b"].wait_for_line(r"publisher\.active", timeout=WAIT)
                await loader
            finally:
                if not loader.done():
                    loader.cancel()
            await assert_every_message_sequence(received, database_url)
            await proxy.up()  # so that pub-a, back on its broker, stops as cleanly as the rest
    finally:
        await proxy.down()
