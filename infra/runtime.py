"""Actor base classes and the supervisor that keeps them running.

Life of an actor: :meth:`Actor.start` acquires what it needs and begins taking work, then its
:meth:`Actor.run` coroutine runs until stopped. If ``run`` raises (or the actor calls :meth:`fail`),
the actor has crashed: the :class:`Supervisor` logs why, tears it down and starts a fresh instance
after an exponential backoff. :meth:`Actor.stop` is idempotent and goes in phases:

1. stop taking work (cancel consumers),
2. let in-flight work finish within the grace period,
3. cancel what is left (its messages were never acked, so the bus redelivers them),
4. close connections.

Nothing acknowledged is lost by a stop, because acknowledgement happens only after the effect is
durable; work that is cut off in phase 3 is simply delivered again.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from infra.bus.base import Bus, Consumer, Delivery, QueueSpec
from infra.logs import get_logger
from protocol.errors import ConfigError, ProcessFatal

log = get_logger("toastmachine.runtime")


class ActorState(enum.Enum):
    """What the supervisor last saw of an actor."""

    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"  # crashed; waiting to restart
    FAILED = "failed"  # its configuration is wrong, or it met a ProcessFatal: not restarted (see Supervisor)
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(slots=True)
class ActorHealth:
    """Per-actor health, rendered by /readyz and exported to /metrics."""

    name: str
    state: ActorState = ActorState.STARTING
    restarts: int = 0
    last_error: str | None = None
    since: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return self.state is ActorState.RUNNING

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state.value, "restarts": self.restarts}
        if self.last_error:
            out["last_error"] = self.last_error
        return out


class Actor(abc.ABC):
    """A long-running unit of work. Subclasses override :meth:`setup`, :meth:`run`, :meth:`close`."""

    #: The name used by ``toastmachine run NAME``, logs and metrics.
    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self.log = get_logger(f"toastmachine.actors.{self.name}", actor=self.name)
        self._main: asyncio.Task[None] | None = None
        self._crashed: asyncio.Future[BaseException] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._stop_requested = asyncio.Event()

    # --- hooks -------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Acquire resources and start taking work. Raising here counts as a crash."""

    async def run(self) -> None:
        """The actor's main loop. The default just waits until the actor is stopped."""
        await self._stop_requested.wait()

    async def stop_intake(self) -> None:
        """Phase 1 of stop: take no new work."""

    async def drain(self, grace: float) -> None:
        """Phase 2 of stop: let in-flight work finish, at most ``grace`` seconds."""

    async def close(self) -> None:
        """Phase 4 of stop: release what :meth:`setup` acquired. Must tolerate a partial setup."""

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Run :meth:`setup`, then start :meth:`run` in a task this actor owns."""
        loop = asyncio.get_running_loop()
        self._crashed = loop.create_future()
        await self.setup()
        self._main = asyncio.create_task(self._run_main(), name=f"actor:{self.name}")

    async def _run_main(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - a crash of any kind is reported to the supervisor
            self.fail(e)

    def fail(self, error: BaseException) -> None:
        """Report a crash from anywhere inside the actor (e.g. a consumer that lost its channel)."""
        if self._crashed is not None and not self._crashed.done():
            self._crashed.set_result(error)

    async def crashed(self) -> BaseException:
        """Wait until the actor crashes; return the error."""
        assert self._crashed is not None, "start() first"
        return await asyncio.shield(self._crashed)

    async def stop(self, grace: float = 10.0) -> None:
        """Stop in phases (see module docstring). Idempotent: concurrent and repeated calls share one stop."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(grace), name=f"actor-stop:{self.name}")
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        self._stop_requested.set()
        try:
            await self.stop_intake()
            await self.drain(grace)
        except Exception as e:  # noqa: BLE001 - stopping must reach close() whatever happened
            self.log.warning("actor.stop_phase_failed", error=repr(e))
        finally:
            if self._main is not None and not self._main.done():
                # run() should return once _stop_requested is set; give it the same grace, then cut it off.
                try:
                    await asyncio.wait_for(asyncio.shield(self._main), timeout=max(grace, 0.1))
                except (TimeoutError, asyncio.CancelledError):
                    pass
                if not self._main.done():
                    self._main.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await self._main
            await self.close()


Handler = Callable[[Delivery], Any]


class ConsumerActor(Actor):
    """An actor that consumes one queue: declare, bind, consume with prefetch, drain on stop.

    Subclasses set :attr:`queue` and :attr:`bindings` and implement :meth:`handle`. Ack policy is
    the bus's (see :mod:`infra.bus.base`): return → ack; ProtocolDecodeError → dead-letter;
    any other exception → requeue (until the delivery limit dead-letters it).
    """

    #: The queue to declare and consume.
    queue: QueueSpec
    #: (exchange, pattern) pairs binding the queue.
    bindings: tuple[tuple[str, str], ...] = ()

    def __init__(self, bus: Bus, *, prefetch: int = 64) -> None:
        super().__init__()
        self.bus = bus
        self.prefetch = prefetch
        self._consumer: Consumer | None = None
        self.queue_name = ""

    async def setup(self) -> None:
        self.queue_name = await self.bus.declare_queue(self.queue)
        for exchange, pattern in self.bindings:
            await self.bus.bind(self.queue_name, exchange, pattern)
        self._consumer = await self.bus.consume(self.queue_name, self.handle, prefetch=self.prefetch)
        self.log.info("actor.consuming", queue=self.queue_name, prefetch=self.prefetch)

    @abc.abstractmethod
    async def handle(self, delivery: Delivery) -> None:
        """Process one delivery. Return only once its effect is durable."""

    async def stop_intake(self) -> None:
        if self._consumer is not None:
            await self._consumer.cancel()

    async def drain(self, grace: float) -> None:
        if self._consumer is not None:
            finished = await self._consumer.drain(grace)
            if not finished:
                self.log.warning("actor.drain_cut_off", grace=grace,
                                 detail="unfinished deliveries were requeued, not lost")

    @property
    def in_flight(self) -> int:
        return self._consumer.in_flight if self._consumer is not None else 0


@dataclass(slots=True)
class Backoff:
    """Exponential restart delay: ``initial`` doubling up to ``maximum``; reset after a stable run."""

    initial: float = 0.5
    maximum: float = 30.0
    stable_after: float = 60.0


class _Unbuilt(Actor):
    """Stands for an actor whose factory failed at a restart: its start fails with that error."""

    name = "unbuilt"

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def setup(self) -> None:
        raise self.error


class Supervisor:
    """Starts actors, restarts any that crash (with backoff, logging why), stops them all in order.

    An actor whose building or start raises :class:`~protocol.errors.ConfigError` is not restarted:
    a restart meets the same configuration. It is left ``failed`` and :meth:`start` raises that
    error at once, so the process can say what is wrong and exit instead of retrying until its
    start deadline. An actor that crashes with a :class:`~protocol.errors.ProcessFatal` is not
    restarted either: it is left ``failed``, :attr:`fatal` holds the error and :meth:`wait_fatal`
    returns, so the process stops (and exits non-zero) instead of going on.

    Args:
        factories: actor name → zero-argument callable building a fresh actor instance.
        backoff: restart delays.
    """

    def __init__(self, factories: dict[str, Callable[[], Actor]], backoff: Backoff | None = None) -> None:
        self.factories = dict(factories)
        self.backoff = backoff or Backoff()
        self.health: dict[str, ActorHealth] = {name: ActorHealth(name) for name in self.factories}
        self.actors: dict[str, Actor] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # One stop signal per actor, so stop() can stop them one by one in reverse start order.
        self._stopping: dict[str, asyncio.Event] = {name: asyncio.Event() for name in self.factories}
        self._started: dict[str, asyncio.Event] = {name: asyncio.Event() for name in self.factories}
        self._grace = 10.0
        #: The first configuration error an actor met (see the class docstring); set with it.
        self.misconfigured: ConfigError | None = None
        self._misconfigured = asyncio.Event()
        #: The ProcessFatal an actor crashed with (see the class docstring); set with it.
        self.fatal: ProcessFatal | None = None
        self._fatal = asyncio.Event()

    async def wait_fatal(self) -> ProcessFatal | ConfigError:
        """Return once an actor crashed with a :class:`~protocol.errors.ProcessFatal`, or met a
        configuration error after :meth:`start` returned (in a restart): either way the process
        must stop rather than run on with that actor failed."""
        done = asyncio.ensure_future(self._fatal.wait())
        misconfigured = asyncio.ensure_future(self._misconfigured.wait())
        try:
            await asyncio.wait({done, misconfigured}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            misconfigured.cancel()
        error = self.fatal if self.fatal is not None else self.misconfigured
        assert error is not None
        return error

    async def start(self, wait: float | None = 30.0) -> None:
        """Start one supervision task per actor; wait up to ``wait`` s for each first successful start.

        Raises the ConfigError an actor met while building or starting, as soon as it meets it.
        """
        for name in self.factories:
            self._tasks[name] = asyncio.create_task(self._supervise(name), name=f"supervise:{name}")
        if wait:
            async def every_start() -> None:
                for event in self._started.values():
                    await event.wait()

            # Tasks, not a gather: a cancelled task (a node stopped while starting) leaves nothing
            # behind to report, where a cancelled gather logs its exception as never retrieved.
            started = asyncio.ensure_future(every_start())
            misconfigured = asyncio.ensure_future(self._misconfigured.wait())
            try:
                async with asyncio.timeout(wait):
                    await asyncio.wait({started, misconfigured}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                started.cancel()
                misconfigured.cancel()
            if self.misconfigured is not None:
                raise self.misconfigured

    @property
    def ready(self) -> bool:
        return all(h.ok for h in self.health.values())

    async def _supervise(self, name: str) -> None:
        health = self.health[name]
        stopping = self._stopping[name]
        delay = self.backoff.initial
        while not stopping.is_set():
            health.state = ActorState.STARTING
            started_at = time.monotonic()
            try:
                actor = self.factories[name]()
            except ConfigError as e:
                self._misconfigure(name, e)
                return
            except Exception as e:  # noqa: BLE001 - reported, never left to end this task unseen
                # (Ending this task silently would leave the process waiting for ever on an actor
                # that never starts.) At the first start, what the factory meets is the settings'
                # doing (a path that cannot be a directory): a configuration error. At a restart the
                # same settings worked before, so it is a passing failure (a file briefly
                # unreadable): a crash like any other, restarted after the back-off.
                if health.restarts == 0:
                    self._misconfigure(name, ConfigError(f"{name} could not be set up: {type(e).__name__}: {e}"))
                    return
                actor = _Unbuilt(e)
            self.actors[name] = actor
            try:
                await actor.start()
                health.state, health.since = ActorState.RUNNING, time.time()
                self._started[name].set()
                log.info("actor.started", actor=name, restarts=health.restarts)
                crashed = asyncio.ensure_future(actor.crashed())
                stop_wait = asyncio.ensure_future(stopping.wait())
                try:
                    await asyncio.wait({crashed, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for f in (crashed, stop_wait):
                        f.cancel()
                if stopping.is_set():
                    break
                error: BaseException = crashed.result()
            except asyncio.CancelledError:
                raise
            except ConfigError as e:
                with contextlib.suppress(Exception):
                    await actor.stop(grace=0)
                self._misconfigure(name, e)
                return
            except Exception as e:  # noqa: BLE001 - a failed start is a crash like any other
                error = e
            if isinstance(error, ProcessFatal):
                health.last_error = f"{type(error).__name__}: {error}"
                health.state, health.since = ActorState.FAILED, time.time()
                log.error("actor.fatal", actor=name, error=health.last_error,
                          detail="not restarted: the process stops")
                with contextlib.suppress(Exception):
                    await actor.stop(grace=0)
                if self.fatal is None:
                    self.fatal = error
                self._fatal.set()
                return
            health.restarts += 1
            health.last_error = f"{type(error).__name__}: {error}"
            health.state, health.since = ActorState.BACKOFF, time.time()
            if time.monotonic() - started_at > self.backoff.stable_after:
                delay = self.backoff.initial
            log.error("actor.crashed", actor=name, error=health.last_error, restart_in=round(delay, 2),
                      exc_info=error)
            with contextlib.suppress(Exception):
                await actor.stop(grace=0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await stopping.wait()
            delay = min(delay * 2, self.backoff.maximum)
        health.state = ActorState.STOPPING
        await self.actors[name].stop(self._grace)
        health.state = ActorState.STOPPED
        log.info("actor.stopped", actor=name)

    def _misconfigure(self, name: str, error: ConfigError) -> None:
        """Leave ``name`` failed for good (its configuration is wrong) and let :meth:`start` raise."""
        health = self.health[name]
        health.last_error = f"{type(error).__name__}: {error}"
        health.state, health.since = ActorState.FAILED, time.time()
        log.error("actor.misconfigured", actor=name, error=str(error),
                  detail="not restarted: a restart meets the same configuration")
        if self.misconfigured is None:
            self.misconfigured = error
        self._misconfigured.set()

    async def stop(self, grace: float = 10.0) -> None:
        """Stop every actor in phases, one at a time in reverse start order. Idempotent.

        Reverse order matters: the web front is registered last, so it stops first and its
        in-flight requests can still get their replies from the writer before the writer stops.
        """
        self._grace = grace
        for name in reversed(list(self._tasks)):
            self._stopping[name].set()
            try:
                await self._tasks[name]
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                log.error("actor.stop_failed", actor=name, error=repr(e))


#: Net container allocations between young-generation collections (CPython's default: 700).
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Collect what is already garbage, move every object alive now (modules, the SDK's and
    pydantic's schemas, the tools) out of the collector's reach (:func:`gc.freeze`), and collect the
    young generation after 10,000 net allocations instead of 700.

    Called once per process, when every actor has started (:func:`toastmachine.node.run_node`), so
    every process type gets it: the web and MCP fronts alike, the writer, the publisher.

    Why: a request allocates thousands of short-lived containers (rows, representations, and in the
    MCP front the SDK's dumps of the result), and with dozens in flight the default threshold ran a
    young collection every few requests; what was in flight survived it, reached the oldest
    generation, and that generation's collections (every half second or so) walked the start-up
    objects again (~135k in the MCP front, ~80k in the web front), 50-110 ms each with the event
    loop stopped: about a fifth of a front's CPU under bench/mcp.py's get_messages load, and its p99. Frozen objects are never collected (nothing here
    is meant to be freed before the process ends); reference counting still frees the rest at once,
    the threshold only bounds how much cyclic garbage may wait."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
