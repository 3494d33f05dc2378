"""Bus fixtures: every test that takes ``bus`` runs twice, on the in-process bus and on RabbitMQ.

Tests share one RabbitMQ broker, so they name what they declare with :func:`unique_name` (a uuid
suffix), and the fixture deletes every ``test.*`` queue and exchange the test declared through the
bus when it ends: nothing a test leaves behind can be consumed by the next one.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from infra.bus.base import Bus
from infra.bus.memory import MemoryBus
from infra.bus.rabbitmq import RabbitBus
from protocol.errors import BusUnavailable

TEST_PREFIX = "test."
#: Seconds the ``bus`` fixture's first connect to RabbitMQ may take.
FIXTURE_CONNECT_TIMEOUT = 30.0

__all__ = ["bus", "bus_backend", "cleanup_rabbit", "names", "unique_name"]


def unique_name(kind: str) -> str:
    """A queue or exchange name no other test (or earlier run) uses: ``test.<kind>.<uuid>``."""
    return f"{TEST_PREFIX}{kind}.{uuid.uuid4().hex[:12]}"


@pytest.fixture
def names() -> Callable[[str], str]:
    """:func:`unique_name` as a fixture, for tests that prefer injection."""
    return unique_name


@pytest.fixture(params=["memory", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def bus_backend(request: pytest.FixtureRequest) -> str | None:
    """The AMQP URL of the backend under test, or None for the in-process bus.

    A plain (sync) fixture on purpose: ``rabbitmq_url`` probes the broker with ``asyncio.run``,
    which cannot run inside the event loop of an async fixture.
    """
    if request.param == "memory":
        return None
    url: str = request.getfixturevalue("rabbitmq_url")
    return url


@pytest.fixture
async def bus(bus_backend: str | None, request: pytest.FixtureRequest) -> AsyncIterator[Bus]:
    """A connected bus of each backend, closed (and its test queues deleted) after the test."""
    if bus_backend is None:
        memory = MemoryBus()
        await memory.connect()
        try:
            yield memory
        finally:
            await memory.close()
        return
    # More patience than a node's 10 s: on a loaded CI machine the broker once took longer than that
    # to open a connection (both fixtures waiting then failed the run); this fixture is no test of
    # how a node handles a broker that will not answer (test_bus_faults and test_cli are).
    rabbit = RabbitBus(bus_backend, connection_name=f"test:{request.node.name}", connect_timeout=FIXTURE_CONNECT_TIMEOUT)
    await rabbit.connect()
    try:
        yield rabbit
    finally:
        await cleanup_rabbit(rabbit)
        await rabbit.close()


async def cleanup_rabbit(bus: RabbitBus) -> None:
    """Delete the ``test.*`` queues and exchanges declared through ``bus`` (best effort)."""
    with contextlib.suppress(BusUnavailable):
        # A test that cut the connection may end before the reconnect: give it a moment.
        await bus.wait_connected(5)
    if bus.stats.connected:
        for name in sorted(n for n in bus.declared_queues if n.startswith(TEST_PREFIX)):
            with contextlib.suppress(Exception):
                await bus.delete_queue(name)
        for name in sorted(n for n in bus.declared_exchanges if n.startswith(TEST_PREFIX)):
            with contextlib.suppress(Exception):
                await bus.delete_exchange(name)
