"""The requester side of the bus's batch form, shared by both backends.

:class:`RequestBatcher` is what :meth:`~infra.bus.base.Bus.request` runs on. A request without a
batch key is published as itself. Requests with the same batch key, exchange and headers (the
deadline and trace id aside) made in one turn of the event loop join one open batch; the batch is
published at the start of the next turn (``loop.call_soon``), or at once when the next member would
pass ``max_count`` members or ``max_bytes`` bytes, as ONE :class:`~protocol.messages.RequestBatch`
carrying every member's own correlation id, routing key, headers and encoded body. A batch of one is
sent as the member itself, so a lone request costs what it always did.

Every member keeps its own pending entry, deadline and error: a publish error reaches every member
of that batch; each waits for its own answer only, up to its own deadline. :func:`resolve_reply`
turns one incoming reply into the answers of the requests waiting for it: a
:class:`~protocol.messages.BatchReply` answers each member by its correlation id; any other reply
to a batch (e.g. an older consumer's ``undecodable_command``) answers all its members alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from infra.bus.base import DEADLINE_HEADER, BusStats, Headers, HeaderValue, deadline_header
from infra.bus.policy import PendingRequests, ReplyDelivery, outgoing_headers
from infra.logs import TRACE_HEADER, get_logger
from protocol.errors import ProtocolDecodeError, RequestTimeout
from protocol.messages import BatchReply, RequestBatch, decode_message, encode_message

log = get_logger("toastmachine.bus.batch")

#: Most requests in one batch message.
DEFAULT_MAX_BATCH_COUNT = 64
#: Most bytes of member bodies in one batch message (a larger request goes alone).
DEFAULT_MAX_BATCH_BYTES = 1024 * 1024

#: Seconds a member whose deadline bounds its batch's publish waits past it for that publish's outcome.
PUBLISH_GRACE = 1.0

# Headers each member carries itself; the others must agree for requests to share a batch.
_OWN_HEADERS = (DEADLINE_HEADER, TRACE_HEADER)


class SendRequest(Protocol):
    """A backend's publish of one request message (mandatory, with its reply address)."""

    def __call__(self, exchange: str, routing_key: str, type_name: str, body: bytes,
                 headers: dict[str, HeaderValue], correlation_id: str, timeout: float) -> Awaitable[None]: ...


def _member_text(body: bytes) -> str | None:
    """``body`` as the text a batch embeds, or None when it is not UTF-8."""
    try:
        return body.decode()
    except UnicodeDecodeError:
        return None


@dataclass(slots=True)
class _Member:
    routing_key: str
    type_name: str
    body: bytes  # the encoded body: sent as it is when the member goes alone
    text: str  # the same, as the JSON text a batch embeds
    headers: dict[str, HeaderValue]
    correlation_id: str
    deadline: float  # loop time


@dataclass(slots=True)
class _OpenBatch:
    exchange: str
    batch_key: str
    shared: dict[str, HeaderValue]
    sent: asyncio.Future[None]
    members: list[_Member] = field(default_factory=list)
    size: int = 0
    #: The member with the latest deadline: its deadline bounds the publish, and the batch carries it.
    latest: _Member | None = None


class RequestBatcher:
    """Coalesces the batchable requests of one event-loop turn (see the module docstring).

    Args:
        send: the backend's publish of one request.
        pending: the backend's pending requests (bounded): every member has its own entry.
        max_count: most members in one batch.
        max_bytes: most member body bytes in one batch.
        stats: the bus's counters (``request_batches``, ``batched_requests``).
    """

    def __init__(self, send: SendRequest, pending: PendingRequests, stats: BusStats, *,
                 max_count: int = DEFAULT_MAX_BATCH_COUNT, max_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError("a batch holds at least one request of at least one byte")
        self._send = send
        self._pending = pending
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._open: dict[tuple[Any, ...], _OpenBatch] = {}
        # batch correlation id -> its members' ids, for a reply that answers the batch as a whole.
        # Entries go with the reply or the latest member's deadline, so this is bounded by ``pending``.
        self._batches: dict[str, list[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stats = stats

    async def request(self, exchange: str, routing_key: str, type_name: str, body: bytes, *, timeout: float,
                      headers: Headers | None = None, batch_key: str | None = None) -> ReplyDelivery:
        """Publish one request (alone or in a batch) and wait up to ``timeout`` for its own reply."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        all_headers = outgoing_headers({**deadline_header(timeout), **(headers or {})})
        correlation_id = uuid.uuid4().hex
        future = self._pending.add(correlation_id)
        text = _member_text(body) if batch_key is not None and len(body) <= self.max_bytes else None
        try:
            if text is None:
                # Alone: unbatched, larger than a batch may carry, or not UTF-8 (a raw diagnostic
                # body), which a batch cannot embed and which must fail no other request.
                await self._send(exchange, routing_key, type_name, body, all_headers, correlation_id, timeout)
            else:
                batch = self._join(exchange, batch_key or "", _Member(routing_key, type_name, body, text, all_headers,
                                                                      correlation_id, deadline))
                await self._published(batch, deadline, type_name, exchange, timeout)
            # A reply lost to a reconnect is never seen: the request waits for its own deadline.
            try:
                async with asyncio.timeout_at(deadline):
                    return await future
            except TimeoutError:
                raise RequestTimeout(f"no reply to {type_name!r} on {exchange!r} within {timeout}s; "
                                     "the outcome is unknown") from None
        finally:
            self._pending.discard(correlation_id)

    @staticmethod
    async def _published(batch: _OpenBatch, deadline: float, type_name: str, exchange: str, timeout: float) -> None:
        """Wait for ``batch``'s publish, up to the member's own ``deadline``: past it, with the publish
        still retrying for a later member, the outcome is unknown (it may yet be published). The
        publish gives up at the latest member's deadline; a member whose deadline that is waits for
        its outcome, so a broker that stayed away is its error (503), not an unknown outcome."""
        # Shielded: one requester giving up must not cancel the publish of the others.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(batch.sent)
            return
        assert batch.latest is not None  # it holds this member at least
        if batch.latest.deadline <= deadline + PUBLISH_GRACE:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PUBLISH_GRACE):
                    await asyncio.shield(batch.sent)  # its error, if it failed, is the answer
                return
        raise RequestTimeout(f"{type_name!r} was not yet published to {exchange!r} within {timeout}s; "
                             "the outcome is unknown")

    def _join(self, exchange: str, batch_key: str, member: _Member) -> _OpenBatch:
        shared = {k: v for k, v in member.headers.items() if k not in _OWN_HEADERS}
        key = (exchange, batch_key, tuple(sorted(shared.items(), key=lambda kv: kv[0])))
        batch = self._open.get(key)
        if batch is not None and (len(batch.members) >= self.max_count
                                  or batch.size + len(member.body) > self.max_bytes):
            self._flush(key)
            batch = None
        if batch is None:
            loop = asyncio.get_running_loop()
            sent: asyncio.Future[None] = loop.create_future()
            # Nobody may be left to read a publish error (every member gave up): read it here.
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())
            batch = _OpenBatch(exchange, batch_key, shared, sent)
            self._open[key] = batch
            loop.call_soon(self._flush, key, batch)
        batch.members.append(member)
        batch.size += len(member.body)
        if batch.latest is None or member.deadline > batch.latest.deadline:
            batch.latest = member
        return batch

    def _flush(self, key: tuple[Any, ...], expected: _OpenBatch | None = None) -> None:
        batch = self._open.get(key)
        if batch is None or (expected is not None and batch is not expected):
            return  # already sent (it filled up) and a new one opened since
        del self._open[key]
        task = asyncio.get_running_loop().create_task(self._publish(batch), name="bus-request-batch")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, batch: _OpenBatch) -> None:
        loop = asyncio.get_running_loop()
        latest = batch.latest
        assert latest is not None  # a batch is opened for a member
        timeout = max(latest.deadline - loop.time(), 0.001)
        try:
            if len(batch.members) == 1:
                m = batch.members[0]
                await self._send(batch.exchange, m.routing_key, m.type_name, m.body, m.headers,
                                 m.correlation_id, timeout)
            else:
                type_name, body = encode_message(RequestBatch(members=[
                    {"correlation_id": m.correlation_id, "routing_key": m.routing_key, "type": m.type_name,
                     "body": m.text, "headers": m.headers} for m in batch.members]))
                # The batch's deadline is its latest member's: a consumer skips a member by its own.
                headers = {**batch.shared, DEADLINE_HEADER: latest.headers[DEADLINE_HEADER]}
                correlation_id = uuid.uuid4().hex
                self._batches[correlation_id] = [m.correlation_id for m in batch.members]
                loop.call_later(timeout, self._batches.pop, correlation_id, None)
                await self._send(batch.exchange, batch.batch_key, type_name, body, headers, correlation_id, timeout)
                self._stats.request_batches += 1
                self._stats.batched_requests += len(batch.members)
        except BaseException as e:
            if not batch.sent.done():
                batch.sent.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        batch.sent.set_result(None)

    def resolve_reply(self, type_name: str | None, body: bytes, headers: dict[str, HeaderValue], *,
                      exchange: str, routing_key: str, message_id: str | None,
                      correlation_id: str | None) -> int:
        """Hand one incoming reply to the request(s) waiting for it; returns how many it answered."""

        def delivery(answer_type: str | None, answer_body: bytes, answer_headers: dict[str, HeaderValue],
                     answer_id: str | None) -> Callable[[], ReplyDelivery]:
            return lambda: ReplyDelivery(decode_message(answer_type, answer_body), exchange=exchange,
                                         routing_key=routing_key, headers=answer_headers, message_id=message_id,
                                         correlation_id=answer_id)

        if type_name == BatchReply.TYPE:
            self._batches.pop(correlation_id or "", None)
            try:
                reply = decode_message(type_name, body)
            except ProtocolDecodeError as e:
                log.warning("bus.batch_reply_undecodable", error=str(e))  # its requesters time out
                return 0
            assert isinstance(reply, BatchReply)
            answered = 0
            for answer in reply.answers:
                if not isinstance(answer, Mapping) or not isinstance(answer.get("correlation_id"), str):
                    continue
                own = answer.get("headers")
                merged = {**headers, **(own if isinstance(own, dict) else {})}
                raw = answer.get("body")
                answer_body = raw.encode() if isinstance(raw, str) else b""
                answer_type = answer.get("type")
                answered += self._pending.resolve(
                    answer["correlation_id"],
                    delivery(answer_type if isinstance(answer_type, str) else None, answer_body, merged,
                             answer["correlation_id"]))
            return answered
        members = self._batches.pop(correlation_id or "", None)
        if members is None:
            return int(self._pending.resolve(correlation_id, delivery(type_name, body, headers, correlation_id)))
        return sum(self._pending.resolve(m, delivery(type_name, body, headers, m)) for m in members)
