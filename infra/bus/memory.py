"""The in-process bus: the contract of :mod:`infra.bus.base` inside one event loop.

It stands in for RabbitMQ when ``toastmachine up`` runs without an AMQP URL, and it is the first
backend of the behaviour suite, so it copies RabbitMQ's observable behaviour rather than
simplifying it:

* Publishing runs the real codec: the message is encoded to bytes, stored as bytes, and decoded
  again for each delivery, so a body the codec rejects is dead-lettered exactly as on RabbitMQ.
* Topic exchanges match ``*`` (one word) and ``#`` (zero or more words); the default exchange
  ``""`` routes to the queue named by the routing key. An exchange bound into another routes what
  matches on to it with the same key; each queue gets one copy however many paths reach it, and
  a cycle of exchange bindings ends where it started (RabbitMQ's exchange-to-exchange bindings).
* WORK queues keep a per-message failure count (RabbitMQ's ``x-delivery-count``): a message given
  back by a nack or by a consumer that went away is redelivered with ``redelivered=True`` until it
  has been delivered ``delivery_limit`` times, then dead-lettered with reason ``delivery_limit``.
* NODE queues drop their oldest ready message past ``max_length`` and disappear on :meth:`close`
  or when their last consumer is cancelled (exclusive and auto-delete, as on RabbitMQ).
* Consumers of a queue take turns (round robin), each with at most ``prefetch`` unsettled messages.
  A no-ack consumer takes every ready message at once, as RabbitMQ pushes to one, and drops a
  delivery that finds ``prefetch`` of its handlers still running.

Every queue is bounded: a publish into a full WORK queue waits for room up to its timeout and then
raises BusUnavailable (RabbitMQ's ``x-overflow: reject-publish``); dead letters never wait, so a
full dead-letter queue drops its oldest entry with a warning instead.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import uuid
from collections import deque
from dataclasses import dataclass, field

from infra.bus.base import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_LETTER_QUEUE,
    DEAD_REASON_HEADER,
    EVENTS_EXCHANGE,
    Bus,
    Consumer,
    Delivery,
    Handler,
    Headers,
    HeaderValue,
    QueueKind,
    QueueSpec,
)
from infra.bus.batch import DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_BATCH_COUNT, RequestBatcher
from infra.bus.policy import (
    DEAD_EXCHANGE_HEADER,
    DEAD_QUEUE_HEADER,
    DEAD_ROUTING_KEY_HEADER,
    DEFAULT_MAX_PENDING_REQUESTS,
    REASON_DELIVERY_LIMIT,
    REASON_REJECTED,
    BatchMember,
    PendingRequests,
    RawMessage,
    dead_letter_headers,
    handle_delivery,
    outgoing_headers,
)
from infra.logs import get_logger
from protocol.errors import BusError, BusUnavailable, Unroutable
from protocol.messages import BusMessage, encode_message

log = get_logger("toastmachine.bus.memory")

#: Default bound of every WORK queue (and of ``tm.dead.letters``) in messages.
DEFAULT_MAX_QUEUE_LENGTH = 100_000
_REPLY_PREFIX = "tm.memory.reply-to."


@functools.lru_cache(maxsize=4096)
def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching: ``*`` is exactly one word, ``#`` zero or more words."""
    return _match(tuple(pattern.split(".")), tuple(routing_key.split(".")))


def _match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        # '#' swallows zero words, or one word and stays in place for the next.
        return _match(rest, words) or (bool(words) and _match(pattern, words[1:]))
    if not words:
        return False
    return (head == "*" or head == words[0]) and _match(rest, words[1:])


@dataclass(slots=True)
class _Message:
    """One stored message; each queue holds its own copy (its own redelivery state)."""

    exchange: str
    routing_key: str
    type_name: str | None
    body: bytes
    headers: dict[str, HeaderValue]
    message_id: str | None
    correlation_id: str | None
    reply_to: str | None
    redelivered: bool = False
    #: Deliveries that ended without an ack (RabbitMQ's x-delivery-count).
    failures: int = 0

    def copy(self) -> _Message:
        return _Message(self.exchange, self.routing_key, self.type_name, self.body, dict(self.headers),
                        self.message_id, self.correlation_id, self.reply_to)


@dataclass(slots=True)
class _Queue:
    spec: QueueSpec
    ready: deque[_Message] = field(default_factory=deque)
    consumers: list[_MemoryConsumer] = field(default_factory=list)
    next_consumer: int = 0

    @property
    def name(self) -> str:
        return self.spec.name


class _MemoryDelivery(Delivery):
    def __init__(self, consumer: _MemoryConsumer, stored: _Message) -> None:
        super().__init__()
        self._consumer = consumer
        self._stored = stored
        self.exchange = stored.exchange
        self.routing_key = stored.routing_key
        self.headers = dict(stored.headers)
        self.message_id = stored.message_id
        self.correlation_id = stored.correlation_id
        self.reply_to = stored.reply_to
        self.redelivered = stored.redelivered
        self.delivery_count = stored.failures + 1

    def _settle(self) -> bool:
        if self.settled:
            return False
        self.settled = True
        if not self._consumer.no_ack:
            self._consumer._settled(self)
        return True

    async def ack(self) -> None:
        if self._settle() and not self._consumer.no_ack:
            self._consumer.bus.stats.acked += 1

    async def nack(self, requeue: bool = True) -> None:
        if not self._settle():
            return
        bus, queue = self._consumer.bus, self._consumer.queue
        if self._consumer.no_ack:
            return  # gone when it was delivered: nothing to give back (the no-ack form)
        bus.stats.nacked += 1
        if requeue:
            bus._return(queue, self._stored)
        elif queue.spec.kind is QueueKind.WORK:
            bus._dead_letter(queue, self._stored, REASON_REJECTED)
        else:
            log.debug("bus.dropped", queue=queue.name, reason="rejected on a NODE queue")

    async def dead_letter(self, reason: str) -> None:
        if not self._settle():
            return
        bus, queue = self._consumer.bus, self._consumer.queue
        bus._route_dead(self._stored, dead_letter_headers(self, queue.name, reason), queue.name)
        bus.stats.dead_lettered += 1

    async def dead_letter_member(self, type_name: str | None, body: bytes, headers: Headers) -> None:
        bus, queue = self._consumer.bus, self._consumer.queue
        member = _Message(self.exchange, self.routing_key, type_name, body, dict(headers), None, None, None)
        bus._route_dead(member, dict(headers), queue.name)
        bus.stats.dead_lettered += 1


class _MemoryConsumer(Consumer):
    def __init__(self, bus: MemoryBus, queue: _Queue, handler: Handler, prefetch: int, no_ack: bool = False) -> None:
        self.bus = bus
        self.queue = queue
        self.handler = handler
        self.prefetch = prefetch
        self.no_ack = no_ack
        self.active = True
        self.unsettled: set[_MemoryDelivery] = set()
        self._tasks: dict[asyncio.Task[None], _MemoryDelivery] = {}
        # Bounds handler concurrency even when a handler settles early and keeps running.
        self._slots = asyncio.Semaphore(prefetch)
        #: Handlers started and not finished (what bounds a no-ack consumer).
        self._running = 0

    @property
    def has_capacity(self) -> bool:
        # A no-ack consumer settles nothing: the broker pushes to it whatever is ready.
        return self.active and (self.no_ack or len(self.unsettled) < self.prefetch)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def deliver(self, stored: _Message) -> None:
        self.bus.stats.delivered += 1
        if self.no_ack and self._running >= self.prefetch:
            # Every handler slot is busy and the message is already gone from the queue: dropped,
            # which the no-ack form allows (its consumer covers loss itself).
            self.bus.stats.extra["no_ack_dropped"] = self.bus.stats.extra.get("no_ack_dropped", 0) + 1
            log.debug("bus.no_ack_dropped", queue=self.queue.name)
            return
        delivery = _MemoryDelivery(self, stored)
        if not self.no_ack:
            self.unsettled.add(delivery)
        self._running += 1
        # A fresh context, as on RabbitMQ: nothing of the publisher's task (its trace id in
        # particular) may leak into the handler except through headers.
        task = asyncio.get_running_loop().create_task(
            self._run(delivery, stored), name=f"bus-handler:{self.queue.name}", context=contextvars.Context())
        self._tasks[task] = delivery
        task.add_done_callback(self._tasks.pop)

    async def _run(self, delivery: _MemoryDelivery, stored: _Message) -> None:
        try:
            if not self.active:
                # Handed over just before cancel(): not ours to start any more (as on RabbitMQ; a
                # no-ack delivery is simply gone).
                await delivery.nack(requeue=True)
                return
            async with self._slots:
                await handle_delivery(delivery, stored.type_name, stored.body, self.handler,
                                      queue=self.queue.name, log=log, reply=self.bus.reply)
        finally:
            # Here rather than in a done callback: the slot is free the moment the handler is.
            self._running -= 1

    def _settled(self, delivery: _MemoryDelivery) -> None:
        self.unsettled.discard(delivery)
        self.bus._dispatch(self.queue)

    async def cancel(self) -> None:
        if not self.active:
            return
        self.active = False
        if self in self.queue.consumers:
            self.queue.consumers.remove(self)
        self.bus._consumers.discard(self)
        if (self.queue.spec.kind is QueueKind.NODE and not self.queue.consumers
                and self.bus._queues.get(self.queue.name) is self.queue):
            # NODE queues are auto-delete on RabbitMQ: they go when their last consumer goes.
            self.bus._delete_queue(self.queue.name)

    async def drain(self, timeout: float) -> bool:
        await self.cancel()
        finished = True
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=max(timeout, 0))
            if pending:
                finished = False
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        # What was taken but never settled goes back to the queue, as when a channel closes.
        for delivery in list(self.unsettled):
            await delivery.nack(requeue=True)
        return finished


class MemoryBus(Bus):
    """The in-process bus (backend "memory").

    Args:
        max_queue_length: bound of every WORK queue and of ``tm.dead.letters``, in messages.
        max_pending_requests: most :meth:`request` calls waiting for a reply at once.
        max_batch_count / max_batch_bytes: bounds of one request batch (:mod:`infra.bus.batch`).
    """

    backend = "memory"

    def __init__(self, *, max_queue_length: int = DEFAULT_MAX_QUEUE_LENGTH,
                 max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
                 max_batch_count: int = DEFAULT_MAX_BATCH_COUNT, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> None:
        super().__init__()
        self.max_queue_length = max_queue_length
        self._open = False
        self._exchanges: dict[str, set[tuple[str, str]]] = {}  # exchange -> {(pattern, queue)}
        self._exchange_bindings: dict[str, set[tuple[str, str]]] = {}  # source -> {(pattern, destination)}
        self._queues: dict[str, _Queue] = {}
        self._consumers: set[_MemoryConsumer] = set()
        self._pending = PendingRequests(max_pending_requests)
        self._batcher = RequestBatcher(self._send_request, self._pending, self.stats, max_count=max_batch_count,
                                       max_bytes=max_batch_bytes)
        self._reply_address = ""
        # Set whenever a ready message leaves a queue: publishers blocked on a full queue re-check.
        self._room = asyncio.Event()
        # Set whenever a message is enqueued: fetch_raw() waits on it.
        self._arrived = asyncio.Event()

    # --- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> None:
        if self._open:
            return
        self._open = True
        self._reply_address = _REPLY_PREFIX + uuid.uuid4().hex
        for name in (COMMANDS_EXCHANGE, EVENTS_EXCHANGE, DEAD_EXCHANGE):
            await self.declare_exchange(name)
        await self.declare_queue(QueueSpec(DEAD_LETTER_QUEUE, QueueKind.WORK))
        await self.bind(DEAD_LETTER_QUEUE, DEAD_EXCHANGE, "#")
        self.stats.connected = True

    async def close(self) -> None:
        if not self._open:
            return
        for consumer in list(self._consumers):
            await consumer.drain(0)
        self._pending.fail_all(BusUnavailable("the bus was closed while waiting for a reply"))
        # NODE queues are exclusive to the connection: they go with it.
        for name in [q.name for q in self._queues.values() if q.spec.kind is QueueKind.NODE]:
            self._delete_queue(name)
        self._open = False
        self.stats.connected = False

    async def check(self) -> None:
        self._ensure_open()

    def _ensure_open(self) -> None:
        if not self._open:
            raise BusUnavailable("the in-process bus is not connected")

    # --- topology ----------------------------------------------------------------------------

    async def declare_exchange(self, name: str) -> None:
        self._ensure_open()
        if not name:
            raise BusError("the default exchange cannot be declared")
        self._exchanges.setdefault(name, set())

    async def declare_queue(self, spec: QueueSpec) -> str:
        self._ensure_open()
        if spec.kind is QueueKind.WORK:
            if not spec.name:
                raise BusError("WORK queues must be named")
            if spec.delivery_limit < 1:
                raise BusError(f"delivery_limit must be at least 1, not {spec.delivery_limit}")
        elif spec.max_length < 1:
            raise BusError(f"max_length must be at least 1, not {spec.max_length}")
        name = spec.name or f"tm.node.{uuid.uuid4().hex}"
        if name.startswith("amq."):
            raise BusError(f"queue names starting with 'amq.' are reserved: {name!r}")
        spec = QueueSpec(name, spec.kind, spec.delivery_limit, spec.max_length)
        existing = self._queues.get(name)
        if existing is not None:
            if _arguments(existing.spec) != _arguments(spec):
                raise BusError(f"queue {name!r} already exists with different arguments "
                               f"({_arguments(existing.spec)} != {_arguments(spec)})")
            return name
        self._queues[name] = _Queue(spec)
        return name

    async def bind(self, queue: str, exchange: str, pattern: str) -> None:
        self._ensure_open()
        if not exchange:
            raise BusError("queues cannot be bound to the default exchange")
        if exchange not in self._exchanges:
            raise BusError(f"no exchange named {exchange!r}")
        if queue not in self._queues:
            raise BusError(f"no queue named {queue!r}")
        self._exchanges[exchange].add((pattern, queue))

    async def unbind(self, queue: str, exchange: str, pattern: str) -> bool:
        self._ensure_open()
        if queue not in self._queues or exchange not in self._exchanges:
            return False
        self._exchanges[exchange].discard((pattern, queue))
        return True

    async def bind_exchange(self, destination: str, source: str, pattern: str) -> None:
        self._ensure_open()
        for name in (destination, source):
            if not name:
                raise BusError("the default exchange cannot be bound to or from")
            if name not in self._exchanges:
                raise BusError(f"no exchange named {name!r}")
        self._exchange_bindings.setdefault(source, set()).add((pattern, destination))

    async def delete_queue(self, name: str) -> None:
        """Delete a queue and its bindings; its consumers stop (for tests and operations)."""
        self._ensure_open()
        for consumer in list(self._consumers):
            if consumer.queue.name == name:
                await consumer.drain(0)
        self._delete_queue(name)

    def _delete_queue(self, name: str) -> None:
        self._queues.pop(name, None)
        for bindings in self._exchanges.values():
            for binding in [b for b in bindings if b[1] == name]:
                bindings.discard(binding)

    async def delete_exchange(self, name: str) -> None:
        """Delete an exchange and its bindings (for tests and operations)."""
        self._ensure_open()
        self._exchanges.pop(name, None)
        self._exchange_bindings.pop(name, None)
        for bindings in self._exchange_bindings.values():
            for binding in [b for b in bindings if b[1] == name]:
                bindings.discard(binding)

    # --- publishing --------------------------------------------------------------------------

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        message: BusMessage,
        *,
        headers: Headers | None = None,
        message_id: str | None = None,
        correlation_id: str | None = None,
        mandatory: bool = False,
        timeout: float = 10.0,
        in_order: bool = False,
    ) -> None:
        # (In one process nothing is lost between publish and delivery: ``in_order`` changes nothing.)
        type_name, body = encode_message(message)
        await self._publish(exchange, routing_key, type_name, body, outgoing_headers(headers),
                            message_id=message_id, correlation_id=correlation_id, reply_to=None,
                            mandatory=mandatory, timeout=timeout)

    async def publish_raw(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        type_name: str | None,
        *,
        headers: Headers | None = None,
        mandatory: bool = False,
        timeout: float = 10.0,
    ) -> None:
        """Publish bytes as they are, bypassing the encoder: for tests and diagnostics only.

        This is how a test puts an undecodable body on the bus to watch it being dead-lettered.
        """
        await self._publish(exchange, routing_key, type_name, bytes(body), outgoing_headers(headers),
                            message_id=None, correlation_id=None, reply_to=None,
                            mandatory=mandatory, timeout=timeout)

    async def _publish(
        self, exchange: str, routing_key: str, type_name: str | None, body: bytes,
        headers: dict[str, HeaderValue], *, message_id: str | None, correlation_id: str | None,
        reply_to: str | None, mandatory: bool, timeout: float,
    ) -> None:
        self._ensure_open()
        if exchange == "" and routing_key.startswith(_REPLY_PREFIX):
            self._deliver_reply(routing_key, type_name, body, headers, message_id, correlation_id)
            self.stats.published += 1
            await asyncio.sleep(0)
            return
        stored = _Message(exchange, routing_key, type_name, body, headers, message_id, correlation_id, reply_to)
        targets = self._route(exchange, routing_key)
        if not targets and mandatory:
            raise Unroutable(f"no queue is bound to {exchange or '(default exchange)'!r} "
                             f"for routing key {routing_key!r}")
        await self._wait_for_room(targets, timeout)
        for queue in targets:
            self._enqueue(queue, stored.copy())
        self.stats.published += 1
        # A RabbitMQ publish waits for its confirm; yielding here gives consumers the same chance to
        # run between publishes, so a tight publishing loop cannot starve them.
        await asyncio.sleep(0)

    def _route(self, exchange: str, routing_key: str) -> list[_Queue]:
        if exchange == "":
            queue = self._queues.get(routing_key)
            return [queue] if queue is not None else []
        if exchange not in self._exchanges:
            raise BusError(f"no exchange named {exchange!r}")
        names: set[str] = set()
        # Breadth-first over exchange-to-exchange bindings; ``seen`` ends cycles and diamonds.
        seen, frontier = {exchange}, [exchange]
        while frontier:
            current = frontier.pop()
            names.update(q for pattern, q in self._exchanges.get(current, ()) if topic_matches(pattern, routing_key))
            for pattern, destination in self._exchange_bindings.get(current, ()):
                if destination not in seen and topic_matches(pattern, routing_key):
                    seen.add(destination)
                    frontier.append(destination)
        return [self._queues[n] for n in sorted(names) if n in self._queues]

    async def _wait_for_room(self, targets: list[_Queue], timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            full = [q.name for q in targets
                    if q.spec.kind is QueueKind.WORK and len(q.ready) >= self.max_queue_length]
            if not full:
                return
            self._room.clear()
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                async with asyncio.timeout(remaining):
                    await self._room.wait()
            except TimeoutError:
                raise BusUnavailable(f"queue(s) {', '.join(full)} full ({self.max_queue_length} messages) "
                                     f"for {timeout}s: publish refused") from None
            self._ensure_open()

    def _enqueue(self, queue: _Queue, stored: _Message, *, front: bool = False) -> None:
        if front:
            # Given-back messages go first, as RabbitMQ redelivers them before newer ones.
            queue.ready.appendleft(stored)
        else:
            queue.ready.append(stored)
        self._arrived.set()
        limit = self.max_queue_length if queue.spec.kind is QueueKind.WORK else queue.spec.max_length
        while len(queue.ready) > limit:
            dropped = queue.ready.popleft()
            if queue.spec.kind is QueueKind.WORK:
                # Only dead letters get here (publishers wait for room): never drop them silently.
                log.warning("bus.dead_letter_dropped", queue=queue.name, message_type=dropped.type_name,
                            reason=dropped.headers.get(DEAD_REASON_HEADER))
                self.stats.extra["dead_letters_dropped"] = self.stats.extra.get("dead_letters_dropped", 0) + 1
        self._dispatch(queue)

    def _dispatch(self, queue: _Queue) -> None:
        """Hand ready messages to consumers with spare prefetch, taking turns."""
        if queue.ready and queue.consumers:
            consumers = queue.consumers
            while queue.ready:
                for i in range(len(consumers)):
                    candidate = consumers[(queue.next_consumer + i) % len(consumers)]
                    if candidate.has_capacity:
                        queue.next_consumer = (queue.next_consumer + i + 1) % len(consumers)
                        candidate.deliver(queue.ready.popleft())
                        self._room.set()
                        break
                else:
                    return

    def _return(self, queue: _Queue, stored: _Message) -> None:
        """A delivery ended without an ack: count it, then requeue or dead-letter it."""
        stored.failures += 1
        stored.redelivered = True
        if queue.name not in self._queues:
            return  # the queue was deleted meanwhile; RabbitMQ drops its messages too
        if queue.spec.kind is QueueKind.WORK and stored.failures >= queue.spec.delivery_limit:
            self._dead_letter(queue, stored, REASON_DELIVERY_LIMIT)
            return
        self._enqueue(queue, stored, front=True)

    def _dead_letter(self, queue: _Queue, stored: _Message, reason: str) -> None:
        """Dead-letter on the bus's own initiative (as RabbitMQ's dead-letter exchange does)."""
        headers = dict(stored.headers)
        headers.update({DEAD_REASON_HEADER: reason, DEAD_EXCHANGE_HEADER: stored.exchange,
                        DEAD_ROUTING_KEY_HEADER: stored.routing_key, DEAD_QUEUE_HEADER: queue.name})
        self._route_dead(stored, headers, queue.name)
        self.stats.dead_lettered += 1

    def _route_dead(self, stored: _Message, headers: dict[str, HeaderValue], queue_name: str) -> None:
        dead = _Message(DEAD_EXCHANGE, queue_name, stored.type_name, stored.body, headers,
                        stored.message_id, stored.correlation_id, stored.reply_to)
        for target in self._route(DEAD_EXCHANGE, queue_name):
            self._enqueue(target, dead.copy())

    # --- consuming ---------------------------------------------------------------------------

    async def consume(self, queue: str, handler: Handler, *, prefetch: int = 10, no_ack: bool = False) -> Consumer:
        self._ensure_open()
        if prefetch < 1:
            raise BusError(f"prefetch must be at least 1, not {prefetch}")
        q = self._queues.get(queue)
        if q is None:
            raise BusError(f"no queue named {queue!r}")
        consumer = _MemoryConsumer(self, q, handler, prefetch, no_ack)
        q.consumers.append(consumer)
        self._consumers.add(consumer)
        self._dispatch(q)
        return consumer

    async def fetch_raw(self, queue: str, *, timeout: float) -> RawMessage | None:
        """Take one message from ``queue`` undecoded (acked), or None after ``timeout`` seconds.

        For diagnostics and tests: it is the only way to look at a dead letter whose body the
        codec cannot decode.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self._ensure_open()
            q = self._queues.get(queue)
            if q is None:
                raise BusError(f"no queue named {queue!r}")
            if q.ready:
                stored = q.ready.popleft()
                self._room.set()
                return RawMessage(stored.exchange, stored.routing_key, stored.type_name, stored.body,
                                  dict(stored.headers), stored.redelivered)
            self._arrived.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._arrived.wait()
            except TimeoutError:
                return None

    # --- request / reply ---------------------------------------------------------------------

    def _ready_for_request(self) -> None:
        self._ensure_open()

    async def _send_request(self, exchange: str, routing_key: str, type_name: str, body: bytes,
                            headers: dict[str, HeaderValue], correlation_id: str, timeout: float) -> None:
        await self._publish(exchange, routing_key, type_name, body, headers, message_id=None,
                            correlation_id=correlation_id, reply_to=self._reply_address,
                            mandatory=True, timeout=timeout)

    async def reply(self, request: Delivery, message: BusMessage, *, headers: Headers | None = None) -> None:
        if isinstance(request, BatchMember):
            request.answer_with(message, headers)
            return
        if not request.reply_to:
            return
        type_name, body = encode_message(message)
        await self._publish("", request.reply_to, type_name, body, outgoing_headers(headers), message_id=None,
                            correlation_id=request.correlation_id, reply_to=None, mandatory=False, timeout=10.0)

    def _deliver_reply(self, address: str, type_name: str | None, body: bytes, headers: dict[str, HeaderValue],
                       message_id: str | None, correlation_id: str | None) -> None:
        if address != self._reply_address:
            return  # the requester's connection is gone: RabbitMQ drops such replies too
        self.stats.delivered += self._batcher.resolve_reply(
            type_name, body, headers, exchange="", routing_key=address, message_id=message_id,
            correlation_id=correlation_id)


def _arguments(spec: QueueSpec) -> tuple[object, ...]:
    """The declaration arguments that must agree when a queue is declared again."""
    if spec.kind is QueueKind.WORK:
        return (spec.kind, spec.delivery_limit)
    return (spec.kind, spec.max_length)
