"""The bus contract: what every actor may rely on, whichever backend runs underneath.

Semantics (the behaviour suite in ``tests/test_bus_behaviour.py`` checks each, on both backends):

* Exchanges are topic exchanges. Routing keys are dot-separated words; binding patterns use ``*``
  (exactly one word) and ``#`` (zero or more words).
* An exchange may be bound into another (:meth:`Bus.bind_exchange`): a message published on the
  source whose key matches the pattern is routed by the destination too, with the same routing key,
  as if published there. A queue reached over several paths gets one copy; cycles are harmless.
* :meth:`Bus.publish` returns only once the broker has confirmed the message (publisher confirms).
  While the connection is down it waits for the reconnect and publishes again, up to ``timeout``;
  then it raises :class:`BusUnavailable`. A message confirmed once may be delivered more than once
  (at-least-once); consumers dedupe.
* Queues come in two kinds (:class:`QueueKind`): ``WORK`` queues are durable quorum queues shared
  by competing consumers, with a delivery limit after which a message is dead-lettered to
  ``tm.dead``; ``NODE`` queues belong to one process (exclusive, deleted with it), bounded in length;
  ``WAKE`` queues are durable and shared like WORK ones but bounded like NODE ones, dropping their
  oldest message when full: for wake-up hints whose truth lives elsewhere (the archiver's queue on
  ``tm.events``), so a consumer that is away never makes publishers wait or the queue grow.
* :meth:`Bus.consume` delivers at most ``prefetch`` unsettled messages at a time to a handler.
  Ack policy: a handler that returns normally acks (unless it settled the delivery itself); one
  that raises :class:`ProtocolDecodeError` dead-letters the delivery with the reason; one that
  raises anything else nacks with requeue, so the message is redelivered with ``redelivered=True``
  and a higher ``delivery_count`` until the delivery limit dead-letters it.
* No-ack form (``consume(..., no_ack=True)``), for feeds whose loss the consumer covers itself (the
  notification hubs read any hole from the change history): a message is gone from the queue once
  it is delivered, and nothing is ever redelivered. ``prefetch`` then bounds the handlers running
  at once instead of the unsettled messages: a delivery that finds ``prefetch`` handlers busy is
  dropped (counted in ``stats.extra["no_ack_dropped"]``). A handler's error is logged, never
  redelivered; ack and nack are no-ops; a body the codec cannot decode, or a handler raising
  :class:`ProtocolDecodeError` or calling :meth:`Delivery.dead_letter`, still puts a copy on
  ``tm.dead`` with the reason.
* A body that the codec cannot decode never reaches the handler: it is dead-lettered with the reason,
  and when it is a request its requester gets an ``ErrorReply`` (400 ``undecodable_command``) at once.
* A message taken but not settled by a consumer that is cancelled, crashes or loses its connection
  is redelivered (``redelivered=True``) to another or the same consumer.
* Dead letters land on the topic exchange ``tm.dead`` with routing key = the queue name and header
  ``x-tm-dead-reason``; the durable queue ``tm.dead.letters`` keeps them all, so nothing is dropped.
* :meth:`Bus.request` publishes with a correlation id and a reply address (RabbitMQ direct
  reply-to) and waits for :meth:`Bus.reply` up to its deadline, else raises :class:`RequestTimeout`.
  The deadline travels in header ``x-deadline`` (Unix epoch milliseconds) so workers can skip work
  whose requester gave up.
* Batch form: requests made with the same ``batch_key`` (and exchange and headers) in one turn of
  the event loop travel as ONE :class:`~protocol.messages.RequestBatch` with routing key
  ``batch_key`` (at most ``max_batch_count`` members and ``max_batch_bytes`` bytes; a lone request
  goes as itself) and are answered by ONE :class:`~protocol.messages.BatchReply`. The batch's
  ``x-deadline`` is its latest member's. The consuming bus splits it before the handler: each member
  is a delivery of its own (its own headers, deadline, reply and settling); a member it cannot
  decode is answered 400 ``undecodable_command`` and dead-lettered alone with the reason; the batch
  reply goes once every member is decided. Each requester still waits for its own answer only, up
  to its own deadline (:mod:`infra.bus.batch`).
* Every publish carries the current trace id (``x-trace-id``); consumers bind it while handling.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from infra.logs import TRACE_HEADER, valid_trace_id
from protocol.messages import BusMessage, encode_message

if TYPE_CHECKING:  # infra.bus.batch imports this module, so the batcher is named for the type checker only
    from infra.bus.batch import RequestBatcher

COMMANDS_EXCHANGE = "tm.commands"
EVENTS_EXCHANGE = "tm.events"
DEAD_EXCHANGE = "tm.dead"
DEAD_LETTER_QUEUE = "tm.dead.letters"

DEAD_REASON_HEADER = "x-tm-dead-reason"
DEADLINE_HEADER = "x-deadline"
DELIVERY_COUNT_HEADER = "x-delivery-count"

#: Default delivery limit of WORK queues: a message that failed this many times is poison.
DEFAULT_DELIVERY_LIMIT = 5
#: NODE queues are bounded: a node that cannot keep up loses the oldest events, and its SSE
#: clients resume from their last sequence through the database.
DEFAULT_NODE_QUEUE_MAX_LENGTH = 10_000

HeaderValue = str | int | float | bool | None
Headers = Mapping[str, HeaderValue]


class QueueKind(enum.Enum):
    """How a queue lives. See the module docstring."""

    WORK = "work"
    NODE = "node"
    WAKE = "wake"


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """A queue to declare.

    Args:
        name: queue name; WORK queues must be named, NODE queues may pass "" to get a
            broker-generated unique name (returned by :meth:`Bus.declare_queue`).
        kind: WORK (durable quorum, dead-lettered) or NODE (exclusive to this process).
        delivery_limit: WORK only: deliveries after which the message is dead-lettered.
        max_length: NODE and WAKE: oldest messages are dropped past this length.
    """

    name: str
    kind: QueueKind = QueueKind.WORK
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT
    max_length: int = DEFAULT_NODE_QUEUE_MAX_LENGTH


class Delivery(abc.ABC):
    """One message handed to a consumer, already decoded by the codec.

    Settle it at most once with :meth:`ack`, :meth:`nack` or :meth:`dead_letter`; settling twice is a
    no-op. Handlers usually leave settling to the consumer's ack policy.
    """

    message: BusMessage
    exchange: str
    routing_key: str
    headers: dict[str, HeaderValue]
    message_id: str | None
    correlation_id: str | None
    reply_to: str | None
    redelivered: bool
    #: 1 on first delivery; counts redeliveries (RabbitMQ's x-delivery-count + 1 on quorum queues).
    delivery_count: int

    def __init__(self) -> None:
        self.settled = False

    @property
    def trace_id(self) -> str | None:
        """The message's ``x-trace-id`` when it is a well-formed trace id (None otherwise: the
        consumer binds a fresh one, see :func:`infra.bus.policy.handle_delivery`)."""
        return valid_trace_id(self.headers.get(TRACE_HEADER))

    @property
    def deadline(self) -> float | None:
        """The requester's deadline as a Unix timestamp in seconds, if the message carries one."""
        value = self.headers.get(DEADLINE_HEADER)
        if value is None:
            return None
        try:
            return float(value) / 1000.0
        except (TypeError, ValueError):
            return None

    def expired(self, now: float | None = None) -> bool:
        """True when the requester's deadline has passed (its answer would go unread)."""
        deadline = self.deadline
        return deadline is not None and (now if now is not None else time.time()) > deadline

    @abc.abstractmethod
    async def ack(self) -> None:
        """The effect is durable: forget the message."""

    @abc.abstractmethod
    async def nack(self, requeue: bool = True) -> None:
        """Give the message back (requeue=True) or dead-letter it without our reason (False)."""

    @abc.abstractmethod
    async def dead_letter(self, reason: str) -> None:
        """Poison: publish it to ``tm.dead`` with ``reason`` (confirmed), then settle it."""

    @abc.abstractmethod
    async def dead_letter_member(self, type_name: str | None, body: bytes, headers: Headers) -> None:
        """Publish one member of this batch delivery alone to ``tm.dead`` (confirmed), with ``headers``
        (which carry the reason); the batch itself stays unsettled."""


Handler = Callable[[Delivery], Awaitable[None]]


class Consumer(abc.ABC):
    """A running subscription. Stop it in two phases: :meth:`cancel`, then :meth:`drain`."""

    @abc.abstractmethod
    async def cancel(self) -> None:
        """Stop taking new deliveries. Idempotent."""

    @abc.abstractmethod
    async def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for in-flight handlers; cancel and requeue what is left.

        Returns True when everything finished on its own. Implies :meth:`cancel`.
        """

    @property
    @abc.abstractmethod
    def in_flight(self) -> int:
        """Handlers running right now."""


@dataclass(slots=True)
class BusStats:
    """Counters for /metrics and /readyz."""

    connected: bool = False
    reconnects: int = 0
    published: int = 0
    delivered: int = 0
    acked: int = 0
    nacked: int = 0
    dead_lettered: int = 0
    #: Batch messages of the batch form published, and the requests they carried.
    request_batches: int = 0
    batched_requests: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Bus(abc.ABC):
    """The contract both backends implement."""

    #: "memory" or "rabbitmq"
    backend: str = ""

    def __init__(self) -> None:
        self.stats = BusStats()

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def connect(self) -> None:
        """Connect; the first connect fails fast with :class:`BusUnavailable` and a clear message.

        Also declares the fixed topology: ``tm.commands``, ``tm.events``, ``tm.dead`` and the
        ``tm.dead.letters`` queue bound to ``#`` on ``tm.dead``.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Cancel consumers, fail pending requests, close connections. Idempotent."""

    @abc.abstractmethod
    async def declare_exchange(self, name: str) -> None:
        """Declare a durable topic exchange (idempotent)."""

    @abc.abstractmethod
    async def declare_queue(self, spec: QueueSpec) -> str:
        """Declare a queue (idempotent for WORK queues) and return its name."""

    @abc.abstractmethod
    async def bind(self, queue: str, exchange: str, pattern: str) -> None:
        """Route messages whose routing key matches ``pattern`` on ``exchange`` into ``queue``."""

    @abc.abstractmethod
    async def unbind(self, queue: str, exchange: str, pattern: str) -> bool:
        """Remove the binding of ``queue`` to ``exchange`` with ``pattern``, if any.

        Returns False (and does nothing) when the queue or the exchange does not exist.
        """

    @abc.abstractmethod
    async def bind_exchange(self, destination: str, source: str, pattern: str) -> None:
        """Route messages whose routing key matches ``pattern`` on ``source`` into exchange ``destination``."""

    @abc.abstractmethod
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
        """Encode and publish; return once confirmed. ``mandatory`` raises Unroutable if no queue matched.

        Across a lost connection the backend publishes again until ``timeout`` (the message may then
        arrive after messages published after it). ``in_order``: it does not; the failure is raised
        at once, so that a caller publishing a run of messages concurrently can publish the run
        again from its first unconfirmed one, and no message ever first arrives after a later one
        of the run (the frames of one channel reach the broker in the order they were written)."""

    @abc.abstractmethod
    async def consume(self, queue: str, handler: Handler, *, prefetch: int = 10, no_ack: bool = False) -> Consumer:
        """Start delivering messages from ``queue`` to ``handler`` (see the ack policy above).

        With ``no_ack`` the broker forgets each message as it delivers it (see the no-ack form above).
        """

    #: Every backend builds its :class:`~infra.bus.batch.RequestBatcher` in ``__init__``; requests go through it.
    _batcher: RequestBatcher

    @abc.abstractmethod
    def _ready_for_request(self) -> None:
        """Raise :class:`BusUnavailable` unless this backend can send a request now (its own readiness check)."""

    async def request(
        self,
        exchange: str,
        routing_key: str,
        message: BusMessage,
        *,
        timeout: float,
        headers: Headers | None = None,
        batch_key: str | None = None,
    ) -> Delivery:
        """Publish (mandatory) with a reply address and wait for the reply, at most ``timeout`` seconds.

        With ``batch_key``, the request may travel inside a batch with others made in the same
        event-loop turn (see the module docstring); the answer and errors are the same.
        Raises RequestTimeout (outcome unknown), Unroutable (nobody listens), BusUnavailable.
        The returned reply delivery needs no settling.
        """
        self._ready_for_request()
        type_name, body = encode_message(message)
        return await self._batcher.request(exchange, routing_key, type_name, body, timeout=timeout, headers=headers,
                                           batch_key=batch_key)

    async def request_raw(self, exchange: str, routing_key: str, type_name: str, body: bytes, *, timeout: float,
                          headers: Headers | None = None, batch_key: str | None = None) -> Delivery:
        """:meth:`request` with bytes as they are, bypassing the encoder: for tests and diagnostics only
        (how a test puts an undecodable member in a batch)."""
        self._ready_for_request()
        return await self._batcher.request(exchange, routing_key, type_name, bytes(body), timeout=timeout,
                                           headers=headers, batch_key=batch_key)

    @abc.abstractmethod
    async def reply(self, request: Delivery, message: BusMessage, *, headers: Headers | None = None) -> None:
        """Answer a delivery that came from :meth:`request`. A no-op if it has no reply address."""

    @abc.abstractmethod
    async def check(self) -> None:
        """Raise BusUnavailable unless the broker answers right now (for /readyz and doctor)."""


async def declare_corpus_events(bus: Bus, exchange: str) -> None:
    """Declare a corpus's event exchange and bind it into ``tm.events`` with ``#`` (idempotent).

    Whoever publishes to it or consumes from it declares it, so that it exists in whichever order
    they start, and always with the binding that keeps ``tm.events`` carrying every event.
    """
    await bus.declare_exchange(exchange)
    await bus.bind_exchange(EVENTS_EXCHANGE, exchange, "#")


def deadline_header(timeout: float) -> dict[str, HeaderValue]:
    """The ``x-deadline`` header for a request that waits ``timeout`` seconds from now."""
    return {DEADLINE_HEADER: int((time.time() + timeout) * 1000)}

