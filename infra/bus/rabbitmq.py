"""The RabbitMQ bus: the contract of :mod:`infra.bus.base` on aio-pika.

Connections and channels
    One robust connection (aio-pika's ``connect_robust`` machinery): when the broker drops it, it
    reconnects every ``reconnect_interval`` seconds and re-declares what was declared through it
    (exchanges, queues, bindings, consumers, QoS). The very first connect, however, fails fast with
    :class:`BusUnavailable` naming the URL (password redacted): a misconfigured node must not sit
    retrying in silence. Channels: one for declarations, one for publishing (publisher confirms),
    one for requests (publisher confirms plus the direct reply-to consumer, which RabbitMQ requires
    on the publishing channel), and one per consumer so each gets its own ``basic.qos`` prefetch.

Topology (see docs/architecture.md)
    WORK queues are durable quorum queues with ``x-delivery-limit``, dead-lettered to ``tm.dead``
    with routing key = the queue name, at-least-once (which needs ``x-overflow: reject-publish``).
    NODE queues are exclusive, auto-delete, classic, with ``x-max-length`` and drop-head overflow.
    A no-ack consumer (``consume(..., no_ack=True)``) is a ``basic.consume`` with ``no-ack``: its
    deliveries carry no tag to settle, and its handler slots, not ``basic.qos``, bound it.
    WAKE queues are durable quorum queues with ``x-max-length`` and drop-head overflow, no dead letters.

Delivery counts and dead letters
    ``delivery_count`` is the quorum queue's ``x-delivery-count`` + 1. RabbitMQ's ``x-delivery-limit``
    counts *failed* deliveries and dead-letters once they exceed it, so ``QueueSpec.delivery_limit``
    (total deliveries) is declared as ``delivery_limit - 1``. Our own dead letters (undecodable
    bodies, :class:`ProtocolDecodeError`, :meth:`Delivery.dead_letter`) are published as confirmed
    copies to ``tm.dead`` with ``x-tm-dead-reason`` before the original is acked; the broker's own
    (delivery limit, ``nack(requeue=False)``) carry ``x-first-death-reason``, which consumers see
    as ``x-tm-dead-reason`` too, so dead letters read the same whoever produced them.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any, cast
from urllib.parse import urlsplit

import aio_pika
import aiormq
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel
from aio_pika.connection import make_url
from aiormq.abc import DeliveredMessage
from pamqp.common import FieldTable

from infra.bus.base import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_LETTER_QUEUE,
    DEAD_REASON_HEADER,
    DELIVERY_COUNT_HEADER,
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
    BatchMember,
    PendingRequests,
    RawMessage,
    dead_letter_headers,
    handle_delivery,
    outgoing_headers,
)
from infra.logs import get_logger
from infra.redact import redact_url
from protocol.errors import BusError, BusUnavailable, Unroutable
from protocol.messages import CONTENT_TYPE, BusMessage, encode_message

log = get_logger("toastmachine.bus.rabbitmq")

DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
_PERSISTENT = 2
_SETTLE_ERRORS = (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError, ConnectionError)
#: Failures after which a publish is tried again once the connection is back.
_TRANSIENT = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.DeliveryError,  # a broker nack (e.g. reject-publish): the broker kept nothing
    ConnectionError,
    OSError,
)
#: Channel errors that no retry can fix (missing exchange, refused access, conflicting arguments).
_FATAL_CHANNEL = (
    aiormq.exceptions.ChannelNotFoundEntity,
    aiormq.exceptions.ChannelAccessRefused,
    aiormq.exceptions.ChannelPreconditionFailed,
    aiormq.exceptions.ChannelLockedResource,
)


class RabbitBus(Bus):
    """The RabbitMQ bus (backend "rabbitmq").

    Args:
        url: AMQP URL, e.g. ``amqp://guest:guest@127.0.0.1:5672/``.
        connection_name: shown by ``rabbitmqctl list_connections client_properties``.
        connect_timeout: seconds the first connect may take before BusUnavailable.
        reconnect_interval: seconds between reconnect attempts after the connection dropped.
        max_pending_requests: most :meth:`request` calls waiting for a reply at once.
        max_batch_count / max_batch_bytes: bounds of one request batch (:mod:`infra.bus.batch`).
    """

    backend = "rabbitmq"

    def __init__(self, url: str, *, connection_name: str = "toastmachine", connect_timeout: float = 10.0,
                 reconnect_interval: float = 1.0,
                 max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
                 max_batch_count: int = DEFAULT_MAX_BATCH_COUNT, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> None:
        super().__init__()
        self.url = url
        self.connection_name = connection_name
        self.connect_timeout = connect_timeout
        self.reconnect_interval = reconnect_interval
        #: Queue and exchange names declared through this bus (tests delete theirs with it).
        self.declared_queues: set[str] = set()
        self.declared_exchanges: set[str] = set()
        self._connection: aio_pika.RobustConnection | None = None
        self._admin: AbstractRobustChannel | None = None
        self._pub: AbstractRobustChannel | None = None
        self._rpc: AbstractRobustChannel | None = None
        self._queue_args: dict[str, dict[str, Any]] = {}
        self._consumers: set[_RabbitConsumer] = set()
        self._pending = PendingRequests(max_pending_requests)
        self._batcher = RequestBatcher(self._send_request, self._pending, self.stats, max_count=max_batch_count,
                                       max_bytes=max_batch_bytes)
        # Mirrors stats.connected for waiters: set once the (re)connect has restored the topology.
        self._up = asyncio.Event()
        self._closing = False

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    # --- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> None:
        if self._connection is not None:
            return
        # connect_robust(), unrolled so that a failed first attempt can be closed: otherwise the
        # half-made connection object would be left for the garbage collector to close.
        connection = aio_pika.RobustConnection(
            make_url(self.url), reconnect_interval=self.reconnect_interval,
            client_properties={"connection_name": self.connection_name})
        try:
            async with asyncio.timeout(self.connect_timeout):
                await connection.connect(timeout=self.connect_timeout)
        except Exception as e:  # noqa: BLE001 - whatever failed, the first connect fails fast
            with contextlib.suppress(Exception):
                await connection.close()
            detail = self._scrub(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            if "got <Connection.Close" in str(e):
                # The broker refused Connection.Open (aiormq keeps only the frame's name, not its
                # reply text): the virtual host, or this user's permission on it.
                detail = ("the broker closed the connection while opening it: the virtual host in the URL "
                          "does not exist, or this user has no permission on it (rabbitmqctl list_vhosts, "
                          "list_user_permissions)")
            raise BusUnavailable(f"cannot connect to RabbitMQ at {self.redacted_url}: {detail}") from None
        self._connection = connection
        try:
            connection.close_callbacks.add(self._on_connection_lost)
            connection.reconnect_callbacks.add(self._on_reconnected)
            self._admin = await connection.channel(publisher_confirms=False)
            self._pub = await connection.channel(publisher_confirms=True)
            self._rpc = await connection.channel(publisher_confirms=True)
            for name in (COMMANDS_EXCHANGE, EVENTS_EXCHANGE, DEAD_EXCHANGE):
                await self.declare_exchange(name)
            await self._declare(DEAD_LETTER_QUEUE, durable=True, exclusive=False, auto_delete=False,
                                arguments={"x-queue-type": "quorum"})
            await self.bind(DEAD_LETTER_QUEUE, DEAD_EXCHANGE, "#")
            # Direct reply-to: consume the pseudo-queue without acks on the channel that publishes
            # requests. Declared (passively) through the robust channel so a reconnect restores it.
            replies = await self._rpc.declare_queue(DIRECT_REPLY_TO, passive=True)
            await replies.consume(self._on_reply, no_ack=True)
        except BaseException as e:
            await self._teardown()
            if isinstance(e, BusError | asyncio.CancelledError):
                raise
            raise BusUnavailable(f"RabbitMQ at {self.redacted_url} refused the bus topology: "
                                 f"{self._scrub(repr(e))}") from None
        self.stats.connected = True
        self._up.set()
        log.info("bus.connected", url=self.redacted_url)

    async def close(self) -> None:
        if self._connection is None:
            return
        self._closing = True
        for consumer in list(self._consumers):
            await consumer.drain(0)
        self._pending.fail_all(BusUnavailable("the bus was closed while waiting for a reply"))
        await self._teardown()

    async def _teardown(self) -> None:
        connection, self._connection = self._connection, None
        self._admin = self._pub = self._rpc = None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()
        self.stats.connected = False
        self._up.clear()
        self._closing = False

    def _on_connection_lost(self, _sender: object, exc: BaseException | None = None) -> None:
        if self.stats.connected and not self._closing:
            log.warning("bus.connection_lost", url=self.redacted_url, error=self._scrub(repr(exc)))
        self.stats.connected = False
        self._up.clear()

    def _on_reconnected(self, _sender: object) -> None:
        self.stats.connected = True
        self._up.set()
        self.stats.reconnects += 1
        log.info("bus.reconnected", url=self.redacted_url, reconnects=self.stats.reconnects)

    async def wait_connected(self, timeout: float) -> None:
        """Wait until the connection is up with its topology restored (e.g. after an outage).

        Raises BusUnavailable after ``timeout`` seconds. Deliveries may resume slightly before this
        returns: aio-pika restores channels and consumers first, then reports the reconnect.
        """
        try:
            async with asyncio.timeout(timeout):
                await self._up.wait()
        except TimeoutError:
            raise BusUnavailable(f"RabbitMQ at {self.redacted_url} is still unreachable after {timeout}s") from None

    def _scrub(self, text: str) -> str:
        """Keep the password out of error text that quotes the URL."""
        password = urlsplit(self.url).password
        return text.replace(password, "***") if password else text

    async def check(self) -> None:
        connection, admin = self._connection, self._admin
        if connection is None or admin is None or connection.is_closed:
            raise BusUnavailable(f"not connected to RabbitMQ at {self.redacted_url}")
        if not connection.connected.is_set() or admin.is_closed:
            raise BusUnavailable(f"the connection to RabbitMQ at {self.redacted_url} is down; reconnecting")
        try:
            async with asyncio.timeout(5):
                channel = await admin.get_underlay_channel()
                await channel.exchange_declare(exchange=DEAD_EXCHANGE, passive=True)
        except (TimeoutError, *_SETTLE_ERRORS) as e:
            raise BusUnavailable(f"RabbitMQ at {self.redacted_url} does not answer: {e!r}") from None

    def _channels(self) -> tuple[AbstractRobustChannel, AbstractRobustChannel, AbstractRobustChannel]:
        if self._admin is None or self._pub is None or self._rpc is None:
            raise BusUnavailable(f"not connected to RabbitMQ at {self.redacted_url}")
        return self._admin, self._pub, self._rpc

    # --- topology ----------------------------------------------------------------------------

    async def declare_exchange(self, name: str) -> None:
        admin, _, _ = self._channels()
        if not name:
            raise BusError("the default exchange cannot be declared")
        await self._admin_call(admin.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True),
                               f"declare exchange {name!r}")
        self.declared_exchanges.add(name)

    async def declare_queue(self, spec: QueueSpec) -> str:
        if spec.kind is QueueKind.WORK:
            if not spec.name:
                raise BusError("WORK queues must be named")
            if spec.delivery_limit < 1:
                raise BusError(f"delivery_limit must be at least 1, not {spec.delivery_limit}")
            await self._declare(spec.name, durable=True, exclusive=False, auto_delete=False, arguments={
                "x-queue-type": "quorum",
                # RabbitMQ counts failed deliveries and dead-letters past the limit: see module doc.
                "x-delivery-limit": spec.delivery_limit - 1,
                "x-dead-letter-exchange": DEAD_EXCHANGE,
                "x-dead-letter-routing-key": spec.name,
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
            })
            return spec.name
        if spec.max_length < 1:
            raise BusError(f"max_length must be at least 1, not {spec.max_length}")
        if spec.kind is QueueKind.WAKE:
            if not spec.name:
                raise BusError("WAKE queues must be named")
            # Hints only: dropping the oldest when full never blocks a publisher, and nothing is
            # dead-lettered (the consumer reads the truth from the database).
            await self._declare(spec.name, durable=True, exclusive=False, auto_delete=False, arguments={
                "x-queue-type": "quorum", "x-max-length": spec.max_length, "x-overflow": "drop-head"})
            return spec.name
        # Named here rather than by the broker, so the reconnect can declare the same name again.
        name = spec.name or f"tm.node.{uuid.uuid4().hex}"
        await self._declare(name, durable=False, exclusive=True, auto_delete=True,
                            arguments={"x-max-length": spec.max_length, "x-overflow": "drop-head"})
        return name

    async def _declare(self, name: str, *, durable: bool, exclusive: bool, auto_delete: bool,
                       arguments: dict[str, Any]) -> None:
        admin, _, _ = self._channels()
        args: dict[str, Any] = {"durable": durable, "exclusive": exclusive, "auto_delete": auto_delete,
                                "arguments": arguments}
        await self._admin_call(admin.declare_queue(name, **args), f"declare queue {name!r}")
        self._queue_args[name] = args
        self.declared_queues.add(name)

    async def bind(self, queue: str, exchange: str, pattern: str) -> None:
        admin, _, _ = self._channels()
        if not exchange:
            raise BusError("queues cannot be bound to the default exchange")

        async def do() -> None:
            q = await admin.declare_queue(queue, passive=True)
            await q.bind(exchange, pattern)

        await self._admin_call(do(), f"bind {queue!r} to {exchange!r} with {pattern!r}")

    async def unbind(self, queue: str, exchange: str, pattern: str) -> bool:
        self._channels()
        connection = self._connection
        assert connection is not None

        async def do() -> bool:
            # A channel of its own: RabbitMQ closes the channel of a command naming a missing queue
            # or exchange, and "nothing to unbind" must not disturb the channels in use.
            channel = await connection.channel(publisher_confirms=False)
            try:
                underlay = await channel.get_underlay_channel()
                # queue.unbind itself succeeds for a missing queue on some broker versions: ask first.
                await underlay.queue_declare(queue, passive=True)
                await underlay.exchange_declare(exchange, passive=True)
                await underlay.queue_unbind(queue=queue, exchange=exchange, routing_key=pattern)
            except aiormq.exceptions.ChannelNotFoundEntity:
                return False  # no such queue or exchange: no such binding either
            finally:
                with contextlib.suppress(Exception):
                    await channel.close()
            return True

        return bool(await self._admin_call(do(), f"unbind {queue!r} from {exchange!r} with {pattern!r}"))

    async def bind_exchange(self, destination: str, source: str, pattern: str) -> None:
        admin, _, _ = self._channels()

        async def do() -> None:
            target = await admin.get_exchange(destination, ensure=False)
            await target.bind(source, pattern)

        await self._admin_call(do(), f"bind exchange {destination!r} to {source!r} with {pattern!r}")

    async def delete_queue(self, name: str) -> None:
        """Delete a queue (for tests and operations). Consumers of it stop."""
        admin, _, _ = self._channels()
        for consumer in list(self._consumers):
            if consumer.queue_name == name:
                await consumer.drain(0)
        await self._admin_call(admin.queue_delete(name), f"delete queue {name!r}")
        self._queue_args.pop(name, None)
        self.declared_queues.discard(name)

    async def delete_exchange(self, name: str) -> None:
        """Delete an exchange (for tests and operations)."""
        admin, _, _ = self._channels()
        await self._admin_call(admin.exchange_delete(name), f"delete exchange {name!r}")
        self.declared_exchanges.discard(name)

    async def _admin_call(self, call: Any, what: str, timeout: float = 30.0) -> Any:
        try:
            async with asyncio.timeout(timeout):
                return await call
        except _FATAL_CHANNEL as e:
            raise BusError(f"RabbitMQ refused to {what}: {e}") from None
        except TimeoutError:
            raise BusUnavailable(f"could not {what} within {timeout}s: RabbitMQ at "
                                 f"{self.redacted_url} does not answer") from None
        except _TRANSIENT as e:
            raise BusUnavailable(f"could not {what}: {self._scrub(repr(e))}") from None

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
        _, pub, _ = self._channels()
        type_name, body = encode_message(message)
        properties = _properties(
            content_type=CONTENT_TYPE, delivery_mode=_PERSISTENT, headers=outgoing_headers(headers),
            message_type=type_name, message_id=message_id, correlation_id=correlation_id)
        await self._send(pub, exchange, routing_key, body, properties, mandatory=mandatory, timeout=timeout,
                         in_order=in_order)

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
        _, pub, _ = self._channels()
        properties = _properties(
            content_type=CONTENT_TYPE, delivery_mode=_PERSISTENT, headers=outgoing_headers(headers),
            message_type=type_name)
        await self._send(pub, exchange, routing_key, bytes(body), properties, mandatory=mandatory,
                         timeout=timeout)

    async def _send(self, channel: AbstractRobustChannel, exchange: str, routing_key: str, body: bytes,
                    properties: aiormq.spec.Basic.Properties, *, mandatory: bool, timeout: float,
                    in_order: bool = False) -> None:
        """Publish and wait for the confirm; across a reconnect, publish again until ``timeout``
        (``in_order``: raise BusUnavailable at the first loss instead, see :meth:`Bus.publish`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        attempt = 0
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    if attempt:
                        # Wait for the reconnect (and the channel's restored consumers: the
                        # request channel must have its reply-to consumer before publishing).
                        await asyncio.sleep(min(0.05 * attempt, 0.5))
                    await channel.ready()
                    underlay = await channel.get_underlay_channel()
                    result = await underlay.basic_publish(
                        body, exchange=exchange, routing_key=routing_key, properties=properties,
                        mandatory=mandatory)
            except TimeoutError:
                raise BusUnavailable(
                    f"publish to {exchange or '(default exchange)'!r} with routing key {routing_key!r} "
                    f"was not confirmed within {timeout}s (RabbitMQ at {self.redacted_url})") from None
            except _FATAL_CHANNEL as e:
                raise BusError(f"RabbitMQ refused a publish to {exchange!r}: {e}") from None
            except _TRANSIENT as e:
                if in_order:
                    raise BusUnavailable(f"publish to {exchange!r} lost with the connection: {self._scrub(repr(e))}") \
                        from None
                attempt += 1
                log.debug("bus.publish_retry", exchange=exchange, attempt=attempt, error=repr(e))
                continue
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # Not our cancellation: a confirm future cancelled by the closing channel.
                if in_order:
                    raise BusUnavailable(f"publish to {exchange!r} lost with the channel") from None
                attempt += 1
                continue
            if isinstance(result, DeliveredMessage):
                raise Unroutable(f"no queue is bound to {exchange or '(default exchange)'!r} "
                                 f"for routing key {routing_key!r}")
            self.stats.published += 1
            return

    # --- consuming ---------------------------------------------------------------------------

    async def consume(self, queue: str, handler: Handler, *, prefetch: int = 10, no_ack: bool = False) -> Consumer:
        if self._connection is None:
            raise BusUnavailable(f"not connected to RabbitMQ at {self.redacted_url}")
        if prefetch < 1:
            raise BusError(f"prefetch must be at least 1, not {prefetch}")
        consumer = _RabbitConsumer(self, queue, handler, prefetch, no_ack)
        await consumer.start(self._connection, self._queue_args.get(queue))
        self._consumers.add(consumer)
        return consumer

    async def fetch_raw(self, queue: str, *, timeout: float) -> RawMessage | None:
        """Take one message from ``queue`` undecoded (acked), or None after ``timeout`` seconds.

        For diagnostics and tests: it is the only way to look at a dead letter whose body the
        codec cannot decode. It polls with basic.get rather than consuming, because cancelling a
        consumer would delete an auto-delete (NODE) queue.
        """
        admin, _, _ = self._channels()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pause = 0.01
        q = await self._admin_call(admin.declare_queue(queue, passive=True, robust=False), f"find queue {queue!r}")
        while True:
            incoming = await self._admin_call(q.get(no_ack=False, fail=False), f"read from {queue!r}")
            if incoming is not None:
                await incoming.ack()
                return RawMessage(incoming.exchange or "", incoming.routing_key or "", incoming.type,
                                  incoming.body, _headers(incoming.headers), bool(incoming.redelivered))
            if loop.time() + pause > deadline:
                return None
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.2)

    async def _consumer_gone(self, consumer: _RabbitConsumer) -> None:
        self._consumers.discard(consumer)
        name = consumer.queue_name
        args = self._queue_args.get(name)
        if args is None or not args["auto_delete"] or any(c.queue_name == name for c in self._consumers):
            return
        # The broker deleted the auto-delete queue with its last consumer; forget it too, or the
        # next reconnect would declare it again (with its bindings) for nobody.
        self._queue_args.pop(name, None)
        self.declared_queues.discard(name)
        if self._admin is not None and not self._closing:
            with contextlib.suppress(BusError):
                await self._admin_call(self._admin.queue_delete(name), f"forget queue {name!r}", timeout=5)

    # --- request / reply ---------------------------------------------------------------------

    def _ready_for_request(self) -> None:
        self._channels()

    async def _send_request(self, exchange: str, routing_key: str, type_name: str, body: bytes,
                            headers: dict[str, HeaderValue], correlation_id: str, timeout: float) -> None:
        _, _, rpc = self._channels()
        properties = _properties(
            content_type=CONTENT_TYPE, delivery_mode=_PERSISTENT, message_type=type_name, headers=headers,
            correlation_id=correlation_id, reply_to=DIRECT_REPLY_TO)
        await self._send(rpc, exchange, routing_key, body, properties, mandatory=True, timeout=timeout)

    async def _on_reply(self, incoming: AbstractIncomingMessage) -> None:
        self.stats.delivered += self._batcher.resolve_reply(
            incoming.type, incoming.body, _headers(incoming.headers), exchange=incoming.exchange or "",
            routing_key=incoming.routing_key or "", message_id=incoming.message_id,
            correlation_id=incoming.correlation_id)

    async def reply(self, request: Delivery, message: BusMessage, *, headers: Headers | None = None) -> None:
        if isinstance(request, BatchMember):
            request.answer_with(message, headers)
            return
        if not request.reply_to:
            return
        _, pub, _ = self._channels()
        type_name, body = encode_message(message)
        properties = _properties(
            content_type=CONTENT_TYPE, message_type=type_name, headers=outgoing_headers(headers),
            correlation_id=request.correlation_id)
        # Not mandatory: RabbitMQ returns mandatory publishes to reply-to addresses even when it
        # delivers them, and a requester that went away needs no answer anyway.
        await self._send(pub, "", request.reply_to, body, properties, mandatory=False, timeout=10.0)

    async def _dead_letter_copy(self, delivery: _RabbitDelivery, queue: str, reason: str) -> None:
        _, pub, _ = self._channels()
        original = delivery.raw.header.properties
        properties = _properties(
            content_type=original.content_type, delivery_mode=_PERSISTENT, message_type=original.message_type,
            headers=dead_letter_headers(delivery, queue, reason), message_id=original.message_id,
            correlation_id=original.correlation_id, reply_to=original.reply_to)
        await self._send(pub, DEAD_EXCHANGE, queue, delivery.raw.body, properties, mandatory=False, timeout=10.0)


class _RabbitDelivery(Delivery):
    """A delivery read straight from aiormq (no aio-pika IncomingMessage: see _RabbitConsumer)."""

    def __init__(self, consumer: _RabbitConsumer, raw: DeliveredMessage) -> None:
        super().__init__()
        self.consumer = consumer
        self.raw = raw
        frame = raw.delivery
        properties = raw.header.properties
        self.exchange = frame.exchange or ""  # type: ignore[union-attr]
        self.routing_key = frame.routing_key or ""  # type: ignore[union-attr]
        self.headers = _headers(properties.headers)
        self.message_id = properties.message_id
        self.correlation_id = properties.correlation_id
        self.reply_to = properties.reply_to
        self.redelivered = bool(frame.redelivered)  # type: ignore[union-attr]
        count = self.headers.get(DELIVERY_COUNT_HEADER)
        if isinstance(count, int) and not isinstance(count, bool):
            self.delivery_count = count + 1
        else:
            # Classic (NODE) queues keep no count: a redelivery is at least the second delivery.
            self.delivery_count = 2 if self.redelivered else 1

    def _claim(self) -> bool:
        if self.settled:
            return False
        self.settled = True
        self.consumer.unsettled.discard(self)
        return True

    async def ack(self) -> None:
        if self._claim() and not self.consumer.no_ack:
            await self._settle(requeue=None)
            self.consumer.bus.stats.acked += 1

    async def nack(self, requeue: bool = True) -> None:
        # A no-ack delivery has no tag to settle (basic.ack on it would close the channel): it is gone.
        if self._claim() and not self.consumer.no_ack:
            await self._settle(requeue=requeue)
            self.consumer.bus.stats.nacked += 1

    async def dead_letter(self, reason: str) -> None:
        if self.settled:
            return
        bus = self.consumer.bus
        try:
            await bus._dead_letter_copy(self, self.consumer.queue_name, reason)
        except BaseException:
            # The copy is not safe in tm.dead: give the original back rather than lose it.
            await self.nack(requeue=True)
            raise
        if self._claim():
            if not self.consumer.no_ack:
                await self._settle(requeue=None)
            bus.stats.dead_lettered += 1

    async def dead_letter_member(self, type_name: str | None, body: bytes, headers: Headers) -> None:
        bus = self.consumer.bus
        _, pub, _ = bus._channels()
        original = self.raw.header.properties
        properties = _properties(content_type=original.content_type, delivery_mode=_PERSISTENT,
                                 message_type=type_name, headers=dict(headers))
        await bus._send(pub, DEAD_EXCHANGE, self.consumer.queue_name, body, properties, mandatory=False,
                        timeout=10.0)
        bus.stats.dead_lettered += 1

    async def _settle(self, *, requeue: bool | None) -> None:
        """basic.ack (requeue None) or basic.nack, on the channel the message came on."""
        channel, tag = self.raw.channel, self.raw.delivery_tag
        try:
            if channel.is_closed or tag is None:
                raise aiormq.exceptions.ChannelInvalidStateError("the channel is closed")
            if requeue is None:
                await channel.basic_ack(tag)
            else:
                await channel.basic_nack(tag, requeue=requeue)
        except _SETTLE_ERRORS as e:
            # The channel it came on is gone, and with it the delivery: the broker redelivers it.
            log.info("bus.settle_lost", queue=self.consumer.queue_name, requeue=requeue, error=repr(e))


class _RabbitConsumer(Consumer):
    """One consumer on its own robust channel (its own basic.qos).

    Deliveries are taken from aiormq directly rather than through aio-pika's consumer: building
    aio-pika's IncomingMessage costs more than our whole ack policy (bench/bus.py). The price is
    that restoring the subscription after a reconnect is ours: the robust channel re-declares
    the queue and QoS, then calls :meth:`_on_reopen`, which consumes again.
    """

    def __init__(self, bus: RabbitBus, queue_name: str, handler: Handler, prefetch: int, no_ack: bool = False) -> None:
        self.bus = bus
        self.queue_name = queue_name
        self.handler = handler
        self.prefetch = prefetch
        #: basic.consume with no_ack: the broker forgets each message as it sends it (see the contract).
        self.no_ack = no_ack
        self.active = False
        self.unsettled: set[_RabbitDelivery] = set()
        self._tasks: dict[asyncio.Task[Any], _RabbitDelivery] = {}
        self._resubscribe: set[asyncio.Task[None]] = set()
        # basic.qos bounds unacked messages per channel; this also bounds handlers that settle
        # early and keep running, and the old channel's handlers still running after a reconnect.
        self._slots = asyncio.Semaphore(prefetch)
        self._channel: AbstractRobustChannel | None = None
        self._tag = f"tm.{queue_name}.{uuid.uuid4().hex[:12]}"

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def start(self, connection: aio_pika.RobustConnection, declaration: Mapping[str, Any] | None) -> None:
        channel: AbstractRobustChannel = await connection.channel(publisher_confirms=False)  # type: ignore[assignment]
        self._channel = channel
        try:
            await channel.set_qos(prefetch_count=self.prefetch)
            # Our own queues are declared in full on this channel too: after a reconnect its
            # restore may run before the declaring channel's, and an exclusive queue is gone by then.
            if declaration is not None:
                await channel.declare_queue(self.queue_name, **declaration)
            else:
                await channel.declare_queue(self.queue_name, passive=True)
            self.active = True
            channel.reopen_callbacks.add(self._on_reopen)
            await self._subscribe()
        except BaseException as e:
            self.active = False
            await self._close_channel()
            if isinstance(e, _FATAL_CHANNEL):
                raise BusError(f"cannot consume {self.queue_name!r}: {e}") from None
            if isinstance(e, _TRANSIENT):
                raise BusUnavailable(f"cannot consume {self.queue_name!r}: {e!r}") from None
            raise

    async def _subscribe(self) -> None:
        assert self._channel is not None
        underlay = cast(aiormq.Channel, await self._channel.get_underlay_channel())
        # aiormq hands frames from the connection's reader to the channel's through a queue of 10
        # frames (3 per message), one hand-over per event-loop turn: on a process whose loop turns
        # are long (a web node feeding thousands of streams), that caps what it can consume far
        # below what it can handle. Unbounded here, on a channel of ours that nothing has used yet;
        # memory stays bounded by the prefetch (basic.qos), which limits unacknowledged deliveries.
        # A no-ack consumer has no such limit from the broker: its channel's reader turns each
        # message at once into a handler or a drop (_on_message), so what waits here is what the
        # socket brought since the loop's last turn, and the broker's bounded queue holds the rest.
        # (The channel's reader is already waiting on that queue, so the bound is lifted in place.)
        if underlay.frames.maxsize:
            underlay.frames._maxsize = 0  # type: ignore[attr-defined]
        underlay.on_consumer_cancel_callbacks.add(self._on_broker_cancel)
        if self._tag not in underlay.consumers:
            await underlay.basic_consume(self.queue_name, self._on_message, consumer_tag=self._tag,
                                         no_ack=self.no_ack, timeout=30)

    async def _on_reopen(self, _channel: object) -> None:
        if not self.active:
            return
        try:
            await self._subscribe()
        except Exception as e:  # noqa: BLE001 - the reopen machinery would swallow it silently
            log.error("bus.resubscribe_failed", queue=self.queue_name, error=repr(e))

    def _on_broker_cancel(self, frame: aiormq.spec.Basic.Cancel) -> None:
        if frame.consumer_tag != self._tag or not self.active:
            return
        # E.g. the queue was deleted under us: declare it again (WORK queues come back empty) and
        # consume again once, as aio-pika's own robust consumers do.
        log.warning("bus.consumer_cancelled_by_broker", queue=self.queue_name)
        task = asyncio.get_running_loop().create_task(self._resubscribe_after_cancel())
        self._resubscribe.add(task)
        task.add_done_callback(self._resubscribe.discard)

    async def _resubscribe_after_cancel(self) -> None:
        declaration = self.bus._queue_args.get(self.queue_name)
        try:
            assert self._channel is not None
            async with asyncio.timeout(30):
                if declaration is not None:
                    await self._channel.declare_queue(self.queue_name, **declaration)
                else:
                    await self._channel.declare_queue(self.queue_name, passive=True)
                await self._subscribe()
        except Exception as e:  # noqa: BLE001 - nothing above us to report to but the log
            log.error("bus.resubscribe_failed", queue=self.queue_name, error=repr(e))

    async def _on_message(self, raw: DeliveredMessage) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.bus.stats.delivered += 1
        if self.no_ack and len(self._tasks) >= self.prefetch:
            # basic.qos does not bound a no-ack consumer: the handler slots do. Every one is busy and
            # the broker already forgot the message: dropped, as the no-ack form allows.
            extra = self.bus.stats.extra
            extra["no_ack_dropped"] = extra.get("no_ack_dropped", 0) + 1
            log.debug("bus.no_ack_dropped", queue=self.queue_name)
            return
        delivery = _RabbitDelivery(self, raw)
        if not self.no_ack:
            self.unsettled.add(delivery)
        self._tasks[task] = delivery
        try:
            if not self.active:
                # Arrived after cancel(): not ours to start any more.
                await delivery.nack(requeue=True)
                return
            async with self._slots:
                await handle_delivery(delivery, raw.header.properties.message_type, raw.body, self.handler,
                                      queue=self.queue_name, log=log, reply=self.bus.reply)
        except asyncio.CancelledError:
            # Cut off by drain() or by the channel closing: hand it back (a no-op on a dead channel).
            if not delivery.settled:
                await delivery.nack(requeue=True)
            raise
        finally:
            self._tasks.pop(task, None)

    async def cancel(self) -> None:
        if not self.active:
            return
        self.active = False
        for task in list(self._resubscribe):
            task.cancel()
        channel = self._channel
        if channel is not None and not channel.is_closed:
            # During an outage basic.cancel would wait for the reconnect, and the reconnect will
            # not subscribe again (we are inactive): a bounded wait is enough.
            with contextlib.suppress(TimeoutError, *_SETTLE_ERRORS):
                async with asyncio.timeout(5):
                    underlay = await channel.get_underlay_channel()
                    await underlay.basic_cancel(self._tag)

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
        for delivery in list(self.unsettled):
            await delivery.nack(requeue=True)
        if self._resubscribe:
            await asyncio.gather(*self._resubscribe, return_exceptions=True)
        # Closing the channel requeues whatever the broker sent after our basic.cancel.
        await self._close_channel()
        await self.bus._consumer_gone(self)
        return finished

    async def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(TimeoutError, *_SETTLE_ERRORS):
                async with asyncio.timeout(5):
                    await channel.close()


def _properties(*, headers: dict[str, HeaderValue] | None = None, **kwargs: Any) -> aiormq.spec.Basic.Properties:
    """AMQP properties; our header values are a subset of what an AMQP field table holds."""
    return aiormq.spec.Basic.Properties(headers=cast(FieldTable, headers), **kwargs)


def _headers(raw: Mapping[str, Any] | None) -> dict[str, HeaderValue]:
    """AMQP headers as plain values; the broker's dead-letter headers mapped onto ours."""
    out: dict[str, HeaderValue] = {}
    if not raw:
        return out
    for key, value in raw.items():
        if value is None or isinstance(value, str | int | float | bool):
            out[key] = value
        elif isinstance(value, bytes):
            out[key] = value.decode("utf-8", "replace")
        elif isinstance(value, Decimal):
            out[key] = float(value)
        elif isinstance(value, datetime):
            out[key] = value.isoformat()
        # Arrays and tables (x-death) have no HeaderValue form; what matters of them is mapped below.
    if DEAD_REASON_HEADER not in out and "x-first-death-reason" in out:
        out[DEAD_REASON_HEADER] = out["x-first-death-reason"]
        out[DEAD_EXCHANGE_HEADER] = out.get("x-first-death-exchange")
        out[DEAD_QUEUE_HEADER] = out.get("x-first-death-queue")
        deaths = raw.get("x-death")
        if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
            keys = deaths[0].get("routing-keys")
            if isinstance(keys, list) and keys:
                key = keys[0]
                out[DEAD_ROUTING_KEY_HEADER] = key.decode() if isinstance(key, bytes) else str(key)
    return out
