"""The actor runtime: supervision with backoff, idempotent phased stop, nothing acked is lost."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from infra.bus.base import Bus, Delivery, QueueKind, QueueSpec
from infra.runtime import Actor, ActorState, Backoff, ConsumerActor, Supervisor
from protocol.errors import ConfigError
from protocol.messages import Probe


class Flaky(Actor):
    """Crashes in run() until it has been started ``crashes + 1`` times."""

    name = "flaky"
    starts = 0
    closes = 0

    def __init__(self, crashes: int, healthy: asyncio.Event) -> None:
        super().__init__()
        self.crashes = crashes
        self.healthy = healthy

    async def run(self) -> None:
        type(self).starts += 1
        if type(self).starts <= self.crashes:
            raise RuntimeError(f"boom #{type(self).starts}")
        self.healthy.set()
        await super().run()

    async def close(self) -> None:
        type(self).closes += 1


async def test_supervisor_restarts_a_crashed_actor_with_backoff() -> None:
    Flaky.starts = Flaky.closes = 0
    healthy = asyncio.Event()
    sup = Supervisor({"flaky": lambda: Flaky(2, healthy)}, Backoff(initial=0.01, maximum=0.05))
    await sup.start(wait=5)
    async with asyncio.timeout(10):
        await healthy.wait()
    h = sup.health["flaky"]
    assert h.restarts == 2
    assert h.last_error == "RuntimeError: boom #2"
    assert h.state is ActorState.RUNNING
    assert Flaky.closes == 2, "each crashed instance was torn down before the next started"
    await sup.stop(grace=1)
    assert sup.health["flaky"].state is ActorState.STOPPED
    assert Flaky.closes == 3


class FailingSetup(Actor):
    name = "failing"

    async def setup(self) -> None:
        raise ConnectionError("database gone")


async def test_a_failing_start_is_retried_and_reported() -> None:
    sup = Supervisor({"failing": FailingSetup}, Backoff(initial=0.01, maximum=0.02))
    with pytest.raises(TimeoutError):
        await sup.start(wait=0.3)
    # Retried: a second restart follows, however loaded the machine (each crash renders a
    # traceback, which took most of the 0.3 s once under the parallel suite).
    async with asyncio.timeout(10):
        while sup.health["failing"].restarts < 2:
            await asyncio.sleep(0.01)
    assert sup.health["failing"].restarts >= 2
    assert sup.health["failing"].last_error == "ConnectionError: database gone"
    assert not sup.ready
    await sup.stop(grace=0.1)


class MisconfiguredSetup(Actor):
    name = "misconfigured"
    starts = 0

    async def setup(self) -> None:
        type(self).starts += 1
        raise ConfigError("TOASTMACHINE_EXAMPLE is wrong")


@pytest.mark.parametrize("where", ["building", "starting"])
async def test_a_configuration_error_is_not_retried_and_start_raises_it_at_once(where: str) -> None:
    def build() -> Actor:
        if where == "building":
            raise ConfigError("TOASTMACHINE_EXAMPLE is wrong")
        return MisconfiguredSetup()

    MisconfiguredSetup.starts = 0
    healthy = asyncio.Event()
    sup = Supervisor({"fine": lambda: Flaky(0, healthy), "misconfigured": build},
                     Backoff(initial=0.01, maximum=0.02))
    # Far sooner than the start deadline: nothing waits for a restart that cannot help.
    async with asyncio.timeout(10):
        with pytest.raises(ConfigError, match="TOASTMACHINE_EXAMPLE is wrong"):
            await sup.start(wait=3600)
    health = sup.health["misconfigured"]
    assert health.state is ActorState.FAILED
    assert health.last_error == "ConfigError: TOASTMACHINE_EXAMPLE is wrong"
    assert health.restarts == 0 and not sup.ready
    assert MisconfiguredSetup.starts == (1 if where == "starting" else 0)
    await sup.stop(grace=1)
    assert sup.health["misconfigured"].state is ActorState.FAILED
    assert MisconfiguredSetup.starts == (1 if where == "starting" else 0)


async def test_stop_is_idempotent_and_concurrent_safe() -> None:
    class Counting(Actor):
        name = "counting"
        closed = 0

        async def close(self) -> None:
            type(self).closed += 1

    actor = Counting()
    await actor.start()
    await asyncio.gather(actor.stop(0.1), actor.stop(0.1), actor.stop(0.1))
    await actor.stop(0.1)
    assert Counting.closed == 1


class Gate(ConsumerActor):
    """A consumer actor whose handler blocks until the test opens the gate."""

    name = "gate"

    def __init__(self, bus: Bus, queue: str, *, release: asyncio.Event) -> None:
        self.queue = QueueSpec(queue, QueueKind.WORK)
        super().__init__(bus, prefetch=4)
        self.entered = asyncio.Event()
        self.release = release
        self.done: list[int] = []

    async def handle(self, delivery: Delivery) -> None:
        assert isinstance(delivery.message, Probe)
        self.entered.set()
        await self.release.wait()
        self.done.append(delivery.message.n)


async def _first_message(bus: Bus, queue: str) -> Delivery:
    got: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()

    async def handler(d: Delivery) -> None:
        if not got.done():
            got.set_result(d)

    consumer = await bus.consume(queue, handler, prefetch=1)
    try:
        async with asyncio.timeout(15):
            return await got
    finally:
        await consumer.drain(1)


async def test_stop_lets_in_flight_work_finish_and_ack(bus: Bus) -> None:
    queue = f"test.runtime.{uuid.uuid4().hex[:8]}"
    release = asyncio.Event()
    actor = Gate(bus, queue, release=release)
    await actor.start()
    await bus.publish("", queue, Probe(n=1))
    async with asyncio.timeout(10):
        await actor.entered.wait()
    stopping = asyncio.create_task(actor.stop(grace=10))
    await asyncio.sleep(0)  # let stop() cancel the consumer before the handler finishes
    release.set()
    await stopping
    assert actor.done == [1]
    # The message was acked: the next consumer of the queue sees only what comes after it.
    await bus.publish("", queue, Probe(n=2))
    d = await _first_message(bus, queue)
    assert isinstance(d.message, Probe) and d.message.n == 2 and not d.redelivered


async def test_work_cut_off_by_the_grace_deadline_is_redelivered(bus: Bus) -> None:
    queue = f"test.runtime.{uuid.uuid4().hex[:8]}"
    actor = Gate(bus, queue, release=asyncio.Event())  # never released
    await actor.start()
    await bus.publish("", queue, Probe(n=7))
    async with asyncio.timeout(10):
        await actor.entered.wait()
    await actor.stop(grace=0.2)
    assert actor.done == []
    d = await _first_message(bus, queue)
    assert isinstance(d.message, Probe) and d.message.n == 7
    assert d.redelivered and d.delivery_count >= 2


async def test_a_factory_failing_otherwise_is_a_configuration_error_not_a_silent_hang() -> None:
    """An actor whose factory raises something other than ConfigError (an OSError from a path it
    was given) fails like a misconfigured one: start raises at once, naming the actor and the
    error, instead of the supervising task ending unseen and start waiting for ever."""
    def build() -> Actor:
        raise FileExistsError(17, "File exists")

    sup = Supervisor({"broken": build}, Backoff(initial=0.01, maximum=0.02))
    async with asyncio.timeout(10):
        with pytest.raises(ConfigError, match=r"broken could not be set up: FileExistsError: \[Errno 17\] File exists"):
            await sup.start(wait=3600)
    assert sup.health["broken"].state is ActorState.FAILED
    await sup.stop(grace=1)


async def test_a_factory_failing_at_a_restart_is_a_crash_restarted_after_the_back_off() -> None:
    """The same settings built the actor once: a factory failing when it is rebuilt after a crash
    (a key file briefly unreadable) is retried after the back-off, not the process stopped."""
    Flaky.starts = Flaky.closes = 0
    healthy = asyncio.Event()
    builds = 0

    def build() -> Actor:
        nonlocal builds
        builds += 1
        if builds == 2:  # the first rebuild, after the first crash
            raise PermissionError(13, "Permission denied")
        return Flaky(1, healthy)

    sup = Supervisor({"flaky": build}, Backoff(initial=0.01, maximum=0.02))
    await sup.start(wait=10)
    async with asyncio.timeout(10):
        await healthy.wait()
    assert builds == 3 and sup.misconfigured is None
    assert sup.health["flaky"].restarts == 2
    await sup.stop(grace=1)
