"""What both bus backends share, so that they cannot drift apart: the consumer's ack policy, the
header conventions of dead letters, the outgoing trace header and the reply delivery.

The ack policy (:func:`handle_delivery`) is the one described in :mod:`infra.bus.base`: decode with
the real codec (an undecodable body is dead-lettered and never reaches the handler), run the
handler with the message's trace id bound, then ack on return, dead-letter on
:class:`ProtocolDecodeError`, requeue on any other exception. Cancellation is not settled here: the
consumer that cancelled the handler requeues the delivery itself (see ``drain``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from infra.bus.base import DEAD_REASON_HEADER, DEADLINE_HEADER, Delivery, Handler, HeaderValue
from infra.logs import TRACE_HEADER, bound_trace, current_trace_id
from protocol.errors import BusError, BusUnavailable, ProtocolDecodeError
from protocol.messages import BatchReply, BusMessage, ErrorReply, RequestBatch, decode_message, encode_message

#: Where a dead letter was first published (exchange and routing key), beside x-tm-dead-reason.
DEAD_EXCHANGE_HEADER = "x-tm-dead-exchange"
DEAD_ROUTING_KEY_HEADER = "x-tm-dead-routing-key"
#: The queue the dead letter was taken from (also its routing key on ``tm.dead``).
DEAD_QUEUE_HEADER = "x-tm-dead-queue"

#: Dead-letter reasons chosen by the bus itself (the broker's words, so both backends agree).
REASON_DELIVERY_LIMIT = "delivery_limit"
REASON_REJECTED = "rejected"

#: A bound on requests waiting for their reply, per bus: past it, request() refuses at once.
DEFAULT_MAX_PENDING_REQUESTS = 10_000


def outgoing_headers(headers: Mapping[str, HeaderValue] | None) -> dict[str, HeaderValue]:
    """Copy ``headers`` and add the trace id bound to the running task, unless the caller set one."""
    out: dict[str, HeaderValue] = dict(headers) if headers else {}
    if TRACE_HEADER not in out:
        trace_id = current_trace_id()
        if trace_id is not None:
            out[TRACE_HEADER] = trace_id
    return out


def dead_letter_headers(delivery: Delivery, queue: str, reason: str) -> dict[str, HeaderValue]:
    """Headers of the copy published to ``tm.dead``: the original ones plus reason and provenance."""
    headers = dict(delivery.headers)
    headers[DEAD_REASON_HEADER] = reason
    headers[DEAD_EXCHANGE_HEADER] = delivery.exchange
    headers[DEAD_ROUTING_KEY_HEADER] = delivery.routing_key
    headers[DEAD_QUEUE_HEADER] = queue
    return headers


async def handle_delivery(
    delivery: Delivery, type_name: str | None, body: bytes, handler: Handler, *, queue: str, log: Any,
    reply: Callable[[Delivery, BusMessage], Awaitable[None]] | None = None,
) -> None:
    """Decode ``body`` and run ``handler`` on it under the ack policy of :mod:`infra.bus.base`.

    ``reply`` (the bus's :meth:`~infra.bus.base.Bus.reply`) answers a request whose body cannot be
    decoded with an :class:`~protocol.messages.ErrorReply` at once, so its requester does not wait
    for its deadline; the message itself is dead-lettered with the reason. A
    :class:`~protocol.messages.RequestBatch` is split: see :func:`_handle_batch`.
    """
    # A message without a trace id gets a fresh one; it only needs to be unique, not secret, and
    # uuid4() (os.urandom) is a noticeable share of the per-message cost.
    with bound_trace(delivery.trace_id or _fresh_trace(), queue=queue):
        try:
            delivery.message = decode_message(type_name, body)
        except ProtocolDecodeError as e:
            log.warning("bus.undecodable", queue=queue, error=str(e))
            if reply is not None and delivery.reply_to:
                await _answer_undecodable(delivery, str(e), reply, log)
            await _dead_letter(delivery, str(e), log)
            return
        if isinstance(delivery.message, RequestBatch):
            try:
                await _handle_batch(delivery, delivery.message, handler, queue=queue, log=log, reply=reply)
            except Exception as e:  # noqa: BLE001 - see below
                # A bug, not bad input (the codec refuses that): the batch must not stay unsettled,
                # holding a prefetch slot until the channel closes. Its members already applied
                # are answered from their idempotency records when their clients retry.
                log.error("bus.batch_failed", queue=queue, error=type(e).__name__)
                if not delivery.settled:
                    await _dead_letter(delivery, f"the batch could not be handled: {type(e).__name__}", log)
            return
        await _run_handler(delivery, type_name, handler, queue=queue, log=log)
        if not delivery.settled:
            await delivery.ack()


def _fresh_trace() -> str:
    return f"{random.getrandbits(128):032x}"


async def _run_handler(delivery: Delivery, type_name: str | None, handler: Handler, *, queue: str,
                       log: Any) -> None:
    """Run ``handler``; dead-letter on ProtocolDecodeError, requeue on any other exception."""
    try:
        await handler(delivery)
    except ProtocolDecodeError as e:
        if not delivery.settled:
            log.warning("bus.poison", queue=queue, message_type=type_name, error=str(e))
            await _dead_letter(delivery, str(e), log)
    except Exception as e:
        log.warning("bus.handler_failed", queue=queue, message_type=type_name, error=repr(e),
                    delivery_count=delivery.delivery_count, exc_info=True)
        if not delivery.settled:
            await delivery.nack(requeue=True)


class BatchMember(Delivery):
    """One request of a :class:`~protocol.messages.RequestBatch`, handed to the handler as if it had
    come alone: its own headers (deadline, trace id) over the batch's, its own correlation id.

    Settling it settles only the member: an ack or a reply is kept for the batch's one reply, a
    dead letter republishes the member alone to ``tm.dead`` with the reason (through the batch's
    delivery), a requeue makes the whole batch come again once every member is decided (members
    already applied are then answered from their idempotency records).
    """

    def __init__(self, batch: Delivery, member: Mapping[str, Any], queue: str) -> None:
        super().__init__()
        self.batch = batch
        self.queue = queue
        headers = {k: v for k, v in batch.headers.items() if k not in (DEADLINE_HEADER, TRACE_HEADER)}
        own = member.get("headers")
        if isinstance(own, dict):
            headers.update({str(k): v for k, v in own.items() if _is_header_value(v)})
        self.headers = headers
        self.exchange = batch.exchange
        routing_key = member.get("routing_key")
        self.routing_key = routing_key if isinstance(routing_key, str) else batch.routing_key
        correlation_id = member.get("correlation_id")
        self.correlation_id = correlation_id if isinstance(correlation_id, str) else None
        self.message_id = None
        self.reply_to = batch.reply_to if self.correlation_id is not None else None
        self.redelivered = batch.redelivered
        self.delivery_count = batch.delivery_count
        type_name = member.get("type")
        self.type_name = type_name if isinstance(type_name, str) else None
        raw = member.get("body")
        self.body = raw.encode() if isinstance(raw, str) else orjson.dumps(raw)
        #: The encoded answer for the batch reply, once the handler replied.
        self.answer: dict[str, Any] | None = None
        #: The handler asked for the member to come again.
        self.requeue = False

    def answer_with(self, message: BusMessage, headers: Mapping[str, HeaderValue] | None) -> None:
        """Keep ``message`` as this member's answer (what :meth:`Bus.reply` does with a member)."""
        if self.correlation_id is None:
            return
        type_name, body = encode_message(message)
        self.answer = {"correlation_id": self.correlation_id, "type": type_name, "body": body.decode(),
                       "headers": outgoing_headers(headers)}

    async def ack(self) -> None:
        self.settled = True

    async def nack(self, requeue: bool = True) -> None:
        if self.settled:
            return
        if requeue:
            self.settled = True
            self.requeue = True
        else:
            await self.dead_letter(REASON_REJECTED)

    async def dead_letter(self, reason: str) -> None:
        if self.settled:
            return
        try:
            await self.batch.dead_letter_member(self.type_name, self.body,
                                                dead_letter_headers(self, self.queue, reason))
        except BaseException:
            # The copy is not safe in tm.dead: the whole batch comes again rather than lose it.
            self.settled = True
            self.requeue = True
            raise
        self.settled = True

    async def dead_letter_member(self, type_name: str | None, body: bytes,
                                 headers: Mapping[str, HeaderValue]) -> None:
        """Batches do not nest: a member has no members."""
        raise BusError("a batch member has no members")


def _is_header_value(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


async def _handle_batch(batch: Delivery, message: RequestBatch, handler: Handler, *, queue: str, log: Any,
                        reply: Callable[[Delivery, BusMessage], Awaitable[None]] | None) -> None:
    """Split a batch into its members, run the handler on every member at once (so that a writer
    commits them together), then send the one :class:`BatchReply` and settle the batch.

    A member that cannot be decoded is answered 400 ``undecodable_command`` and dead-lettered alone;
    the others go on. The batch is acked once every member is acked or dead-lettered, and requeued
    (whole) if a member asked for it.
    """
    members: list[BatchMember] = []
    for raw in message.members:
        member = BatchMember(batch, raw if isinstance(raw, dict) else {"body": raw}, queue)
        members.append(member)
        with bound_trace(member.trace_id or _fresh_trace(), queue=queue):
            try:
                if not isinstance(raw, dict):
                    raise ProtocolDecodeError("a batch member is not a JSON object")
                member.message = decode_message(member.type_name, member.body)
            except ProtocolDecodeError as e:
                log.warning("bus.undecodable", queue=queue, error=str(e), batch_member=True)
                if reply is not None and member.reply_to:
                    await _answer_undecodable(member, str(e), reply, log)
                await _dead_letter(member, str(e), log)
    await asyncio.gather(*(_run_member(m, handler, queue=queue, log=log) for m in members if not m.settled))
    answers = [m.answer for m in members if m.answer is not None]
    if reply is not None and batch.reply_to and answers:
        try:
            await reply(batch, BatchReply(answers=answers))
        except BusError as e:
            # Nothing is lost: the requesters time out ("outcome unknown") and retry with their tokens.
            log.warning("bus.batch_reply_failed", queue=queue, error=str(e))
    if any(m.requeue for m in members):
        await batch.nack(requeue=True)
    else:
        await batch.ack()


async def _run_member(member: BatchMember, handler: Handler, *, queue: str, log: Any) -> None:
    with bound_trace(member.trace_id or _fresh_trace(), queue=queue):
        await _run_handler(member, member.type_name, handler, queue=queue, log=log)
        if not member.settled:
            await member.ack()


async def _answer_undecodable(delivery: Delivery, reason: str,
                              reply: Callable[[Delivery, BusMessage], Awaitable[None]], log: Any) -> None:
    try:
        await reply(delivery, ErrorReply(
            status=400, code="undecodable_command", message=f"The receiving actor could not decode the command: {reason}",
            how_to_proceed="The sender and the receiver disagree about the message format; upgrade the older one."))
    except BusError as e:
        log.warning("bus.undecodable_reply_failed", error=str(e))  # the requester times out instead


async def _dead_letter(delivery: Delivery, reason: str, log: Any) -> None:
    try:
        await delivery.dead_letter(reason)
    except BusError as e:
        # The backend gave the message back instead (it must never be lost): it comes again later.
        log.error("bus.dead_letter_failed", reason=reason, error=str(e))


@dataclass(frozen=True, slots=True)
class RawMessage:
    """A message as it sits in a queue, undecoded: what ``fetch_raw`` returns (diagnostics, tests)."""

    exchange: str
    routing_key: str
    type_name: str | None
    body: bytes
    headers: dict[str, HeaderValue]
    redelivered: bool


class ReplyDelivery(Delivery):
    """A reply handed back by :meth:`Bus.request`: nothing to settle (direct reply-to is no-ack)."""

    def __init__(self, message: BusMessage, *, exchange: str, routing_key: str,
                 headers: dict[str, HeaderValue], message_id: str | None,
                 correlation_id: str | None) -> None:
        super().__init__()
        self.message = message
        self.exchange = exchange
        self.routing_key = routing_key
        self.headers = headers
        self.message_id = message_id
        self.correlation_id = correlation_id
        self.reply_to = None
        self.redelivered = False
        self.delivery_count = 1
        self.settled = True

    async def ack(self) -> None:
        """Nothing to do: replies are not acknowledged."""

    async def nack(self, requeue: bool = True) -> None:
        """Nothing to do: replies are not acknowledged."""

    async def dead_letter(self, reason: str) -> None:
        """Nothing to do: a reply has no queue to be dead-lettered from."""

    async def dead_letter_member(self, type_name: str | None, body: bytes,
                                 headers: Mapping[str, HeaderValue]) -> None:
        """Nothing to do: a reply carries no batch members."""


class PendingRequests:
    """Requests waiting for their reply, by correlation id; bounded.

    Args:
        limit: most requests waiting at once; one more raises BusUnavailable instead of queueing.
    """

    def __init__(self, limit: int = DEFAULT_MAX_PENDING_REQUESTS) -> None:
        self.limit = limit
        self._waiting: dict[str, asyncio.Future[ReplyDelivery]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, correlation_id: str) -> asyncio.Future[ReplyDelivery]:
        """Register a request; the returned future gets its reply."""
        if len(self._waiting) >= self.limit:
            raise BusUnavailable(f"{self.limit} requests already wait for replies; refusing one more")
        future: asyncio.Future[ReplyDelivery] = asyncio.get_running_loop().create_future()
        self._waiting[correlation_id] = future
        return future

    def discard(self, correlation_id: str) -> None:
        """Forget a request (answered, timed out or cancelled)."""
        self._waiting.pop(correlation_id, None)

    def resolve(self, correlation_id: str | None, make: Any) -> bool:
        """Complete the request ``correlation_id`` with ``make()`` (a ReplyDelivery, or raise).

        Returns False when nobody waits for it any more (a late reply is dropped, as on RabbitMQ).
        """
        future = self._waiting.get(correlation_id or "")
        if future is None or future.done():
            return False
        try:
            future.set_result(make())
        except ProtocolDecodeError as e:
            future.set_exception(e)
        return True

    def fail_all(self, error: BaseException) -> None:
        """Fail every waiting request (the bus is closing)."""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()
