"""Event publisher: moves committed changes from the change history onto ``tm.events``.

Consumes: the ``changes`` table as a transactional outbox, after its durable cursor (the one row of
``publisher_cursor``). It is woken by ``NOTIFY tm_changes`` (a trigger on ``changes``, delivered at
commit) and polls every ``poll_interval`` seconds in case a notification is lost.

Does: reads up to ``batch_size`` changes after the cursor in sequence order and publishes them,
``window`` at a time concurrently, each as a :class:`~protocol.events.ChangeEvent` (the stored
envelope, decoded by the codec) with routing key ``<type>.<partition>``, ``message_id``
``<lineage>:<sequence>``, the corpus headers and the writer's trace id. :meth:`Bus.publish` returns
once the broker confirmed, so the cursor advances to the highest sequence below which every event
is confirmed, and never past one that is not. When the bus is down the publish times out; the
publisher backs off and starts again from the cursor.

Single-active: every instance opens a connection of its own and tries a session-level advisory
lock (:data:`PUBLISHER_LOCK`) on it. The holder is active; the others are standby and try again
every ``standby_interval`` seconds, so one of them takes over within about a second of the active
one's death (its connection closes, PostgreSQL releases the lock). The active one reads, listens
and moves the cursor on that same connection: if it drops, the publisher stops publishing at once
(another may already have taken over) and goes back to standby.

Emits: events on its corpus's exchange ``tm.events.<corpus_id>`` (:mod:`protocol.routing`), which it
declares and binds into ``tm.events`` with ``#`` before its first publish, so that ``tm.events`` still carries every event of
every corpus sharing the broker; at least once each. Every event carries its corpus headers; an
envelope in the history that names another corpus or lineage than the publisher's identity, or
that does not decode, stops the publisher at that change (it is never published under this
corpus's name), once every change before it is published and the cursor is past them. A publisher whose node failed the
corpus identity check publishes nothing. A publisher that dies between a confirm and the
cursor update, or loses its lock mid-window, leaves events that the next active one publishes
again; consumers deduplicate on the sequence (the notification hub does).

Beside each window's events it publishes the whole window once more, as one
:class:`~protocol.events.ChangeBatch` (split past 1 MiB) on the internal exchange
``tm.hub.<corpus_id>``, which only the notification hubs (and the archiver's wake-up queue) bind:
a node then consumes one message per window instead of one per change. Its publish is confirmed
with the window's (concurrently), and a failed one fails the window like a failed event: retried
from the cursor, so a hub is not left waiting for the next write to notice the hole. A batch lost
after its confirm (a bounded node queue, a reconnect) shows up at the next one, whose ``after``
field tells the hub exactly which hole to read from the history.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from infra.bus.base import Bus, HeaderValue, declare_corpus_events
from infra.db import CorpusIdentity, Database
from infra.db.lock_session import (
    HandOver,
    LockLost,
    LockSession,
    guarded,
    lock_holder,
    open_lock_session,
    pause,
    serve_while_locked,
)
from infra.db.pool import Target, connection
from infra.logs import TRACE_HEADER
from infra.metrics import Family, SingleActiveCollector, register_once
from infra.runtime import Actor
from protocol.errors import BusError, BusUnavailable, ProtocolDecodeError, ToastMachineError
from protocol.events import HEADER_SEQUENCE, ChangeEvent, event_headers, split_change_batches
from protocol.messages import decode_message
from protocol.routing import HUB_ROUTING_KEY

T = TypeVar("T")

#: Key of the session-level advisory lock held by the active publisher: the first 8 bytes of
#: sha256(b"toastmachine:publisher") as a signed big-endian integer (other keys: the migration lock
#: in :mod:`infra.db.migrations`, the sequence lock in :mod:`actors.writer.store`).
PUBLISHER_LOCK = 5270762781211293730
#: The channel the ``changes`` trigger notifies (migration 0003).
NOTIFY_CHANNEL = "tm_changes"

#: Changes read from the history per query (events are at most 100 KiB: at most ~20 MB in memory).
DEFAULT_BATCH_SIZE = 200
#: Publishes in flight at once; the cursor advances after each window.
DEFAULT_WINDOW = 100
#: Seconds between polls of the history when no notification arrives.
DEFAULT_POLL_INTERVAL = 1.0
#: Seconds between a standby's attempts to take the lock.
DEFAULT_STANDBY_INTERVAL = 1.0
#: Seconds a publish may wait for its confirm (across a reconnect) before it counts as failed.
DEFAULT_PUBLISH_TIMEOUT = 10.0
#: Back-off after a failed window: doubles from the first value up to the second.
RETRY_BACKOFF = (0.2, 5.0)
#: Seconds of failing publishes (the broker not confirming, the database answering) after which the
#: active publisher releases its lock for a standby that may reach the broker, and stands by for
#: HANDOVER_PAUSE seconds (then takes the lock again if nobody else did: a broker down for every
#: publisher costs it no more than that once it is back).
HANDOVER_AFTER = 10.0
HANDOVER_PAUSE = 5.0

_READ_CHANGES = ("select sequence, event, trace_id from changes where sequence > $1 "
                 "order by sequence limit $2")
# Never backwards: a cursor only records what was confirmed, whoever wrote it.
_ADVANCE_CURSOR = ("update publisher_cursor set sequence = $1, updated_at = now() "
                   "where sequence < $1")


class _Ready(NamedTuple):
    """A change read from the history and found publishable: its event, trace id and stored text."""

    event: ChangeEvent
    trace_id: str | None
    stored: str


class PublisherError(ToastMachineError):
    """A change in the history cannot be published (its stored envelope does not decode)."""


def application_name(node_id: str) -> str:
    """The ``application_name`` of a publisher's lock connection (shown in ``pg_stat_activity``)."""
    return f"toastmachine-publisher:{node_id}"[:63]  # PostgreSQL truncates at 63 bytes anyway


async def active_publisher(target: Target) -> str | None:
    """The ``application_name`` of the session holding the publisher lock, or None when none does."""
    return await lock_holder(target, PUBLISHER_LOCK)


async def read_cursor(target: Target) -> int:
    """The publisher's cursor: every change up to it has been published and confirmed."""
    async with connection(target) as conn:
        return int(await conn.fetchval("select sequence from publisher_cursor"))


class EventPublisher(Actor):
    """The event publisher actor (see the module docstring).

    Args:
        bus: where events are published (``tm.events.<corpus_id>``, bound into ``tm.events``).
        db: the database; its pool is only used for the lock session when ``dsn`` is None.
        identity: the database's corpus identity: names the exchange and is checked against every
            envelope. None when the identity check failed: nothing is published.
        node_id: this process's name; the lock connection's ``application_name`` carries it.
        dsn: PostgreSQL DSN for the dedicated lock connection (None: borrow one from ``db``'s pool).
        batch_size: changes read per query.
        window: publishes in flight at once.
        poll_interval: seconds between polls when no notification arrives.
        standby_interval: seconds between a standby's attempts to take the lock.
        publish_timeout: seconds a publish may wait for its confirm before the window is retried.
    """

    name = "publisher"

    def __init__(self, bus: Bus, db: Database, *, node_id: str, identity: CorpusIdentity | None,
                 dsn: str | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, window: int = DEFAULT_WINDOW,
                 poll_interval: float = DEFAULT_POLL_INTERVAL,
                 standby_interval: float = DEFAULT_STANDBY_INTERVAL,
                 publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT) -> None:
        super().__init__()
        self.bus = bus
        self.db = db
        self.node_id = node_id
        self.scope = identity.scope if identity is not None else None
        #: Whether the corpus's exchange was declared and bound into tm.events (again after a failure).
        self._exchange_ready = False
        self.dsn = dsn
        self.batch_size = max(1, batch_size)
        self.window = max(1, min(window, self.batch_size))
        self.poll_interval = poll_interval
        self.standby_interval = standby_interval
        self.publish_timeout = publish_timeout
        #: True while this instance holds the lock and publishes.
        self.active = False
        #: The durable cursor as this instance last read or wrote it (None before it was active).
        self.cursor: int | None = None
        #: Events this instance published and had confirmed (republished ones included).
        self.published = 0
        #: Times this instance became active.
        self.activations = 0
        #: Windows that were not fully confirmed (retried from the cursor after a back-off).
        self.failed_windows = 0
        #: Change batches published to the hubs' exchange, and those that failed (each failure fails
        #: its window, which is retried from the cursor).
        self.hub_batches = 0
        self.failed_hub_batches = 0
        self._wake = asyncio.Event()
        self._cursor_moved = asyncio.Event()

    # --- observing ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``{"active", "cursor", "published"}`` for health pages and logs."""
        return {"active": self.active, "cursor": self.cursor, "published": self.published}

    async def wait_cursor(self, sequence: int) -> None:
        """Wait until this instance has moved the durable cursor to ``sequence`` or past it.

        Wrap it in a timeout: it waits for ever on a standby or while the bus is down.
        """
        while self.cursor is None or self.cursor < sequence:
            moved = self._cursor_moved
            await moved.wait()

    def _set_cursor(self, sequence: int) -> None:
        self.cursor = sequence
        moved, self._cursor_moved = self._cursor_moved, asyncio.Event()
        moved.set()

    # --- main loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        if self.scope is None:
            # The node refuses writes and sync (SPEC §4); publishing its history under an identity
            # it cannot vouch for would be the one kind of sync it still did.
            self.log.error("publisher.identity_unavailable", detail="the corpus identity check failed; "
                           "publishing nothing until the operator fixes it")
            await self._stop_requested.wait()
            return
        await serve_while_locked(
            "publisher", self.log, self._stop_requested, self._open_session, self._publish_while_active,
            self._inactive, self.standby_interval, lost_detail="stopped publishing; back to standby",
            lost_context=lambda: {"cursor": self.cursor})

    def _inactive(self) -> None:
        self.active = False

    async def _open_session(self) -> LockSession:
        return await open_lock_session(self.db, self.dsn, PUBLISHER_LOCK, application_name(self.node_id))

    async def _publish_while_active(self, session: LockSession) -> None:
        conn = session.conn
        # LISTEN before the first read, so a change committed in between wakes us.
        await self._guard(session, session.listen(NOTIFY_CHANNEL, self._on_notify))
        cursor = int(await self._guard(session, conn.fetchval("select sequence from publisher_cursor")))
        self.active = True
        self.activations += 1
        self._set_cursor(cursor)
        # Declared now, not at the first change: an integrator can bind its queue to
        # tm.events.<corpus_id> on a fresh node (a failure here is retried with the first window).
        if self.scope is not None and not self._exchange_ready:
            await self._declare()
        self.log.info("publisher.active", cursor=cursor, exchange_declared=self._exchange_ready)
        backoff = RETRY_BACKOFF[0]
        failing_since: float | None = None
        while not self._stop_requested.is_set():
            self._wake.clear()
            rows = await self._guard(session, conn.fetch(_READ_CHANGES, cursor, self.batch_size))
            if not rows:
                await self._pause(self.poll_interval, session.lost, self._wake)
                if session.lost.is_set():
                    raise LockLost("the publisher's database session closed")
                continue
            ready = self._publishable_prefix(rows)
            for start in range(0, len(ready), self.window):
                window = ready[start:start + self.window]
                confirmed, error = await self._guard(session, self._publish_window(cursor, window))
                if confirmed is not None:
                    await self._guard(session, conn.execute(_ADVANCE_CURSOR, confirmed))
                    cursor = confirmed
                    self._set_cursor(cursor)
                if error is not None:
                    now = time.monotonic()
                    failing_since = now if failing_since is None else failing_since
                    if isinstance(error, BusError) and now - failing_since >= HANDOVER_AFTER:
                        raise HandOver(f"the broker has confirmed nothing for {now - failing_since:.0f}s: "
                                       f"{error}", HANDOVER_PAUSE)
                    self.failed_windows += 1
                    self._exchange_ready = False  # e.g. a broker reset: declare it again, it is cheap
                    self.log.warning("publisher.publish_failed", error=str(error), cursor=cursor,
                                     retry_in=round(backoff, 2), detail="retrying from the cursor")
                    await self._pause(backoff, session.lost)
                    backoff = min(backoff * 2, RETRY_BACKOFF[1])
                    break
                backoff, failing_since = RETRY_BACKOFF[0], None
                if self._stop_requested.is_set():
                    break

    def _publishable_prefix(self, rows: list[Any]) -> list[_Ready]:
        """``rows`` decoded, up to the first change that cannot be published: that one raises
        PublisherError only when it comes first, so every change before it is published (and the
        cursor moved past them) before the publisher stops at it."""
        ready: list[_Ready] = []
        for row in rows:
            try:
                event = self._decode(row)
            except PublisherError:
                if not ready:
                    raise
                break
            ready.append(_Ready(event, row["trace_id"], row["event"]))
        return ready

    async def _publish_window(self, after: int, window: list[_Ready]) -> tuple[int | None, BaseException | None]:
        """Publish ``window`` (the changes after ``after``) concurrently, and their hub batch beside
        them; return the highest sequence of the confirmed prefix and the first failure (None when
        all were confirmed)."""
        assert self.scope is not None
        if not self._exchange_ready:
            # Also here: the publisher starts (and stands by) while the broker is down, and a failed
            # declaration is retried from the cursor like a failed publish.
            failed = await self._declare()
            if failed is not None:
                return None, failed
        # The stored text, not the decoded event: the hubs hand subscribers the history's own bytes.
        changes = [[item.event.sequence, item.event.type, item.event.partition, item.stored] for item in window]
        *results, hub_result = await asyncio.gather(*(self._send(item.event, item.trace_id) for item in window),
                                                    self._send_hub_batches(after, changes), return_exceptions=True)
        if isinstance(hub_result, BusError):
            # The window is retried whole (its events too: at least once allows it): a lost batch is
            # only noticed by a hub at the next batch, and on a quiet corpus there may be none soon.
            return None, hub_result
        if isinstance(hub_result, BaseException):
            raise hub_result
        confirmed: int | None = None
        for item, result in zip(window, results, strict=True):
            if isinstance(result, BusError):
                return confirmed, result
            if isinstance(result, BaseException):
                raise result
            confirmed = item.event.sequence
        return confirmed, None

    async def _declare(self) -> BusError | None:
        """Declare this corpus's events exchange (bound into ``tm.events``) and the hubs' exchange;
        the failure, or None once both exist."""
        assert self.scope is not None
        try:
            async with asyncio.timeout(self.publish_timeout):
                await declare_corpus_events(self.bus, self.scope.events_exchange)
                await self.bus.declare_exchange(self.scope.hub_exchange)
        except TimeoutError:
            return BusUnavailable(f"declaring {self.scope.events_exchange!r} took over {self.publish_timeout}s")
        except BusError as e:
            return e
        self._exchange_ready = True
        return None

    async def _send(self, event: ChangeEvent, trace_id: str | None) -> None:
        assert self.scope is not None
        headers: dict[str, HeaderValue] = dict(event_headers(event))
        if trace_id:
            headers[TRACE_HEADER] = trace_id
        # in_order: a window lost with the connection is published again from the cursor, in
        # sequence order, rather than event by event as each gets through, so no event first
        # reaches a queue after a later one (consumers keep the highest sequence they applied).
        await self.bus.publish(self.scope.events_exchange, event.routing_key, event, headers=headers,
                               message_id=event.message_id, timeout=self.publish_timeout, in_order=True)
        self.published += 1

    async def _send_hub_batches(self, after: int, changes: list[list[Any]]) -> None:
        """Publish the window to the hubs' exchange as one :class:`ChangeBatch` (more only past
        1 MiB, in order). A failure fails the window, which is then retried from the cursor."""
        assert self.scope is not None
        for batch in split_change_batches(self.scope.corpus_id, self.scope.lineage, after, changes):
            headers: dict[str, HeaderValue] = {**self.scope.headers(), HEADER_SEQUENCE: batch.changes[-1][0]}
            try:
                await self.bus.publish(self.scope.hub_exchange, HUB_ROUTING_KEY, batch, headers=headers,
                                       timeout=self.publish_timeout)
            except BusError:
                self.failed_hub_batches += 1
                raise
            self.hub_batches += 1

    def _decode(self, row: Any) -> ChangeEvent:
        event = self._decode_row(row)
        assert self.scope is not None
        refusal = self.scope.refusal(event_headers(event))  # the headers it would carry, from the envelope
        if refusal is not None:
            # A history holding another corpus's envelopes (a botched restore or copy): publishing
            # them here would hand every consumer of this corpus changes that are not its own.
            raise PublisherError(f"change {event.sequence} cannot be published: {refusal}")
        return event

    @staticmethod
    def _decode_row(row: Any) -> ChangeEvent:
        sequence = row["sequence"]
        try:
            event = decode_message(ChangeEvent.TYPE, row["event"].encode())
        except ProtocolDecodeError as e:
            # Skipping it would make every integration miss a change without a trace: stop here,
            # loudly (the supervisor restarts us with a backoff), until an operator looks.
            raise PublisherError(f"change {sequence} cannot be published: {e}") from e
        if not isinstance(event, ChangeEvent) or event.sequence != sequence:
            raise PublisherError(f"change {sequence} holds an envelope for another sequence")
        return event

    def _on_notify(self, *_: Any) -> None:
        self._wake.set()

    # --- waiting -----------------------------------------------------------------------------

    async def _guard(self, session: LockSession, work: Awaitable[T]) -> T:
        return await guarded(session, work)

    async def _pause(self, seconds: float, *events: asyncio.Event) -> None:
        """Sleep ``seconds``, or less if the actor is stopped or one of ``events`` is set."""
        await pause(seconds, self._stop_requested, *events)


class PublisherCollector(SingleActiveCollector[EventPublisher]):
    """Prometheus gauges of the publisher running in this process (read at scrape time)."""

    kind = EventPublisher

    @staticmethod
    def families() -> tuple[Family, ...]:
        return (GaugeMetricFamily("toastmachine_publisher_active",
                                  "1 while this process's event publisher holds the lock and publishes."),
                GaugeMetricFamily("toastmachine_publisher_cursor",
                                  "Highest sequence published and confirmed (as this process last saw it)."),
                CounterMetricFamily("toastmachine_publisher_events",
                                    "Events this process published and had confirmed (republished included)."))

    def fill(self, actor: EventPublisher, families: tuple[Family, ...]) -> None:
        active, cursor, published = families
        active.add_metric([], 1.0 if actor.active else 0.0)
        if actor.cursor is not None:
            cursor.add_metric([], float(actor.cursor))
        published.add_metric([], float(actor.published))


def export_metrics(registry: CollectorRegistry, current: Callable[[], Actor | None]) -> None:
    """Add the publisher gauges to ``registry`` once (later calls are no-ops)."""
    register_once(registry, PublisherCollector(current))
