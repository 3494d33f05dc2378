"""The bus contract (:mod:`infra.bus.base`), checked on both backends through the public API only.

Every test takes the ``bus`` fixture, so it runs on the in-process bus and on RabbitMQ. Waiting is
always on an event or a future with a deadline; where a test must show that something did *not*
happen, it sends a sentinel behind it through the same FIFO queue and waits for that instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from infra.bus.base import (
    DEAD_EXCHANGE,
    DEAD_REASON_HEADER,
    DEFAULT_DELIVERY_LIMIT,
    Bus,
    Consumer,
    Delivery,
    QueueKind,
    QueueSpec,
)
from infra.logs import bound_trace, current_trace_id
from protocol.errors import BusError, ProtocolDecodeError, RequestTimeout, Unroutable
from protocol.messages import Ping, Pong, Probe
from tests.bus_fixtures import unique_name

pytestmark = pytest.mark.timeout(60)

WAIT = 15.0  # seconds any single expected event may take, even on a slow CI broker
SENTINEL = -1


class Inbox:
    """A handler that records deliveries; tests wait until enough have arrived."""

    def __init__(self, on_delivery: Callable[[Delivery], Awaitable[None]] | None = None) -> None:
        self.items: list[Delivery] = []
        self._changed = asyncio.Event()
        self._on_delivery = on_delivery

    async def __call__(self, delivery: Delivery) -> None:
        self.items.append(delivery)
        self._changed.set()
        if self._on_delivery is not None:
            await self._on_delivery(delivery)

    async def wait_for(self, count: int, timeout: float = WAIT) -> list[Delivery]:
        async with asyncio.timeout(timeout):
            while len(self.items) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.items

    async def wait_for_probe(self, n: int, timeout: float = WAIT) -> Delivery:
        async with asyncio.timeout(timeout):
            while True:
                for d in self.items:
                    if isinstance(d.message, Probe) and d.message.n == n:
                        return d
                self._changed.clear()
                await self._changed.wait()

    @property
    def numbers(self) -> list[int]:
        return [d.message.n for d in self.items if isinstance(d.message, Probe)]


async def work_queue(bus: Bus, delivery_limit: int = DEFAULT_DELIVERY_LIMIT) -> str:
    return await bus.declare_queue(QueueSpec(unique_name("work"), QueueKind.WORK, delivery_limit=delivery_limit))


async def node_queue(bus: Bus, max_length: int = 1000) -> str:
    return await bus.declare_queue(QueueSpec(unique_name("node"), QueueKind.NODE, max_length=max_length))


async def exchange(bus: Bus) -> str:
    name = unique_name("exchange")
    await bus.declare_exchange(name)
    return name


async def dead_letters_of(bus: Bus, queue: str) -> str:
    """A queue that receives the dead letters of ``queue`` (bound on tm.dead with its name)."""
    watcher = await node_queue(bus)
    await bus.bind(watcher, DEAD_EXCHANGE, queue)
    return watcher


async def stop(*consumers: Consumer) -> None:
    for consumer in consumers:
        await consumer.drain(2)


# --- routing -------------------------------------------------------------------------------------


async def test_topic_routing_with_star_and_hash(bus: Bus) -> None:
    ex = await exchange(bus)
    patterns = ["a.*", "a.#", "a.b.c", "*.x.#", "#"]
    queues: dict[str, str] = {}
    for pattern in patterns:
        queues[pattern] = await node_queue(bus)
        await bus.bind(queues[pattern], ex, pattern)
    keys = ["a.b", "a", "a.b.c", "b.x", "b.x.y.z", "a.x", "c.d.e"]
    expected = {
        "a.*": ["a.b", "a.x"],
        "a.#": ["a.b", "a", "a.b.c", "a.x"],
        "a.b.c": ["a.b.c"],
        "*.x.#": ["b.x", "b.x.y.z", "a.x"],
        "#": keys,
    }
    inboxes = {pattern: Inbox() for pattern in patterns}
    consumers = [await bus.consume(queues[p], inboxes[p], prefetch=1) for p in patterns]
    try:
        for n, key in enumerate(keys):
            await bus.publish(ex, key, Probe(n=n, data=key))
        # The default exchange routes by queue name: a sentinel behind everything else in each queue.
        for pattern in patterns:
            await bus.publish("", queues[pattern], Probe(n=SENTINEL))
        for pattern, inbox in inboxes.items():
            await inbox.wait_for_probe(SENTINEL)
            got = [d.message.data for d in inbox.items if isinstance(d.message, Probe) and d.message.n != SENTINEL]
            assert got == expected[pattern], pattern
            assert all(d.routing_key in keys for d in inbox.items[:-1])
    finally:
        await stop(*consumers)


async def test_exchange_to_exchange_bindings_route_like_a_publish_on_the_destination(bus: Bus) -> None:
    """A corpus's events exchange bound into ``tm.events``: what matches the exchange binding is
    routed by the destination with the same key; a queue reached over two paths, or through a
    cycle of exchange bindings, gets one copy; an unbound queue gets nothing more."""
    source, destination = await exchange(bus), await exchange(bus)
    await bus.bind_exchange(destination, source, "message.#")
    await bus.bind_exchange(source, destination, "#")  # a cycle must not loop or duplicate
    on_destination, on_both, unbound = await node_queue(bus), await node_queue(bus), await node_queue(bus)
    await bus.bind(on_destination, destination, "*.appended.*")
    await bus.bind(on_both, source, "#")
    await bus.bind(on_both, destination, "#")
    await bus.bind(unbound, destination, "#")
    assert await bus.unbind(unbound, destination, "#")
    assert await bus.unbind(unbound, destination, "never.bound")  # removing nothing is a no-op
    assert not await bus.unbind(unique_name("missing"), destination, "#")  # so is a missing queue
    inboxes = {q: Inbox() for q in (on_destination, on_both, unbound)}
    consumers = [await bus.consume(q, inbox, prefetch=10) for q, inbox in inboxes.items()]
    try:
        keys = ["message.appended.3", "relationship.asserted.1", "message.other"]
        for n, key in enumerate(keys):
            await bus.publish(source, key, Probe(n=n, data=key))
        for q in inboxes:
            await bus.publish("", q, Probe(n=SENTINEL))
        for inbox in inboxes.values():
            await inbox.wait_for_probe(SENTINEL)
        assert [d.message.data for d in inboxes[on_destination].items[:-1]] == ["message.appended.3"]  # type: ignore[attr-defined]
        assert inboxes[on_destination].items[0].routing_key == "message.appended.3"
        assert inboxes[on_both].numbers == [0, 1, 2, SENTINEL]
        assert inboxes[unbound].numbers == [SENTINEL]
    finally:
        await stop(*consumers)
    with pytest.raises(BusError):
        await bus.bind_exchange(unique_name("missing"), source, "#")


async def test_publish_to_a_missing_exchange_fails(bus: Bus) -> None:
    with pytest.raises(BusError):
        await bus.publish(unique_name("missing"), "x", Probe(n=1), timeout=5)
    # The bus is still usable afterwards.
    q = await node_queue(bus)
    inbox = Inbox()
    consumer = await bus.consume(q, inbox)
    try:
        await bus.publish("", q, Probe(n=2))
        await inbox.wait_for_probe(2)
    finally:
        await stop(consumer)


async def test_mandatory_publish_to_nothing_raises_unroutable(bus: Bus) -> None:
    ex = await exchange(bus)
    with pytest.raises(Unroutable):
        await bus.publish(ex, "nobody.listens", Probe(n=1), mandatory=True)
    with pytest.raises(Unroutable):
        await bus.publish("", unique_name("no-such-queue"), Probe(n=1), mandatory=True)
    with pytest.raises(Unroutable):
        await bus.request(ex, "nobody.listens", Ping(nonce="x"), timeout=5)
    # Without mandatory the broker drops it quietly: the publish is still confirmed.
    await bus.publish(ex, "nobody.listens", Probe(n=1))


# --- publish, consume, ack -----------------------------------------------------------------------


async def test_confirmed_messages_are_consumed_and_acked(bus: Bus) -> None:
    q = await work_queue(bus)
    acked_before = bus.stats.acked
    for n in range(20):
        await bus.publish("", q, Probe(n=n), message_id=f"m-{n}")
    inbox = Inbox()
    consumer = await bus.consume(q, inbox, prefetch=5)
    try:
        items = await inbox.wait_for(20)
        assert sorted(inbox.numbers) == list(range(20))
        assert all(not d.redelivered and d.delivery_count == 1 for d in items)
        assert {d.message_id for d in items} == {f"m-{n}" for n in range(20)}
        assert all(d.exchange == "" and d.routing_key == q for d in items)
    finally:
        await stop(consumer)
    assert consumer.in_flight == 0
    assert bus.stats.acked - acked_before >= 20
    # Acked means gone: a new consumer of the queue sees only what comes after.
    await bus.publish("", q, Probe(n=SENTINEL))
    again = Inbox()
    consumer = await bus.consume(q, again, prefetch=5)
    try:
        first = (await again.wait_for(1))[0]
        assert isinstance(first.message, Probe) and first.message.n == SENTINEL
    finally:
        await stop(consumer)


async def test_declaring_a_work_queue_again_is_idempotent(bus: Bus) -> None:
    q = await work_queue(bus)
    assert await bus.declare_queue(QueueSpec(q, QueueKind.WORK)) == q
    await bus.publish("", q, Probe(n=1))
    assert await bus.declare_queue(QueueSpec(q, QueueKind.WORK)) == q
    inbox = Inbox()
    consumer = await bus.consume(q, inbox)
    try:
        await inbox.wait_for_probe(1)
    finally:
        await stop(consumer)


async def test_prefetch_bounds_unsettled_deliveries(bus: Bus) -> None:
    q = await work_queue(bus)
    for n in range(20):
        await bus.publish("", q, Probe(n=n))
    gate = asyncio.Event()
    reached = asyncio.Event()
    all_seen = asyncio.Event()
    fourth = asyncio.Event()
    seen: list[int] = []
    active = 0
    most = 0

    def note(d: Delivery) -> None:
        assert isinstance(d.message, Probe)
        seen.append(d.message.n)
        if len(seen) >= 4:
            fourth.set()
        if len(seen) == 20:
            all_seen.set()

    async def slow(d: Delivery) -> None:
        nonlocal active, most
        note(d)
        active += 1
        most = max(most, active)
        if active == 3:
            reached.set()
        try:
            await gate.wait()
        finally:
            active -= 1

    async def quick(d: Delivery) -> None:
        note(d)

    a = await bus.consume(q, slow, prefetch=3)
    b: Consumer | None = None
    try:
        async with asyncio.timeout(WAIT):
            await reached.wait()
        # A second consumer gets work while the first is full: the bus saw it had no room.
        b = await bus.consume(q, Inbox(quick), prefetch=1)
        async with asyncio.timeout(WAIT):
            await fourth.wait()
        assert a.in_flight == 3 and most == 3
        gate.set()
        async with asyncio.timeout(WAIT):
            await all_seen.wait()
        assert most == 3
        assert sorted(seen) == list(range(20))
    finally:
        gate.set()
        await stop(a, *([b] if b else []))


async def test_competing_consumers_share_the_work(bus: Bus) -> None:
    q = await work_queue(bus)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    done = asyncio.Event()

    def handler(name: str) -> Callable[[Delivery], Awaitable[None]]:
        async def handle(d: Delivery) -> None:
            assert isinstance(d.message, Probe)
            seen[name].append(d.message.n)
            await asyncio.sleep(0.002)  # some work, so neither consumer can take everything
            if len(seen["a"]) + len(seen["b"]) >= 40:
                done.set()
        return handle

    a = await bus.consume(q, handler("a"), prefetch=1)
    b = await bus.consume(q, handler("b"), prefetch=1)
    try:
        for n in range(40):
            await bus.publish("", q, Probe(n=n))
        async with asyncio.timeout(WAIT):
            await done.wait()
        assert sorted(seen["a"] + seen["b"]) == list(range(40))
        assert len(seen["a"]) >= 5 and len(seen["b"]) >= 5, seen
    finally:
        await stop(a, b)


# --- failure, redelivery, dead letters -----------------------------------------------------------


async def test_a_failing_handler_gets_the_message_again(bus: Bus) -> None:
    q = await work_queue(bus, delivery_limit=5)

    async def fail_twice(d: Delivery) -> None:
        if d.delivery_count < 3:
            raise RuntimeError("transient failure")

    inbox = Inbox(fail_twice)
    consumer = await bus.consume(q, inbox, prefetch=1)
    try:
        await bus.publish("", q, Probe(n=7))
        items = await inbox.wait_for(3)
        assert [(d.redelivered, d.delivery_count) for d in items] == [(False, 1), (True, 2), (True, 3)]
        assert all(isinstance(d.message, Probe) and d.message.n == 7 for d in items)
        # The third attempt succeeded and was acked: nothing comes after it but the sentinel.
        await bus.publish("", q, Probe(n=SENTINEL))
        items = await inbox.wait_for(4)
        assert isinstance(items[3].message, Probe) and items[3].message.n == SENTINEL
    finally:
        await stop(consumer)


async def test_delivery_limit_dead_letters_with_the_reason(bus: Bus) -> None:
    q = await work_queue(bus, delivery_limit=3)
    dead = Inbox()
    watcher = await bus.consume(await dead_letters_of(bus, q), dead)

    async def always_fail(d: Delivery) -> None:
        raise RuntimeError("poison")

    attempts = Inbox(always_fail)
    consumer = await bus.consume(q, attempts, prefetch=1)
    try:
        await bus.publish("tm.commands", "ignored", Probe(n=0))  # unrelated traffic must not matter
        await bus.publish("", q, Probe(n=42, data="payload"))
        letter = (await dead.wait_for(1))[0]
        assert letter.message == Probe(n=42, data="payload")
        assert letter.headers[DEAD_REASON_HEADER] == "delivery_limit"
        assert letter.exchange == DEAD_EXCHANGE and letter.routing_key == q
        assert [d.delivery_count for d in attempts.items] == [1, 2, 3]
    finally:
        await stop(consumer, watcher)


async def test_undecodable_bodies_are_dead_lettered_and_never_handled(bus: Bus) -> None:
    q = await work_queue(bus)
    dead = await dead_letters_of(bus, q)
    inbox = Inbox()
    consumer = await bus.consume(q, inbox, prefetch=1)
    try:
        await bus.publish_raw("", q, b"{not json", Probe.TYPE)  # type: ignore[attr-defined]
        await bus.publish_raw("", q, b'{"n": 1}', "no.such.type")  # type: ignore[attr-defined]
        await bus.publish_raw("", q, b'{"n": 1, "extra": true}', Probe.TYPE)  # type: ignore[attr-defined]
        await bus.publish("", q, Probe(n=SENTINEL))
        await inbox.wait_for_probe(SENTINEL)
        assert inbox.numbers == [SENTINEL]
        letters = []
        for _ in range(3):
            raw = await bus.fetch_raw(dead, timeout=WAIT)  # type: ignore[attr-defined]
            assert raw is not None
            letters.append(raw)
        assert [r.body for r in letters] == [b"{not json", b'{"n": 1}', b'{"n": 1, "extra": true}']
        reasons = [str(r.headers[DEAD_REASON_HEADER]) for r in letters]
        assert "not valid JSON" in reasons[0]
        assert "unknown message type 'no.such.type'" in reasons[1]
        assert "unknown=['extra']" in reasons[2]
        assert [r.type_name for r in letters] == [Probe.TYPE, "no.such.type", Probe.TYPE]
        assert all(r.routing_key == q for r in letters)
    finally:
        await stop(consumer)


async def test_handler_raising_decode_error_dead_letters_at_once(bus: Bus) -> None:
    q = await work_queue(bus)
    dead = Inbox()
    watcher = await bus.consume(await dead_letters_of(bus, q), dead)

    async def reject(d: Delivery) -> None:
        raise ProtocolDecodeError("field n out of range")

    attempts = Inbox(reject)
    consumer = await bus.consume(q, attempts)
    try:
        await bus.publish("", q, Probe(n=3))
        letter = (await dead.wait_for(1))[0]
        assert letter.headers[DEAD_REASON_HEADER] == "field n out of range"
        assert letter.message == Probe(n=3)
        assert len(attempts.items) == 1
    finally:
        await stop(consumer, watcher)


async def test_nack_without_requeue_dead_letters_a_work_message(bus: Bus) -> None:
    q = await work_queue(bus)
    dead = Inbox()
    watcher = await bus.consume(await dead_letters_of(bus, q), dead)

    async def refuse(d: Delivery) -> None:
        await d.nack(requeue=False)

    consumer = await bus.consume(q, Inbox(refuse))
    try:
        await bus.publish("", q, Probe(n=5))
        letter = (await dead.wait_for(1))[0]
        assert letter.headers[DEAD_REASON_HEADER] == "rejected" and letter.message == Probe(n=5)
    finally:
        await stop(consumer, watcher)


async def test_unsettled_work_of_a_drained_consumer_goes_to_another(bus: Bus) -> None:
    q = await work_queue(bus)
    entered = asyncio.Event()

    async def stuck(d: Delivery) -> None:
        entered.set()
        await asyncio.Event().wait()  # never finishes on its own

    a = await bus.consume(q, stuck, prefetch=1)
    await bus.publish("", q, Probe(n=9))
    async with asyncio.timeout(WAIT):
        await entered.wait()
    other = Inbox()
    b = await bus.consume(q, other, prefetch=1)
    try:
        assert await a.drain(0.2) is False
        assert a.in_flight == 0
        d = (await other.wait_for(1))[0]
        assert d.message == Probe(n=9)
        assert d.redelivered and d.delivery_count == 2
    finally:
        await stop(a, b)


async def test_a_cancelled_consumer_finishes_its_work_but_takes_no_more(bus: Bus) -> None:
    q = await work_queue(bus)
    release = asyncio.Event()
    entered = asyncio.Event()

    async def gated(d: Delivery) -> None:
        entered.set()
        await release.wait()

    first = Inbox(gated)
    a = await bus.consume(q, first, prefetch=1)
    await bus.publish("", q, Probe(n=1))
    async with asyncio.timeout(WAIT):
        await entered.wait()
    await a.cancel()
    await bus.publish("", q, Probe(n=2))
    release.set()
    assert await a.drain(WAIT) is True
    assert first.numbers == [1]
    second = Inbox()
    b = await bus.consume(q, second, prefetch=1)
    try:
        d = await second.wait_for_probe(2)
        assert second.numbers == [2]  # 1 was acked by the cancelled consumer's handler
        assert d.delivery_count <= 2
    finally:
        await stop(b)


# --- request / reply -----------------------------------------------------------------------------


async def test_request_reply_round_trip_with_correlation(bus: Bus) -> None:
    ex = await exchange(bus)
    q = await node_queue(bus)
    await bus.bind(q, ex, "ping")
    seen: list[Delivery] = []

    async def responder(d: Delivery) -> None:
        assert isinstance(d.message, Ping)
        seen.append(d)
        await bus.reply(d, Pong(nonce=d.message.nonce, responder="r"), headers={"x-answer": "yes"})

    consumer = await bus.consume(q, responder, prefetch=10)
    try:
        before = time.time()
        replies = await asyncio.gather(*(bus.request(ex, "ping", Ping(nonce=f"n{i}"), timeout=WAIT)
                                         for i in range(10)))
        assert [r.message for r in replies] == [Pong(nonce=f"n{i}", responder="r") for i in range(10)]
        by_nonce = {d.message.nonce: d for d in seen if isinstance(d.message, Ping)}
        for i, r in enumerate(replies):
            request = by_nonce[f"n{i}"]
            assert r.correlation_id is not None and r.correlation_id == request.correlation_id
            assert r.headers["x-answer"] == "yes"
            assert request.reply_to
            assert request.deadline is not None and request.deadline > before
            assert not request.expired()
        assert len({d.correlation_id for d in seen}) == 10
    finally:
        await stop(consumer)


async def test_request_without_reply_times_out(bus: Bus) -> None:
    q = await node_queue(bus)
    silent = Inbox()
    consumer = await bus.consume(q, silent)
    try:
        async with asyncio.timeout(WAIT):
            with pytest.raises(RequestTimeout):
                await bus.request("", q, Ping(nonce="x"), timeout=0.5)
        assert len(silent.items) == 1
        # A late reply to a request that gave up is dropped, and the bus carries on.
        await bus.reply(silent.items[0], Pong(nonce="x", responder="late"))
    finally:
        await stop(consumer)


# --- trace id ------------------------------------------------------------------------------------


async def test_trace_id_travels_from_publisher_to_handler(bus: Bus) -> None:
    q = await node_queue(bus)
    bound: list[str | None] = []

    async def record(d: Delivery) -> None:
        bound.append(current_trace_id())

    inbox = Inbox(record)
    consumer = await bus.consume(q, inbox, prefetch=1)
    try:
        with bound_trace("trace-from-the-http-request"):
            await bus.publish("", q, Probe(n=1))
        await bus.publish("", q, Probe(n=2))  # no trace bound: the handler gets a fresh one
        items = await inbox.wait_for(2)
        assert items[0].trace_id == "trace-from-the-http-request"
        assert bound[0] == "trace-from-the-http-request"
        assert items[1].trace_id is None
        assert bound[1] is not None and bound[1] != "trace-from-the-http-request"
    finally:
        await stop(consumer)


# --- NODE queues ---------------------------------------------------------------------------------


async def test_node_queue_drops_the_oldest_past_its_max_length(bus: Bus) -> None:
    q = await node_queue(bus, max_length=5)
    for n in range(12):
        await bus.publish("", q, Probe(n=n))
    inbox = Inbox()
    consumer = await bus.consume(q, inbox, prefetch=1)
    try:
        await inbox.wait_for(5)
        await bus.publish("", q, Probe(n=SENTINEL))
        await inbox.wait_for_probe(SENTINEL)
        assert inbox.numbers == [7, 8, 9, 10, 11, SENTINEL]
    finally:
        await stop(consumer)


# --- the no-ack form ------------------------------------------------------------------------------


async def test_a_no_ack_consumer_never_gets_a_message_again_and_its_errors_are_only_logged(bus: Bus) -> None:
    """Once delivered the message is gone: a failing handler gets nothing back, and the settling
    calls the ack policy makes are no-ops (on RabbitMQ a basic.ack of a no-ack delivery would
    close the channel, and the sentinel would never come)."""
    q = await node_queue(bus)

    async def fail_once(d: Delivery) -> None:
        if isinstance(d.message, Probe) and d.message.n == 1:
            raise RuntimeError("a handler bug")

    inbox = Inbox(fail_once)
    consumer = await bus.consume(q, inbox, prefetch=4, no_ack=True)
    try:
        for n in (1, 2):
            await bus.publish("", q, Probe(n=n))
        await bus.publish("", q, Probe(n=SENTINEL))
        await inbox.wait_for_probe(SENTINEL)
        assert sorted(inbox.numbers) == [SENTINEL, 1, 2]
        assert all(d.delivery_count == 1 and not d.redelivered for d in inbox.items)
        await bus.publish("", q, Probe(n=SENTINEL - 1))
        await inbox.wait_for_probe(SENTINEL - 1)
        assert sorted(inbox.numbers) == [SENTINEL - 1, SENTINEL, 1, 2]
    finally:
        await stop(consumer)


async def test_a_no_ack_consumer_still_dead_letters_with_the_reason(bus: Bus) -> None:
    q = await node_queue(bus)
    dead = await dead_letters_of(bus, q)

    async def reject(d: Delivery) -> None:
        if isinstance(d.message, Probe) and d.message.n == 3:
            raise ProtocolDecodeError("field n out of range")

    inbox = Inbox(reject)
    consumer = await bus.consume(q, inbox, no_ack=True)
    try:
        await bus.publish_raw("", q, b"{not json", Probe.TYPE)  # type: ignore[attr-defined]
        await bus.publish("", q, Probe(n=3))
        letters = []
        for _ in range(2):
            raw = await bus.fetch_raw(dead, timeout=WAIT)  # type: ignore[attr-defined]
            assert raw is not None
            letters.append(raw)
        reasons = [str(r.headers[DEAD_REASON_HEADER]) for r in letters]
        assert any("not valid JSON" in r for r in reasons) and "field n out of range" in reasons, reasons
        assert inbox.numbers == [3]
    finally:
        await stop(consumer)


async def test_a_no_ack_consumer_drops_what_arrives_while_every_handler_slot_is_busy(bus: Bus) -> None:
    """``prefetch`` bounds the handlers of a no-ack consumer; a delivery past it is dropped and
    counted, never queued without bound in the process."""
    q = await node_queue(bus)
    release, finished = asyncio.Event(), asyncio.Event()

    async def block_on_first(d: Delivery) -> None:
        if isinstance(d.message, Probe) and d.message.n == 0:
            await release.wait()
            finished.set()  # the handler returns without awaiting again: its slot is free next

    inbox = Inbox(block_on_first)
    consumer = await bus.consume(q, inbox, prefetch=1, no_ack=True)
    dropped_before = bus.stats.extra.get("no_ack_dropped", 0)
    try:
        await bus.publish("", q, Probe(n=0))
        await inbox.wait_for_probe(0)
        for n in (1, 2):
            await bus.publish("", q, Probe(n=n))
        # Nothing signals a drop but the counter: wait for it (bounded), then free the slot.
        async with asyncio.timeout(WAIT):
            while bus.stats.extra.get("no_ack_dropped", 0) < dropped_before + 2:
                await asyncio.sleep(0.01)
        release.set()
        await finished.wait()
        await bus.publish("", q, Probe(n=SENTINEL))
        await inbox.wait_for_probe(SENTINEL)
        assert inbox.numbers == [0, SENTINEL]
    finally:
        release.set()
        await stop(consumer)


# --- lifecycle -----------------------------------------------------------------------------------


async def test_stats_check_and_close(bus: Bus) -> None:
    await bus.check()
    assert bus.stats.connected
    published = bus.stats.published
    q = await node_queue(bus)
    await bus.publish("", q, Probe(n=1))
    assert bus.stats.published == published + 1
    inbox = Inbox()
    consumer = await bus.consume(q, inbox)
    await inbox.wait_for(1)
    await stop(consumer)
    assert bus.stats.delivered >= 1 and bus.stats.acked >= 1
