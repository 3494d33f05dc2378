"""Real faults against the RabbitMQ bus: the broker drops every connection mid-stream; the broker is
not there at all. ``rabbitmqctl close_all_connections`` closes every connection of the test run's
virtual host (see tests/services.py), as a network cut would.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest

from infra.bus.base import Delivery, QueueKind, QueueSpec
from infra.bus.rabbitmq import RabbitBus
from protocol.errors import BusUnavailable
from protocol.messages import Ping, Pong, Probe
from tests import services
from tests.bus_fixtures import cleanup_rabbit, unique_name

pytestmark = [pytest.mark.fault, pytest.mark.timeout(120)]

COUNT = 2_000
WINDOW = 10  # publishes in flight at once


async def connected_bus(url: str, name: str) -> RabbitBus:
    bus = RabbitBus(url, connection_name=name, reconnect_interval=0.5)
    await bus.connect()
    return bus


@pytest.mark.rabbitmq
async def test_confirmed_messages_survive_dropped_connections(rabbitmq_url: str) -> None:
    publisher = await connected_bus(rabbitmq_url, "fault-test-publisher")
    consumer_bus = await connected_bus(rabbitmq_url, "fault-test-consumer")
    killers: list[asyncio.Task[None]] = []
    consumer = None
    try:
        queue = await publisher.declare_queue(QueueSpec(unique_name("fault"), QueueKind.WORK))
        seen: set[int] = set()
        confirmed: set[int] = set()
        publishing_done = False
        all_delivered = asyncio.Event()

        def check_done() -> None:
            if publishing_done and confirmed <= seen:
                all_delivered.set()

        async def handler(d: Delivery) -> None:
            assert isinstance(d.message, Probe)
            seen.add(d.message.n)
            check_done()

        consumer = await consumer_bus.consume(queue, handler, prefetch=50)

        async def publish(n: int) -> None:
            await publisher.publish("", queue, Probe(n=n, data="x" * 64), timeout=30)
            confirmed.add(n)

        async with asyncio.timeout(90):
            kills = 0
            for start in range(0, COUNT, WINDOW):
                await asyncio.gather(*(publish(n) for n in range(start, min(start + WINDOW, COUNT))))
                # Two cuts, each while messages are in flight: the second only once the first has
                # been survived, so they are two separate outages.
                if kills == 0 and start >= 100 or kills == 1 and publisher.stats.reconnects >= 1:
                    kills += 1
                    killers.append(asyncio.create_task(services.drop_broker_connections(rabbitmq_url, f"fault test: cut {kills}")))
                # Pace the stream so that it is still running when each cut lands.
                await asyncio.sleep(0.01)
            publishing_done = True
            check_done()
            await all_delivered.wait()
            await asyncio.gather(*killers)

        assert confirmed == set(range(COUNT))
        assert seen >= confirmed
        assert kills == 2
        await publisher.wait_connected(30)
        await consumer_bus.wait_connected(30)
        assert publisher.stats.reconnects >= 2 and consumer_bus.stats.reconnects >= 2
        assert publisher.stats.connected and consumer_bus.stats.connected
        await publisher.check()
        await consumer_bus.check()
    finally:
        for task in killers:
            if not task.done():
                task.cancel()
        await asyncio.gather(*killers, return_exceptions=True)
        if consumer is not None:
            await consumer.drain(2)
        await cleanup_rabbit(publisher)
        await consumer_bus.close()
        await publisher.close()


@pytest.mark.rabbitmq
async def test_request_reply_works_again_after_the_connection_drops(rabbitmq_url: str) -> None:
    server = await connected_bus(rabbitmq_url, "fault-test-server")
    client = await connected_bus(rabbitmq_url, "fault-test-client")
    consumer = None
    try:
        queue = await server.declare_queue(QueueSpec(unique_name("fault-rpc"), QueueKind.WORK))

        async def answer(d: Delivery) -> None:
            assert isinstance(d.message, Ping)
            await server.reply(d, Pong(nonce=d.message.nonce, responder="server"))

        consumer = await server.consume(queue, answer)
        before = await client.request("", queue, Ping(nonce="before"), timeout=10)
        assert before.message == Pong(nonce="before", responder="server")
        await services.drop_broker_connections(rabbitmq_url, "fault test: request/reply")
        # The request waits for the reconnect (publish retries), then for the restored consumers.
        nonce = uuid.uuid4().hex
        after = await client.request("", queue, Ping(nonce=nonce), timeout=30)
        assert after.message == Pong(nonce=nonce, responder="server")
        await server.wait_connected(30)
        await client.wait_connected(30)
        assert client.stats.reconnects >= 1 and server.stats.reconnects >= 1
        await client.check()
    finally:
        if consumer is not None:
            await consumer.drain(2)
        await cleanup_rabbit(server)
        await client.close()
        await server.close()


async def test_first_connect_to_a_closed_port_fails_fast_with_a_clear_message() -> None:
    bus = RabbitBus("amqp://guest:s3cret-pw@127.0.0.1:1/", connect_timeout=5)
    async with asyncio.timeout(8):
        with pytest.raises(BusUnavailable) as caught:
            await bus.connect()
    message = str(caught.value)
    assert "amqp://guest:***@127.0.0.1:1/" in message
    assert "s3cret-pw" not in message
    assert not bus.stats.connected
    with pytest.raises(BusUnavailable):
        await bus.check()
    await bus.close()  # closing a bus that never connected is a no-op


@pytest.mark.rabbitmq
async def test_a_virtual_host_that_does_not_exist_is_named_as_the_likely_cause(rabbitmq_url: str) -> None:
    """The broker closes Connection.Open on an unknown vhost: the message says what to check, not
    aiormq's "Expected one of ['Connection.OpenOk'], got <Connection.Close object at 0x...>"."""
    parts = urlsplit(rabbitmq_url)
    missing = urlunsplit((parts.scheme, parts.netloc, f"/no-such-vhost-{unique_name('v')}", "", ""))
    bus = RabbitBus(missing, connect_timeout=10)
    async with asyncio.timeout(15):
        with pytest.raises(BusUnavailable) as caught:
            await bus.connect()
    message = str(caught.value)
    assert "virtual host in the URL does not exist" in message and "object at 0x" not in message, message
    await bus.close()


@pytest.mark.rabbitmq
async def test_a_consumer_takes_a_burst_in_a_few_loop_turns(rabbitmq_url: str) -> None:
    """aiormq passes frames from the connection to a channel through a queue of 10 (one hand-over
    per loop turn); our consumers lift that bound (infra/bus/rabbitmq.py ``_subscribe``, which also
    subscribes the channels a reconnect opens). Proof by behaviour: 200 messages wait in the queue;
    the consumer subscribes and the loop is held while the broker pushes them (a process whose loop
    turns are long, like a web node feeding thousands of streams); the consumer then starts all of
    them within ten loop turns, where the bounded hand-over allows about three messages a turn."""
    bus = await connected_bus(rabbitmq_url, "burst")
    consumer = None
    try:
        queue = await bus.declare_queue(QueueSpec(unique_name("burst"), QueueKind.WORK))
        await asyncio.gather(*(bus.publish("", queue, Probe(n=n, data="x"), timeout=30) for n in range(200)))
        turns: list[int] = []
        turn = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal turn
            while True:
                turn += 1
                await asyncio.sleep(0)

        async def handler(d: Delivery) -> None:
            turns.append(turn)
            if len(turns) == 200:
                done.set()

        tick = asyncio.create_task(ticker())
        try:
            consumer = await bus.consume(queue, handler, prefetch=500)
            # Hold the loop (a long turn, not a synchronisation): the deliveries pile up unread.
            time.sleep(2.0)  # noqa: ASYNC251 - blocking on purpose (ample for 200 local deliveries)
            async with asyncio.timeout(30):
                await done.wait()
        finally:
            tick.cancel()
        assert max(turns) - min(turns) <= 10, max(turns) - min(turns)
    finally:
        if consumer is not None:
            await consumer.drain(2)
        await cleanup_rabbit(bus)
        await bus.close()
