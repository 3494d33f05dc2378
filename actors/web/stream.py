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
Filters: ``types`` (comma-separated event types), ``conversation`` (id), ``kinds`` (comma-separated
message kinds, any of; applies to events that carry a message).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from aiohttp import web

from actors.history import Change, changes_after, head_sequence
from actors.web.context import NODE
from actors.web.hub import Item, NotificationHub, Subscription, sse_frame
from infra.db.pool import Target
from infra.logs import get_logger
from protocol.corpus import KINDS
from protocol.errors import ServiceUnavailable
from protocol.query import Query
from protocol.representations import EVENT_TYPES

log = get_logger("toastmachine.actors.web.stream")

HUB: web.AppKey[NotificationHub] = web.AppKey("hub", NotificationHub)
#: Seconds one frame may take to reach a client before the client counts as stuck.
WRITE_TIMEOUT = 10.0
#: Most live changes one socket write carries when a stream has fallen behind.
LIVE_BATCH = 256
#: Times a stream restarts its catch-up because live events overflowed meanwhile.
MAX_CATCH_UPS = 5
_PARAMS = ("after", "types", "conversation", "kinds")
#: A sequence on the wire: plain ASCII decimal digits (str.isdigit would let "²" through).

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

    def match(self, change: Change) -> bool:
        if self.types is not None and change.type not in self.types:
            return False
        if self.conversation is None and self.kinds is None:
            return True
        data = orjson.loads(change.event)["data"]
        if self.conversation is not None and _conversation_of(data) != self.conversation:
            return False
        if self.kinds is not None:
            message = data.get("message")
            if message is None or not self.kinds.intersection(message.get("kinds", ())):
                return False
        return True


def _conversation_of(data: dict) -> str | None:
    for key in ("message", "conversation"):
        if key in data:
            value = data[key].get("conversation_id") or data[key].get("id")
            return str(value) if value is not None else None
    return None  # relationships and retractions are matched by type, not by conversation


def _parse(request: web.Request) -> tuple[int | None, _Filters]:
    q = Query(request.query, _PARAMS)
    after = q.sequence("after")
    if after is None and "Last-Event-ID" in request.headers:
        after = Query({"Last-Event-ID": request.headers["Last-Event-ID"].strip()}, ("Last-Event-ID",)
                      ).sequence("Last-Event-ID")
    return after, _Filters(q.choices("types", EVENT_TYPES), q.uuid("conversation"), q.choices("kinds", KINDS))


class _Stream:
    """One client's stream: sends each sequence above ``last`` once, in order."""

    def __init__(self, response: web.StreamResponse, filters: _Filters, last: int) -> None:
        self.response = response
        self.filters = filters
        self.last = last
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
            if self.filters.match(change):
                out.append(frame)
        if out:
            await self.write(b"".join(out))

    async def error(self, code: str) -> None:
        message, how = _ERRORS[code]
        body = orjson.dumps({"schema_version": 1, "error": {"code": code, "message": message,
                                                             "how_to_proceed": how}}).decode()
        try:
            async with asyncio.timeout(1.0):  # best effort: a stuck client gets no more time
                await self.response.write(f"event: stream-error\ndata: {body}\n\n".encode())
        except (TimeoutError, ConnectionError, RuntimeError):
            pass


async def stream(request: web.Request) -> web.StreamResponse:
    """``GET /corpus/stream``."""
    node = request.app[NODE]
    if node.identity_error is not None:
        raise ServiceUnavailable("This node's corpus identity does not match its database.",
                                 code="lineage_unavailable",
                                 how_to_proceed="Follow another node, or retry once the operator fixed it.")
    after, filters = _parse(request)
    hub = request.app[HUB]
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-store",
        "X-Accel-Buffering": "no", "Connection": "keep-alive"})
    await response.prepare(request)
    out = _Stream(response, filters, after if after is not None else 0)
    try:
        await out.send("retry: 3000\n\n")
        for _ in range(MAX_CATCH_UPS):
            async with hub.subscribe() as sub:
                out.sub = sub
                sub.on_stuck = functools.partial(_abort, request)
                if after is None:
                    out.last = after = await head_sequence(node.db)
                await _catch_up(node.db, out)
                if sub.overflowed:
                    continue  # too much arrived meanwhile: catch up again from the history
                await out.send(f"event: ready\ndata: {orjson.dumps({'sequence': out.last}).decode()}\n\n")
                await _live(sub, out)
                if sub.overflowed:
                    await out.error("slow_consumer")
                return response
        await out.error("slow_consumer")
    except ConnectionError:
        log.info("stream.client_gone", last=out.last)  # nothing to answer: the client left
    except asyncio.CancelledError:
        raise  # the node is stopping
    except TimeoutError:
        log.info("stream.client_stuck", last=out.last)
        await out.error("slow_consumer")
    except Exception:
        log.exception("stream.failed", last=out.last)
        await out.error("internal_error")
    return response


async def _catch_up(db: Target, out: _Stream) -> None:
    while True:
        page = await changes_after(db, out.last)
        if not page:
            return
        for start in range(0, len(page), LIVE_BATCH):
            await out.changes([(c, sse_frame(c)) for c in page[start:start + LIVE_BATCH]])


async def _live(sub: Subscription, out: _Stream) -> None:
    while True:
        items = await sub.take(LIVE_BATCH)
        if items is None:
            return
        await out.changes(items)


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
    # Runs before aiohttp waits for handlers: open streams end now instead of holding shutdown.
    await app[HUB].close()


def add_routes(app: web.Application) -> None:
    """The stream route, with this node's hub started and stopped with the app."""
    node = app[NODE]
    app[HUB] = NotificationHub(node.bus, node.db, node_id=node.settings.node_id,
                               scope=node.identity.scope if node.identity is not None else None,
                               heartbeat=node.settings.stream_heartbeat)
    app.cleanup_ctx.append(_hub_context)
    app.on_shutdown.append(_end_streams)
    app.router.add_get("/corpus/stream", stream)
