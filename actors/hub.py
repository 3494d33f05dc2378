"""Notification hub: one per process that runs a front (shared by the web and MCP fronts of
``toastmachine up``), fanning the corpus's changes out to the fronts' subscribers (the web front's
SSE streams; the MCP front's resource notifier).

Consumes: a per-node queue (``QueueKind.NODE``: exclusive to this process, bounded, deleted with it)
bound to the corpus's internal hub exchange ``tm.hub.<corpus_id>`` (:mod:`protocol.routing`), on
which the publisher puts one :class:`~protocol.events.ChangeBatch` per window of changes it
publishes on ``tm.events``. It consumes without acks (the bus's no-ack form): a message is gone
once delivered, and any that is lost (the queue is bounded, a reconnect, a batch the publisher
failed to send, a delivery dropped while every handler slot was busy) is read back from the change
history, which is the truth. Events of other corpora sharing the broker never reach it. A batch that
still does (a misbinding, a hand-published one) is dead-lettered with the reason: its
``x-corpus-id`` / ``x-corpus-lineage`` headers and its body's ``corpus_id`` / ``lineage`` must all be
this node's (the publisher checked every envelope of it against the same identity).
Does: keeps the changes in strict sequence order without duplicates: a change at or below the last
one it passed on is dropped (a publisher that took over republishes from its cursor), and when a
batch's ``after`` lies above the last sequence passed on, the hole between them is read from the
change history first. Legitimate gaps in the sequences cost nothing: ``after`` says that no change
lies between it and the batch's first. With no subscriber at all it only notes the last sequence:
it builds no frames and reads no holes, because a subscriber reads the history after it subscribes
(see :mod:`actors.web.stream`), so whatever reached the hub before is there.
Emits: each change to every subscriber's bounded queue, with its SSE frame encoded once per change
for every subscriber (only when a subscriber wants frames: the MCP notifier does not). A
subscriber whose queue is full is cut off (``overflowed``), never allowed to grow memory; its stream
tells the client to resume.

Fan-out without waking a task per stream, and without holding the loop: the changes of one loop turn
go out as one :class:`Batch` (their frames joined once), to at most :data:`FANOUT_SLICE` subscribers
per loop turn, so the node's other work (the write requests it takes, their replies off the bus)
runs between slices instead of waiting for a pass over thousands of streams. A live stream that is
idle (its task parked with nothing in hand, its socket's buffer small) takes the batch through its
``sink``: written straight to its socket in the hub's pass. Otherwise the batch is queued and the
stream's task writes it (and waits for the socket to drain), which is where every bound applies.

Heartbeats: one ticker per hub, not a timer per stream. Every ``heartbeat`` seconds it queues a
heartbeat comment for each subscriber, and it is also the watchdog: a subscriber whose stream has
been blocked in the same socket write for a whole interval (the client stopped reading) is cut off
and its connection aborted. So sending a change to a stream arms no timer at all, which is what
lets one node feed thousands of streams.

The ticker also closes the one gap batches alone leave: a lost batch is noticed through the next
one's ``after``, but a lost *last* batch has no next one while the corpus is quiet. So when a whole
heartbeat interval passed with subscribers and without a batch, the ticker reads the publisher's
cursor (every change up to it was published, so none below it can still commit) and, when it lies
above the last change passed on, reads that hole from the history like any other. The hub starts at
that cursor too, so a first batch that is lost is noticed by the one after it like any other.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

from actors.history import Change, changes_after
from actors.publisher import read_cursor
from infra.bus.base import Bus, Consumer, Delivery, QueueKind, QueueSpec
from infra.db.pool import UNAVAILABLE_ERRORS, Target
from infra.logs import get_logger
from protocol.errors import ProtocolDecodeError
from protocol.events import ChangeBatch
from protocol.routing import HUB_ROUTING_KEY, CorpusScope

log = get_logger("toastmachine.actors.hub")

#: Changes a subscriber may have waiting before it is cut off.
DEFAULT_SUBSCRIBER_QUEUE = 1_000
#: Seconds between heartbeat comments (SPEC §4: every 15 s).
DEFAULT_HEARTBEAT = 15.0
#: Batches handled at once (the no-ack consumer's handler slots): all but one return without
#: awaiting, so this only bounds what arrives while a hole is read; a delivery past it is dropped
#: and read back from the history like any lost batch.
HANDLER_SLOTS = 64
#: Batches (each at most 1 MiB of envelopes) that may wait behind a hole being read; past it the
#: newest are dropped and only their last sequence is kept, to be read from the history too.
MAX_WAITING = 64

#: What a subscription's queue holds: a change (or None for a heartbeat) with its SSE bytes (empty
#: for a subscription that asked for no frames).
Item = tuple[Change | None, bytes]
#: The heartbeat comment, queued like a change so the stream's one waiting point wakes for it.
HEARTBEAT: Item = (None, b": heartbeat\n\n")
#: Subscribers one loop turn of a fan-out pass serves; the pass goes on at the next turn. Small
#: enough that a turn costs a few milliseconds, large enough that a pass costs few turns.
FANOUT_SLICE = 128


class Batch:
    """The changes handed over together (in sequence order, never empty), with their SSE frames
    joined once for all the streams that send them all (an unfiltered stream that is up to date,
    the common case); or the ticker's heartbeat (:data:`HEARTBEAT_BATCH`)."""

    __slots__ = ("_joined", "first", "items", "last")

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        first, last = items[0][0], items[-1][0]
        #: The sequences of the first and the last change; 0 for a heartbeat, which has none (0 is
        #: below every change's sequence, so no stream takes a heartbeat for new changes).
        self.first = first.sequence if first is not None else 0
        self.last = last.sequence if last is not None else 0
        self._joined: bytes | None = None

    def joined(self) -> bytes:
        """Every frame of the batch, in order, as one bytes object (built on first use)."""
        if self._joined is None:
            self._joined = b"".join(frame for _, frame in self.items)
        return self._joined


#: The heartbeat, as the ticker hands it to a live stream's sink.
HEARTBEAT_BATCH = Batch([HEARTBEAT])

#: A live stream's way to take a batch at once: True when it wrote the batch (or had nothing of it to
#: send), False when it cannot now (the batch is then queued for its task).
Sink = Callable[[Batch], bool]


class Subscription:
    """One stream's view of the hub: a bounded backlog of changes in sequence order.

    Each change comes with its SSE frame, encoded once by the hub for every subscriber. The hub
    hands changes over in batches (:meth:`offer_many`) and the stream takes everything waiting at
    once (:meth:`take`): when a node falls behind, batches grow, so the per-stream cost per change
    (a wake-up and a socket write) shrinks exactly when it matters.
    """

    def __init__(self, maxsize: int, owner: object = None) -> None:
        self.maxsize = maxsize
        #: Who subscribed (a front, when the hub is shared): :meth:`NotificationHub.end` ends its own.
        self.owner = owner
        self._items: collections.deque[Item] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        #: Set when the subscriber fell behind by more than its bound.
        self.overflowed = False
        self.closed = False
        #: Set by the stream while it waits in a socket write, and how many writes it started:
        #: the hub's ticker tells a stuck write (the same one at two ticks) from a busy stream.
        self.busy = False
        self.writes = 0
        self._stuck_write: int | None = None
        #: Called when the ticker finds the stream stuck in a write (the stream aborts its connection).
        self.on_stuck: Callable[[], None] | None = None
        #: Set by a live stream: takes a batch in the hub's pass while the stream's task is parked.
        self.sink: Sink | None = None

    @property
    def pending(self) -> int:
        """Items waiting to be taken."""
        return len(self._items)

    def offer_many(self, batch: list[Item] | Batch) -> None:
        """Hand changes over: straight to the stream's sink when its task is parked with nothing in
        hand (so order is kept), else queued; a subscriber that would hold more than ``maxsize`` is
        cut off instead."""
        if self.closed:
            return
        if isinstance(batch, Batch):
            sink = self.sink
            if sink is not None and self._idle() and sink(batch):
                return
            items = batch.items
        else:
            items = batch
        if len(self._items) + len(items) > self.maxsize:
            self.cut_off()
            return
        self._items.extend(items)
        self._wake()

    def cut_off(self) -> None:
        """End the subscription because its reader fell behind (or a hole could not be read)."""
        self.overflowed = True
        self.close()

    def close(self) -> None:
        """End the subscription: what is queued is still delivered, then :meth:`take` answers None."""
        if not self.closed:
            self.closed = True
            self._wake()

    def tick(self) -> None:
        """The hub's ticker: queue a heartbeat, or cut off a stream stuck in one write since the last tick.

        A closed subscription gets no heartbeat but is still watched: its stream may be blocked in a
        write (the rest of its queue, a catch-up page) by a client that stopped reading, and nothing
        else would ever end that write.
        """
        if self.busy:
            if self._stuck_write == self.writes:
                if not self.closed:
                    self.cut_off()
                if self.on_stuck is not None:
                    self.on_stuck()
                return
            self._stuck_write = self.writes
            return
        self._stuck_write = None
        if self.closed:
            return
        if self._idle() and self.sink is not None and self.sink(HEARTBEAT_BATCH):
            return  # written at once, like a batch of changes
        if len(self._items) < self.maxsize:
            self._items.append(HEARTBEAT)
            self._wake()

    def _idle(self) -> bool:
        """Whether the stream's task is parked in :meth:`take` with nothing queued or in hand: only
        then may the sink write, so what it writes comes after everything handed over before."""
        waiter = self._waiter
        return not self._items and waiter is not None and not waiter.done()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, limit: int) -> list[Item] | None:
        """Up to ``limit`` waiting items (waiting for one if there are none), or None once the
        subscription is closed and everything queued was taken."""
        while not self._items:
            if self.closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = self._items
        if len(items) <= limit:
            out = list(items)
            items.clear()
            return out
        return [items.popleft() for _ in range(limit)]


def sse_frame(change: Change) -> bytes:
    """The SSE frame of a change: ``id`` = sequence, ``event`` = type, ``data`` = the envelope."""
    return f"id: {change.sequence}\nevent: {change.type}\ndata: {change.event}\n\n".encode()


class NotificationHub:
    """The per-node fan-out of this node's corpus's changes.

    One per process, shared by its fronts (the web front's streams and the MCP front's notifier
    under ``toastmachine up``): each front calls :meth:`start` and :meth:`close` once: the
    first start consumes and the last close stops, and a front that is stopping ends only its
    own subscriptions (:meth:`end`). So a node takes each batch once and encodes each frame once,
    however many fronts follow the corpus.

    Args:
        bus: where the change batches come from.
        db: the change history, for filling holes.
        scope: the corpus (and lineage) whose changes this hub takes; None when the node's corpus
            identity check failed (it then consumes nothing: the stream is refused anyway).
        node_id: names this node's queue.
        subscriber_queue: changes a subscriber may have waiting before it is cut off.
        heartbeat: seconds between heartbeat comments (and the stuck-write watchdog's period).
    """

    def __init__(self, bus: Bus, db: Target, *, scope: CorpusScope | None, node_id: str,
                 subscriber_queue: int = DEFAULT_SUBSCRIBER_QUEUE, heartbeat: float = DEFAULT_HEARTBEAT) -> None:
        self.bus = bus
        self.db = db
        self.scope = scope
        self.heartbeat = heartbeat
        self._ticker: asyncio.Task[None] | None = None
        #: The ticker's check for a lost last batch, while one runs (see _tick).
        self._tail_check: asyncio.Task[None] | None = None
        self.queue_spec = QueueSpec(name=f"tm.hub.{node_id}.{uuid.uuid4().hex[:8]}", kind=QueueKind.NODE)
        #: The queue's name as declared (None before :meth:`start`).
        self.queue_name: str | None = None
        self.subscriber_queue = subscriber_queue
        self.last_sequence: int | None = None
        self._subscribers: set[Subscription] = set()
        #: Subscribers that read frames: with none, no change is encoded.
        self._framed = 0
        self._consumer: Consumer | None = None
        # While a hole is being read from the history, later batches wait here (see _on_batch).
        self._filling = False
        self._waiting: list[tuple[int, list[Change]]] = []
        #: The highest sequence of a batch dropped from a full ``_waiting`` (read from the history).
        self._dropped_upto: int | None = None
        # Changes passed on since the last hand-over to the subscribers (see _publish), and the
        # fan-out pass under way: its batch and the subscribers it has still to serve.
        self._batch: list[Change] = []
        self._flush_scheduled = False
        self._pass: Batch | None = None
        self._pass_left: list[Subscription] = []
        self._pass_at = 0
        #: Change batches taken, and holes read from the history (for tests and diagnostics).
        self.batches = 0
        self.holes_read = 0
        #: Fronts that started the hub and have not closed it yet.
        self._users = 0
        #: Fronts whose subscriptions were ended (see :meth:`end`): one per stopping front, at most two.
        self._ended: list[object] = []
        #: ``batches`` at the ticker's last round: unchanged over a round means no batch came.
        self._batches_seen = 0

    async def start(self) -> None:
        """Declare and bind this node's queue and start consuming (the first start only)."""
        self._users += 1
        if self._users > 1:
            return
        if self.scope is None:
            log.error("hub.identity_unavailable", detail="the corpus identity check failed; consuming nothing")
            return
        try:
            # Where the hub starts: a first batch after a lost one then shows its hole like any.
            self.last_sequence = await read_cursor(self.db)
        except UNAVAILABLE_ERRORS as e:
            # Not fatal: the first batch starts the hub instead, as it did before there was a cursor.
            log.warning("hub.cursor_unreadable", error=repr(e))
        name = self.queue_name = await self.bus.declare_queue(self.queue_spec)
        await self.bus.declare_exchange(self.scope.hub_exchange)
        await self.bus.bind(name, self.scope.hub_exchange, "#")
        self._consumer = await self.bus.consume(name, self._on_batch, prefetch=HANDLER_SLOTS, no_ack=True)
        self._ticker = asyncio.create_task(self._tick(), name="hub-heartbeat")
        log.info("hub.consuming", queue=name, exchange=self.scope.hub_exchange, routing_key=HUB_ROUTING_KEY)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            # In slices, like a fan-out pass: the node's writes run between them.
            subscribers = list(self._subscribers)
            for start in range(0, len(subscribers), FANOUT_SLICE):
                if start:
                    await asyncio.sleep(0)
                for sub in subscribers[start:start + FANOUT_SLICE]:
                    try:
                        sub.tick()
                    except Exception:  # as in _fan_out: one stream must not end the ticker for all
                        log.exception("hub.tick_failed")
                        sub.cut_off()
            quiet = self.batches == self._batches_seen
            self._batches_seen = self.batches
            checking = self._tail_check is not None and not self._tail_check.done()
            if quiet and self._subscribers and not self._filling and not checking:
                # A task of its own, not awaited here: the ticker is also every stream's heartbeat
                # and stuck-write watchdog, and a database that stops answering (a partition: no
                # error, no answer) must not stop those with it.
                self._tail_check = asyncio.create_task(self._check_tail_logged(), name="hub-tail-check")

    async def _check_tail_logged(self) -> None:
        try:
            await self._check_tail()
        except Exception:
            log.exception("hub.tail_check_failed")

    async def _check_tail(self) -> None:
        """Read what the publisher published but no batch brought (see the module docstring)."""
        try:
            cursor = await read_cursor(self.db)
        except UNAVAILABLE_ERRORS as e:
            log.warning("hub.cursor_unreadable", error=repr(e))
            return
        # Re-checked after the await: a batch may have come, or started reading a hole, meanwhile.
        last = self.last_sequence
        # With no start (the cursor was unreadable at start and no batch came), where the
        # subscribers stand is unknown: the first batch starts the hub.
        if self._filling or not self._subscribers or last is None or cursor <= last:
            return
        log.info("hub.tail_missed", after=last, through=cursor)
        await self._after_hole(cursor, [])

    def end(self, owner: object) -> None:
        """End ``owner``'s subscriptions now (a front that stops), leaving other fronts' alone; one it
        opens afterwards (a stream still starting) is ended as it is made."""
        if not self._has_ended(owner):
            self._ended.append(owner)
        for sub in [s for s in self._subscribers if s.owner is owner]:
            sub.close()

    def _has_ended(self, owner: object) -> bool:
        # By identity: an aiohttp Application is a mapping, and mappings compare by content.
        return any(ended is owner for ended in self._ended)

    async def close(self) -> None:
        """One front is done with the hub; the last one's close stops consuming and ends every
        subscription (idempotent past that)."""
        if self._users > 1:
            self._users -= 1
            return
        self._users = 0
        for task in (self._ticker, self._tail_check):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._ticker = self._tail_check = None
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.drain(1.0)
            self._consumer = None
        for sub in list(self._subscribers):
            sub.close()
        self._subscribers.clear()

    @contextlib.asynccontextmanager
    async def subscribe(self, *, frames: bool = True, owner: object = None) -> AsyncIterator[Subscription]:
        """A subscription for the duration of the block; ``frames=False`` for a subscriber that
        never reads the SSE frames (its items carry empty bytes); ``owner``: the front it is for
        (see :meth:`end`)."""
        sub = Subscription(self.subscriber_queue, owner)
        if owner is not None and self._has_ended(owner):
            sub.close()
        self._subscribers.add(sub)
        self._framed += frames
        try:
            yield sub
        finally:
            self._subscribers.discard(sub)
            self._framed -= frames
            # A pass under way may still hold it: once the block is left, its sink must never write
            # (the response may be finished), and nothing more is queued for it.
            sub.sink = None
            sub.closed = True

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    async def _on_batch(self, delivery: Delivery) -> None:
        """Pass a batch's changes on in sequence order.

        The common case (no hole, or only duplicates) is handled without awaiting anything, so no
        lock is needed and a burst of deliveries is handled in one turn of the event loop: a lock
        would hand itself from waiter to waiter one loop turn each, and on a node busy with
        thousands of streams a loop turn is long. Only a hole awaits (reading it from the history);
        batches arriving meanwhile wait in order behind it.
        """
        batch = delivery.message
        if not isinstance(batch, ChangeBatch):
            return  # not ours to fan out (the queue is ours alone; no-ack: it is gone)
        assert self.scope is not None  # a hub without a scope consumes nothing
        refusal = self.scope.refusal(delivery.headers, corpus_id=batch.corpus_id, lineage=batch.lineage)
        if refusal is not None:
            # Passing it on would show this node's streams another corpus's changes under this
            # corpus's sequence numbers (and the hole filling would hide them as duplicates later).
            log.warning("hub.foreign_batch", after=batch.after, reason=refusal)
            await delivery.dead_letter(refusal)
            return
        changes = _changes_of(batch)  # ProtocolDecodeError: dead-lettered with the reason
        self.batches += 1
        if self._filling:
            self._wait(batch.after, changes)
            return
        if not self._take(batch.after, changes):
            await self._after_hole(batch.after, changes)

    def _wait(self, after: int, changes: list[Change]) -> None:
        if len(self._waiting) < MAX_WAITING:
            self._waiting.append((after, changes))
            return
        # Bounded: keep only where it ended; the history holds the rest (read after this hole).
        upto = changes[-1].sequence if changes else after
        self._dropped_upto = upto if self._dropped_upto is None else max(self._dropped_upto, upto)

    def _take(self, after: int, changes: list[Change]) -> bool:
        """Pass on what needs no reading; False (nothing done) when a hole must be read first."""
        last = self.last_sequence
        if not changes or (last is not None and changes[-1].sequence <= last):
            return True  # duplicates (republished after a publisher take-over)
        if not self._subscribers:
            # Nobody to tell: a subscriber that comes later reads all of this from the history.
            self.last_sequence = changes[-1].sequence
            return True
        if last is not None and after > last:
            return False
        for change in changes:
            if last is None or change.sequence > last:
                self._publish(change)
        return True

    async def _after_hole(self, after: int, changes: list[Change]) -> None:
        """Fill the hole below ``changes``, pass them on, then every batch that arrived meanwhile."""
        self._filling = True
        try:
            pending = [(after, changes)]
            while pending:
                after, changes = pending.pop(0)
                last = self.last_sequence
                if last is not None and after > last and self._subscribers:
                    await self._fill(last, after)
                # Past the hole, or past a hole that could not be read (its subscribers were cut
                # off, and resume from the history): the batch itself goes on now.
                last = self.last_sequence
                self._take(after if last is None else min(after, last), changes)
                if not pending and self._waiting:
                    pending, self._waiting = sorted(self._waiting, key=lambda b: b[0]), []
                if not pending and self._dropped_upto is not None:
                    # Batches were dropped while waiting: everything up to the last of them is in
                    # the history; read it as a hole below an empty batch.
                    pending, self._dropped_upto = [(self._dropped_upto, [])], None
        finally:
            self._filling = False

    async def _fill(self, last: int, through: int) -> None:
        """Pass on the changes after ``last`` up to and including ``through`` from the history."""
        self.holes_read += 1
        after = last
        while after < through:
            try:
                page = await changes_after(self.db, after, limit=min(1000, through - after))
            except UNAVAILABLE_ERRORS as e:
                # Without the database the hole cannot be checked: cut the subscribers off so that
                # each resumes from its last sequence (and catches up) instead of missing changes.
                log.warning("hub.hole_unreadable", after=after, through=through, error=repr(e))
                for sub in list(self._subscribers):
                    sub.cut_off()
                return
            page = [c for c in page if c.sequence <= through]
            for change in page:
                self._publish(change)
            if len(page) < min(1000, through - after):
                break  # the history holds nothing more up to ``through``
            after = page[-1].sequence
        # Every change up to ``through`` was passed on (sequences may have gaps up to it).
        if self.last_sequence is None or self.last_sequence < through:
            self.last_sequence = through

    def _publish(self, change: Change) -> None:
        """Pass a change on. Changes are handed to the subscribers in one batch per turn of the
        event loop: every batch that arrived in the same read from the broker goes out together,
        so a node that is behind does one socket write per stream for many changes."""
        self.last_sequence = change.sequence
        self._batch.append(change)
        if not self._flush_scheduled and self._pass is None:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Start a fan-out pass with every change waiting, over the subscribers of this moment.

        One pass at a time, each over its own batch, so every subscriber gets the batches in order.
        Changes published while a pass is under way wait for the next pass, which then carries them
        all: a node that falls behind sends bigger batches, not more of them. A subscriber that
        joins during a pass is not in it; it subscribed before reading the history, which holds
        every change the hub passed on (each was committed before it was published)."""
        self._flush_scheduled = False
        if not self._batch:
            return
        changes, self._batch = self._batch, []
        if not self._subscribers:
            return
        # Encoded here, once for every subscriber, and only when one of them reads frames.
        items: list[Item] = ([(c, sse_frame(c)) for c in changes] if self._framed
                             else [(c, b"") for c in changes])
        self._pass = Batch(items)
        self._pass_left, self._pass_at = list(self._subscribers), 0
        self._fan_out()

    def _fan_out(self) -> None:
        """Serve the next :data:`FANOUT_SLICE` subscribers of the pass; the rest at the next loop
        turn, after the I/O that became ready meanwhile (a write request is never queued behind a
        whole pass)."""
        batch, left, start = self._pass, self._pass_left, self._pass_at
        assert batch is not None
        end = self._pass_at = start + FANOUT_SLICE
        for sub in left[start:end]:
            try:
                sub.offer_many(batch)
            except Exception:
                # One stream's failure (its sink, its socket) must not leave the pass unfinished,
                # which would stop every other stream of the node for good.
                log.exception("hub.offer_failed")
                sub.cut_off()
        loop = asyncio.get_running_loop()
        if end < len(left):
            loop.call_soon(self._fan_out)
            return
        self._pass, self._pass_left = None, []
        if self._batch:
            self._flush_scheduled = True
            loop.call_soon(self._flush)


def _changes_of(batch: ChangeBatch) -> list[Change]:
    """The batch's changes, checked: ``[sequence, type, partition, envelope]`` each, ascending above
    ``after`` (the codec only checks the fields' names, not what the list holds)."""
    out: list[Change] = []
    previous = batch.after
    if not isinstance(previous, int) or isinstance(previous, bool):
        raise ProtocolDecodeError("a change batch's after is not an integer")
    for entry in batch.changes:
        if not (isinstance(entry, list) and len(entry) == 4):
            raise ProtocolDecodeError("a change batch entry is not [sequence, type, partition, envelope]")
        sequence, type_, partition, event = entry
        if not (isinstance(sequence, int) and not isinstance(sequence, bool) and isinstance(type_, str)
                and isinstance(partition, int) and not isinstance(partition, bool) and isinstance(event, str)):
            raise ProtocolDecodeError("a change batch entry is not [sequence, type, partition, envelope]")
        if sequence <= previous:
            raise ProtocolDecodeError(f"a change batch's sequences do not ascend above after ({sequence} <= {previous})")
        out.append(Change(sequence, type_, partition, event))
        previous = sequence
    return out
