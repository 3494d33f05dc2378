"""``GET /corpus/stream``: the change history as Server-Sent Events, live, with catch-up.

Resume from ``after`` (wins) or ``Last-Event-ID``; with neither, start at the current head (only
new changes). The hand-over from catch-up to live has neither a gap nor a duplicate because the
stream subscribes to the node's hub *before* it reads the history: every change committed later is
in the subscription, every change committed earlier is in the history, and a change in both is sent
once (the stream only ever sends sequences above the last one it sent).

Frames: ``retry: 3000`` first; each change as ``id: <sequence>`` / ``event: <type>`` /
``data: <envelope>``; one ``ready`` event (no id) when catch-up is done; a ``: heartbeat`` comment
every ``TOASTMACHINE_STREAM_HEARTBEAT`` seconds (15); on a failure or when the client cannot keep up, one terminal ``stream-error`` event with
fixed public text telling the client to resume from its last applied sequence, then the end.
Filters: ``types`` (comma-separated event types), ``conversation`` (id: its conversation and message
events, and the relationship events whose source message is in it), ``kinds`` (comma-separated
message kinds, any of; applies to events that carry a message). ``types`` and ``kinds`` are as strict
as ``/messages?kinds=``: an empty, unknown or repeated value is a 400 naming the parameter.

Refused before the stream starts: ``after`` (or ``Last-Event-ID``) beyond the current head (400: the
sequence is not from this history, or the client computed it); a ``lineage`` (parameter or
``X-Corpus-Lineage`` header, which must agree) that is not this node's (409, like the export).

Bounded: catch-up reads the history in pages of at most :data:`CATCH_UP_ROWS` changes and
:data:`CATCH_UP_BYTES` of event text, and reads the next page only once the previous one was handed
to the socket (a client that stops reading stops the reads), so a stream holds a small constant
whatever the history's length. A node serves at most ``TOASTMACHINE_STREAM_MAX`` streams, and one
client address at most ``TOASTMACHINE_STREAM_MAX_PER_CLIENT``; beyond either, 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NoReturn

import orjson
from aiohttp import web

from actors.history import Change, bounded_page, conversation_of, head_sequence
from actors.hub import Batch, Item, NotificationHub, Subscription, sse_frame
from actors.web.context import NODE
from actors.web.export import check_lineage, identity_headers, node_identity
from actors.web.slots import ClientSlots
from infra.db.pool import Target
from infra.http import negotiate, single_header
from infra.logs import get_logger
from infra.metrics import Metrics
from protocol.errors import NotAcceptable, ServiceUnavailable
from protocol.query import Query, check_within_head
from protocol.representations import EVENT_TYPES, RELATIONSHIP_ASSERTED, RELATIONSHIP_RETRACTED

log = get_logger("toastmachine.actors.web.stream")

HUB: web.AppKey[NotificationHub] = web.AppKey("hub", NotificationHub)
STREAM_SLOTS: web.AppKey[ClientSlots] = web.AppKey("stream_slots", ClientSlots)
LOOKUP: web.AppKey[ConversationLookup] = web.AppKey("conversation_lookup")
#: Seconds one frame may take to reach a client before the client counts as stuck.
WRITE_TIMEOUT = 10.0
#: Seconds an ending stream's last bytes (the chunked terminator after everything still queued)
#: may take to drain before the connection is dropped (see _finish).
FINISH_TIMEOUT = 2.0
#: Most live changes one socket write carries when a stream has fallen behind.
LIVE_BATCH = 256
#: Bytes a live stream's socket may have waiting in its transport for the hub to still write a batch
#: to it directly; beyond, the batch goes through the stream's task, whose write waits for the socket
#: to drain (aiohttp's own threshold for that wait is 64 KiB written since the last drain).
DIRECT_WRITE_LIMIT = 64 * 1024
#: Times a stream restarts its catch-up because live events overflowed meanwhile.
MAX_CATCH_UPS = 5
#: Most changes, and most bytes of event text, one catch-up page holds (always at least one change).
CATCH_UP_ROWS = 64
CATCH_UP_BYTES = 64 * 1024
#: Seconds a client refused by a stream cap is told to wait before it retries.
RETRY_AFTER = 5
_PARAMS = ("after", "types", "conversation", "kinds", "lineage")
_RELATIONSHIP_EVENTS = frozenset({RELATIONSHIP_ASSERTED, RELATIONSHIP_RETRACTED})

_RESUME = ("Keep the sequence of the last change you applied; reconnect with Last-Event-ID (or after=) set to "
           "it, or catch up through /corpus/changes.jsonl?after=<it> first.")
_ERRORS = {
    "slow_consumer": ("The stream was closed because this client did not keep up.", _RESUME),
    "internal_error": ("Unable to read corpus synchronization data.",
                       _RESUME + " If failures persist, report them to the node operator."),
}


@dataclass(frozen=True, slots=True)
class _Filters:
    types: frozenset[str] | None
    conversation: str | None
    kinds: frozenset[str] | None

    @property
    def unfiltered(self) -> bool:
        """Whether every change passes."""
        return self.types is None and self.conversation is None and self.kinds is None

    def match(self, change: Change) -> bool | None:
        """Whether ``change`` passes; None when only its conversation decides and the change
        does not name it (a relationship event off the bus: see :class:`ConversationLookup`)."""
        if self.types is not None and change.type not in self.types:
            return False
        if self.conversation is None and self.kinds is None:
            return True
        data = orjson.loads(change.event)["data"]
        if self.kinds is not None:
            message = data.get("message")
            if message is None or not self.kinds.intersection(message.get("kinds", ())):
                return False
        if self.conversation is not None:
            conversation = change.conversation_id or _conversation_of(data)
            if conversation is None:
                return None if change.type in _RELATIONSHIP_EVENTS else False
            return conversation == self.conversation
        return True


def _conversation_of(data: dict) -> str | None:
    for key in ("message", "conversation"):
        if key in data:
            value = data[key].get("conversation_id") or data[key].get("id")
            return str(value) if value is not None else None
    return None  # a relationship event names messages, not their conversation


class ConversationLookup:
    """The conversation of a relationship event that came off the bus, read from the history once
    per change and node however many streams ask (their envelopes name messages, not conversations).

    Remembers the last ``size`` answers; concurrent askers for the same change share one query.
    """

    def __init__(self, db: Target, size: int = 4096) -> None:
        self._db = db
        self._size = size
        self._known: collections.OrderedDict[int, str | None] = collections.OrderedDict()
        self._pending: dict[int, asyncio.Future[bool]] = {}

    async def get(self, sequence: int) -> str | None:
        """The conversation of the change at ``sequence``."""
        while True:
            if sequence in self._known:
                return self._known[sequence]
            pending = self._pending.get(sequence)
            if pending is None:
                break
            await asyncio.shield(pending)  # True: answered (loop to read it); False: ask ourselves
        done = self._pending[sequence] = asyncio.get_running_loop().create_future()
        answered = False
        try:
            value = await conversation_of(self._db, sequence)
            self._known[sequence] = value
            if len(self._known) > self._size:
                self._known.popitem(last=False)
            answered = True
            return value
        finally:
            del self._pending[sequence]
            done.set_result(answered)


def stream_slots(total: int, per_client: int, metrics: Metrics | None = None) -> ClientSlots:
    """The node's caps on concurrent streams: ``total`` in all, ``per_client`` per client address;
    beyond either, 503 ``too_many_streams`` at once (counted in ``stream_refused`` by cap)."""

    def refuse(cap: str) -> NoReturn:
        if metrics is not None:
            metrics.stream_refused.labels(cap).inc()
        message = (f"This node serves its maximum of {total} streams." if cap == "node" else
                   f"This client address already has {per_client} open streams on this node.")
        raise ServiceUnavailable(
            message, code="too_many_streams", headers={"Retry-After": str(RETRY_AFTER)},
            extra={"retry_after": RETRY_AFTER},
            how_to_proceed=f"Close streams you no longer read, or retry after {RETRY_AFTER} seconds "
                           "(Retry-After), resuming with Last-Event-ID; another node of this corpus may have room.")

    return ClientSlots(total, per_client, refuse)


def _parse(request: web.Request) -> tuple[int | None, str, _Filters]:
    """(resume position, the field it came from, the filters)."""
    q = Query(request.query, _PARAMS)
    after, field = q.sequence("after"), "after"
    resume = single_header(request, "Last-Event-ID") if after is None else None
    if resume is not None:
        field = "Last-Event-ID"
        after = Query({field: resume.strip()}, (field,)).sequence(field)
    types, kinds = q.members("types", EVENT_TYPES, "event type"), q.kinds()
    return after, field, _Filters(None if types is None else frozenset(types), q.uuid("conversation"),
                                  None if kinds is None else frozenset(kinds))


class _Stream:
    """One client's stream: sends each sequence above ``last`` once, in order."""

    def __init__(self, response: web.StreamResponse, filters: _Filters, last: int,
                 lookup: ConversationLookup, transport: asyncio.Transport | None = None) -> None:
        self.response = response
        #: The connection's transport, for :meth:`write_now` (None: every write goes through aiohttp).
        self.transport = transport
        #: Whether the body is in chunked transfer coding, as aiohttp chose it when the response was
        #: prepared (HTTP/1.1 without a length; an HTTP/1.0 body just ends with the connection).
        self.chunked = response.headers.get("Transfer-Encoding", "").lower() == "chunked"
        self.filters = filters
        self.last = last
        self.lookup = lookup
        #: The hub subscription, once there is one: its watchdog bounds how long a write may block.
        self.sub: Subscription | None = None

    async def send(self, text: str) -> None:
        await self.write(text.encode())

    async def write(self, data: bytes) -> None:
        sub = self.sub
        if sub is None:
            async with asyncio.timeout(WRITE_TIMEOUT):
                await self.response.write(data)
            return
        # No timer per write: the hub's ticker cuts off a write blocked for a whole heartbeat interval.
        sub.busy = True
        sub.writes += 1
        try:
            await self.response.write(data)
        finally:
            sub.busy = False

    async def changes(self, items: list[Item]) -> None:
        """Send the changes not sent yet (and heartbeats), in one socket write: a stream that lags
        behind catches up in few writes instead of one per change."""
        out: list[bytes] = []
        for change, frame in items:
            if change is None:
                out.append(frame)  # a heartbeat
                continue
            if change.sequence <= self.last:
                continue
            self.last = change.sequence
            verdict = self.filters.match(change)
            if verdict is None:
                verdict = await self.lookup.get(change.sequence) == self.filters.conversation
            if verdict:
                out.append(frame)
        if out:
            await self.write(b"".join(out))

    def write_now(self, batch: Batch) -> bool:
        """The subscription's sink: write ``batch``'s frames for this stream to its socket at once,
        in the hub's fan-out pass (no task wake-up, no coroutine per stream), and answer True; or
        answer False, having changed nothing, when the batch must go through :meth:`changes` (the
        socket is backed up or gone, the batch is more than :data:`LIVE_BATCH` changes, or a filter
        needs a lookup).

        Written on the transport, in HTTP/1.1 chunked framing when the response is chunked (as
        aiohttp's own writer frames each ``write``): the response is prepared, its headers sent, and
        nothing else writes to it meanwhile (the stream's task is parked in ``take``)."""
        transport = self.transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size() > DIRECT_WRITE_LIMIT:
            return False
        if len(batch.items) > LIVE_BATCH:
            # A big batch (a hole filled from the history, a node far behind) goes through the
            # task, LIVE_BATCH changes per write with aiohttp's drain between: the transport never
            # holds more than what the task path would let it.
            return False
        last = self.last
        if self.filters.unfiltered and batch.first > last:
            data = batch.joined()  # the whole batch, joined once for every stream like this one
            last = batch.last
        else:
            out: list[bytes] = []
            for change, frame in batch.items:
                if change is None:
                    out.append(frame)  # a heartbeat
                    continue
                if change.sequence <= last:
                    continue
                verdict = self.filters.match(change)
                if verdict is None:
                    return False  # only the history knows: the task asks (ConversationLookup)
                last = change.sequence
                if verdict:
                    out.append(frame)
            data = b"".join(out)
        self.last = last
        if data:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        return True

    async def error(self, code: str) -> None:
        message, how = _ERRORS[code]
        body = orjson.dumps({"schema_version": 1, "error": {"code": code, "message": message,
                                                             "how_to_proceed": how}}).decode()
        try:
            async with asyncio.timeout(1.0):  # best effort: a stuck client gets no more time
                await self.response.write(f"event: stream-error\ndata: {body}\n\n".encode())
        except (TimeoutError, ConnectionError, RuntimeError):
            pass


#: The one media type the stream answers.
EVENT_STREAM = "text/event-stream"


async def stream(request: web.Request) -> web.StreamResponse:
    """``GET /corpus/stream``."""
    node = request.app[NODE]
    corpus_id, lineage = node_identity(request)
    after, field, filters = _parse(request)
    if negotiate(request.headers.get("Accept"), (EVENT_STREAM,)) is None:
        raise NotAcceptable(f"This route answers only {EVENT_STREAM}.",
                            how_to_proceed=f"Send 'Accept: {EVENT_STREAM}' (as EventSource does) or */*; "
                                           "for the history as JSON lines, use /corpus/changes.jsonl.",
                            headers={"Vary": "Accept"})
    check_lineage(request, corpus_id, lineage)
    if request.method == "HEAD":
        # The headers a GET would start with, and no body (RFC 9110): no slot taken, nothing followed.
        headers_only = web.StreamResponse(headers=_stream_headers(corpus_id, lineage))
        await headers_only.prepare(request)
        return headers_only
    async with request.app[STREAM_SLOTS].hold(request):
        if after is not None:
            check_within_head(field, after, await head_sequence(node.db))
        return await _serve(request, after, filters, corpus_id, lineage)


def _stream_headers(corpus_id: str, lineage: str) -> dict[str, str]:
    """The headers of a stream's answer (GET and HEAD)."""
    return {**identity_headers(corpus_id, lineage), "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-store", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


async def _serve(request: web.Request, after: int | None, filters: _Filters, corpus_id: str,
                 lineage: str) -> web.StreamResponse:
    node = request.app[NODE]
    hub = request.app[HUB]
    response = web.StreamResponse(headers=_stream_headers(corpus_id, lineage))
    await response.prepare(request)
    out = _Stream(response, filters, after if after is not None else 0, request.app[LOOKUP],
                  transport=request.transport if not response.compression else None)
    try:
        await out.send("retry: 3000\n\n")
        for _ in range(MAX_CATCH_UPS):
            async with hub.subscribe(owner=request.app) as sub:
                out.sub = sub
                sub.on_stuck = functools.partial(_abort, request)
                if after is None:
                    out.last = after = await head_sequence(node.db)
                await _catch_up(node.db, out, node.metrics)
                if sub.overflowed:
                    continue  # too much arrived meanwhile: catch up again from the history
                if sub.closed:
                    break  # the node is stopping: the client resumes from what it got
                await out.send(f"event: ready\ndata: {orjson.dumps({'sequence': out.last}).decode()}\n\n")
                await _live(sub, out)
                if sub.overflowed:
                    await out.error("slow_consumer")
                break
        else:
            await out.error("slow_consumer")
    except ConnectionError:
        log.info("stream.client_gone", last=out.last)  # nothing to answer: the client left
        return response
    except asyncio.CancelledError:
        raise  # the client left (aiohttp cancels the handler: see infra/http_server.py) or the node is stopping
    except TimeoutError:
        log.info("stream.client_stuck", last=out.last)
        await out.error("slow_consumer")
    except Exception:
        log.exception("stream.failed", last=out.last)
        await out.error("internal_error")
    await _finish(request, response)
    return response


async def _finish(request: web.Request, response: web.StreamResponse) -> None:
    """End the response within FINISH_TIMEOUT, else drop the connection.

    Done here rather than left to aiohttp after the handler returns, whose final write waits for
    the socket to drain with no bound: a client that stopped reading would hold its connection
    (and the memory queued for it) for good, with its stream slot already given back. Dropping it
    loses nothing: the client resumes from the last change it applied.
    """
    try:
        async with asyncio.timeout(FINISH_TIMEOUT):
            await response.write_eof()
    except (TimeoutError, ConnectionError, RuntimeError):
        _abort(request)


async def _catch_up(db: Target, out: _Stream, metrics: Metrics) -> None:
    # One bounded page at a time, and the next one only after this one was written: the write
    # waits for the socket to drain once the transport holds more than aiohttp's 64 KiB, so a
    # client that stops reading stops the reads (and its stream is cut off by the hub's watchdog).
    while True:
        if out.sub is not None and out.sub.closed and not out.sub.overflowed:
            return  # the node is stopping: no more of the history for this stream
        page = await bounded_page(db, out.last, max_rows=CATCH_UP_ROWS, max_bytes=CATCH_UP_BYTES)
        metrics.stream_pages.inc()
        metrics.stream_rows.inc(len(page))
        if not page:
            return
        await out.changes([(c, sse_frame(c)) for c in page])


async def _live(sub: Subscription, out: _Stream) -> None:
    # While this task is parked in take(), the hub writes batches through the sink itself; what it
    # could not write (a backed-up socket, a filter needing a lookup) and heartbeats come here.
    # The sink goes with the loop: once this returns, the response may be finished.
    sub.sink = out.write_now
    try:
        while True:
            items = await sub.take(LIVE_BATCH)
            if items is None:
                return
            await out.changes(items)
    finally:
        sub.sink = None


def _abort(request: web.Request) -> None:
    """Drop a client that stopped reading: its blocked write then fails with a connection error."""
    log.info("stream.client_stuck")
    if request.transport is not None:
        request.transport.abort()


async def _hub_context(app: web.Application) -> AsyncIterator[None]:
    hub = app[HUB]
    await hub.start()
    yield
    await hub.close()


async def _end_streams(app: web.Application) -> None:
    # Runs before aiohttp waits for handlers: open streams end now instead of holding shutdown
    # (only this app's: under ``up`` the MCP front follows the same hub).
    app[HUB].end(app)


def add_routes(app: web.Application) -> None:
    """The stream route, with this node's hub started and stopped with the app."""
    node = app[NODE]
    settings = node.settings
    app[STREAM_SLOTS] = stream_slots(settings.stream_max, settings.stream_max_per_client, node.metrics)
    app[LOOKUP] = ConversationLookup(node.db)
    app[HUB] = node.notification_hub()
    app.cleanup_ctx.append(_hub_context)
    app.on_shutdown.append(_end_streams)
    app.router.add_get("/corpus/stream", stream)
