"""Resource-updated notifications of the MCP front, fed by this node's notification hub.

Consumes: a subscription to this MCP node's own :class:`~actors.hub.NotificationHub` (its own NODE
queue bound on the internal ``tm.hub.<corpus_id>``, one change batch per publisher window; the hub
orders the changes and fills holes from the change history, so a change the queue dropped or a
reconnect lost still counts; it asks for no SSE frames, so the hub encodes none), and the stored guide's
version, read every ``guide_poll`` seconds (one primary-key lookup; the operator's CLI writes the
guide straight to the database, with no event).
Does: turns "something committed" into ``toastmachine://corpus`` updated (its head sequence moved)
and "the guide's version changed" into ``toastmachine://guide`` updated, and coalesces: "updated"
is a hint, so however many changes commit, each resource is announced at most once per
``min_interval`` seconds.
Emits: :class:`~mcp.shared.subscriptions.ResourceUpdated` on the SDK's
:class:`~mcp.server.subscriptions.SubscriptionBus`, the one fan-out for both protocol revisions:

- 2026-07-28: ``subscriptions/listen`` streams, served by the SDK's
  :class:`~mcp.server.subscriptions.ListenHandler` (behind a read-scope check), each with a bounded
  backlog (:data:`LISTEN_BACKLOG`; a stream whose client stopped reading is ended and the client
  listens again);
- 2025-11-25: sessions that sent ``resources/subscribe`` (:class:`LegacySubscriptions`), notified on
  their session's standalone stream. Each session holds at most one pending notification per
  resource and has at most one send in flight: a slow session coalesces, it never queues.

Notifications are hints, not history: a client recovers what changed with ``get_changes`` from the
last sequence it applied (the server instructions and the guide say so). Nothing here can lose a
change, because nothing here carries one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.session import ServerSession
from mcp.server.streamable_http import GET_STREAM_KEY
from mcp.server.subscriptions import ListenHandler, SubscriptionBus
from mcp.shared.exceptions import MCPError
from mcp.shared.subscriptions import ResourceUpdated, ServerEvent
from mcp_types import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    EmptyResult,
    SubscribeRequestParams,
    SubscriptionsListenRequestParams,
    SubscriptionsListenResult,
    UnsubscribeRequestParams,
)

from actors.guide import current_guide
from actors.hub import NotificationHub
from actors.mcp.grant_types import READ_SCOPE, Grant
from actors.mcp.resources import CORPUS_URI, GUIDE_URI
from infra.db.pool import UNAVAILABLE_ERRORS, Target
from infra.logs import get_logger

log = get_logger("toastmachine.actors.mcp.notify")

#: Least seconds between two announcements of one resource.
DEFAULT_MIN_INTERVAL = 1.0
#: Seconds between reads of the stored guide's version.
DEFAULT_GUIDE_POLL = 30.0
#: Listen streams, and separately subscribed 2025-11-25 sessions, one MCP node serves at once.
MAX_SUBSCRIBERS = 1024
#: Of those, what one agent may hold on one node (its subscribed 2025-11-25 sessions, and apart
#: from them its open listen streams), so that one agent cannot take every place
#: (``TOASTMACHINE_MCP_SUBSCRIPTIONS_PER_AGENT``).
PER_AGENT = 32
#: Events a listen stream may have waiting (at most one per resource per interval arrives).
LISTEN_BACKLOG = 32
#: Loop turns :meth:`LegacySubscriptions.stream_opened` waits for the SDK to register a new stream.
STREAM_OPEN_TRIES = 16
#: Changes taken from the hub subscription at once (only "was there one" matters).
_TAKE = 1000

#: The resources a client can subscribe to.
RESOURCES = frozenset({CORPUS_URI, GUIDE_URI})

_NO_READ = f"Subscribing to resources needs the {READ_SCOPE} scope, which this authorization lacks."


class ResourceNotifier:
    """Announces resource updates on ``bus`` from the hub's changes and the guide's version.

    Args:
        hub: this node's notification hub (started and closed by the notifier).
        bus: the MCP server's subscription bus.
        db: where the guide is read.
        min_interval: least seconds between two announcements of one resource.
        guide_poll: seconds between reads of the guide's version.
    """

    def __init__(self, hub: NotificationHub, bus: SubscriptionBus, db: Target, *,
                 min_interval: float = DEFAULT_MIN_INTERVAL, guide_poll: float = DEFAULT_GUIDE_POLL) -> None:
        self.hub = hub
        self.bus = bus
        self.db = db
        self.min_interval = min_interval
        self.guide_poll = guide_poll
        #: Resources to announce at the next send (a set: that is the coalescing).
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start the hub, then follow it and the guide."""
        await self.hub.start()
        self._tasks = [asyncio.create_task(self._follow(), name="mcp-notify-follow"),
                       asyncio.create_task(self._send(), name="mcp-notify-send"),
                       asyncio.create_task(self._watch_guide(), name="mcp-notify-guide")]

    async def close(self) -> None:
        """Stop announcing and close the hub (idempotent)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.hub.close()

    def mark(self, uri: str) -> None:
        """Announce ``uri`` at the next send (again and again until then: once)."""
        self._dirty.add(uri)
        self._wake.set()

    async def _follow(self) -> None:
        while True:
            async with self.hub.subscribe(frames=False, owner=self) as sub:
                while (items := await sub.take(_TAKE)) is not None:
                    if any(change is not None for change, _ in items):  # None: a heartbeat
                        self.mark(CORPUS_URI)
            # The hub cut us off (a hole it could not read, or a backlog past its bound): changes
            # may have committed unseen, and "updated" costs a client one read, so say it.
            log.info("mcp.notify.resubscribed", overflowed=sub.overflowed)
            self.mark(CORPUS_URI)

    async def _send(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            for uri in sorted(dirty):
                await self.bus.publish(ResourceUpdated(uri=uri))
            # The coalescing window: whatever commits meanwhile is one announcement at its end.
            await asyncio.sleep(self.min_interval)

    async def _watch_guide(self) -> None:
        version: int | None = None
        while True:
            try:
                current = (await current_guide(self.db)).version
            except UNAVAILABLE_ERRORS as e:
                log.warning("mcp.notify.guide_unreadable", error=type(e).__name__)
            except Exception as e:  # noqa: BLE001 - keep watching: a bad read must not end the notifications
                log.error("mcp.notify.guide_check_failed", error=type(e).__name__)
            else:
                if version is not None and current != version:
                    self.mark(GUIDE_URI)
                version = current
            await asyncio.sleep(self.guide_poll)


class _Session:
    """One subscribed 2025-11-25 session: its resources, what is pending, and its one sender."""

    __slots__ = ("agent_id", "pending", "sender", "session", "uris")

    def __init__(self, session: ServerSession, agent_id: str) -> None:
        self.session = session
        self.agent_id = agent_id
        self.uris: set[str] = set()
        self.pending: set[str] = set()
        self.sender: asyncio.Task[None] | None = None


class LegacySubscriptions:
    """``resources/subscribe`` / ``resources/unsubscribe`` for 2025-11-25 sessions, fed by ``bus``.

    A session is known by its ``Mcp-Session-Id``; its notifications go to its standalone stream
    (the GET stream the client keeps open). The transport would drop a notification sent while that
    stream is not open (the client opens it after the handshake, in the background, and again after
    a cut), so none is sent then: it stays pending (at most one per resource, so the buffer is
    bounded) and is sent when the stream opens (:meth:`stream_opened`, called by the ``/mcp``
    endpoint once the SDK answered the GET). A session that ended (the client's DELETE, the idle timeout) is forgotten at the next
    event, or when a new session needs its place: sends to an ended session are dropped without an
    error, so :attr:`alive` (set by :func:`register_subscriptions`) is asked.

    Args:
        bus: the MCP server's subscription bus (the same one the listen streams read).
        grant: the caller's grant for the request being handled.
        limit: subscribed sessions at once; past it, ``resources/subscribe`` is refused.
        per_agent: subscribed sessions of one agent at once (of ``limit``); past it, that agent's
            ``resources/subscribe`` in a new session is refused.
    """

    def __init__(self, bus: SubscriptionBus, grant: Callable[[], Grant], *, limit: int = MAX_SUBSCRIBERS,
                 per_agent: int = PER_AGENT) -> None:
        self.bus = bus
        self.grant = grant
        self.limit = limit
        self.per_agent = per_agent
        self._sessions: dict[str, _Session] = {}
        self._unsubscribe: Callable[[], None] | None = None
        #: Whether the session with this id still exists.
        self.alive: Callable[[str], bool] = lambda _session_id: True
        #: Whether the session with this id has its standalone (GET) stream open now.
        self.stream_open: Callable[[str], bool] = lambda _session_id: True

    @property
    def sessions(self) -> int:
        """Sessions subscribed to at least one resource."""
        return len(self._sessions)

    def start(self) -> None:
        """Listen on the bus."""
        if self._unsubscribe is None:
            self._unsubscribe = self.bus.subscribe(self._on_event)

    async def close(self) -> None:
        """Stop listening and end every send in flight (idempotent)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        sessions, self._sessions = list(self._sessions.values()), {}
        senders = [s.sender for s in sessions if s.sender is not None]
        for sender in senders:
            sender.cancel()
        for sender in senders:
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    async def subscribe(self, ctx: ServerRequestContext[Any, Any], params: SubscribeRequestParams) -> EmptyResult:
        """Handle ``resources/subscribe``."""
        key = self._check(ctx, str(params.uri))
        entry = self._sessions.get(key)
        if entry is None:
            agent_id = self.grant().agent_id

            def held() -> int:
                return sum(1 for s in self._sessions.values() if s.agent_id == agent_id)

            if len(self._sessions) >= self.limit or held() >= self.per_agent:
                self._prune()
            if held() >= self.per_agent:
                raise MCPError(INVALID_REQUEST, f"This agent has {self.per_agent} subscribed sessions on this "
                                                "server, the most it may hold; unsubscribe or end one first.")
            if len(self._sessions) >= self.limit:
                raise MCPError(INVALID_REQUEST, "This server has as many subscribed sessions as it serves; retry later.")
            entry = self._sessions[key] = _Session(ctx.session, agent_id)
        entry.session = ctx.session
        entry.uris.add(str(params.uri))
        return EmptyResult()

    async def unsubscribe(self, ctx: ServerRequestContext[Any, Any], params: UnsubscribeRequestParams) -> EmptyResult:
        """Handle ``resources/unsubscribe``."""
        key = self._check(ctx, str(params.uri))
        entry = self._sessions.get(key)
        if entry is not None:
            entry.uris.discard(str(params.uri))
            entry.pending.discard(str(params.uri))
            if not entry.uris:
                self._forget(key)
        return EmptyResult()

    def _check(self, ctx: ServerRequestContext[Any, Any], uri: str) -> str:
        """The session's key, after checking the caller's scope and the resource."""
        _require_read(self.grant)
        if uri not in RESOURCES:
            raise MCPError(INVALID_PARAMS, "Unknown resource: subscribe to toastmachine://corpus or toastmachine://guide.")
        headers = getattr(ctx.request, "headers", None)
        key = headers.get("mcp-session-id") if headers is not None else None
        if not key:
            raise MCPError(INVALID_REQUEST, "resources/subscribe needs a session (the initialize handshake).")
        return str(key)

    def stream_opened(self, session_id: str, *, tries: int = STREAM_OPEN_TRIES) -> None:
        """Session ``session_id`` answered a GET with its stream: send what is pending for it.

        Called right after the SDK sent the GET's response head; the SDK registers the stream in a
        task it started just before, so it is normally there by the next loop turn (looked at for
        up to ``tries`` turns; a stream that failed to open keeps its notifications pending)."""
        entry = self._sessions.get(session_id)
        if entry is None or not entry.pending or entry.sender is not None:
            return
        if self.stream_open(session_id):
            entry.sender = asyncio.create_task(self._deliver(session_id, entry), name="mcp-notify-session")
        elif tries > 1:
            asyncio.get_running_loop().call_soon(lambda: self.stream_opened(session_id, tries=tries - 1))

    def _on_event(self, event: ServerEvent) -> None:
        # The bus calls this synchronously on the event loop: mark, and start a sender where none
        # runs and the session's stream is open (otherwise it is sent when the stream opens).
        if not isinstance(event, ResourceUpdated):
            return
        self._prune()
        for key, entry in self._sessions.items():
            if event.uri in entry.uris:
                entry.pending.add(event.uri)
                if entry.sender is None and self.stream_open(key):
                    entry.sender = asyncio.create_task(self._deliver(key, entry), name="mcp-notify-session")

    async def _deliver(self, key: str, entry: _Session) -> None:
        try:
            # A stream that closed meanwhile keeps the rest pending until it opens again.
            while entry.pending and self.stream_open(key):
                uri = min(entry.pending)
                entry.pending.discard(uri)
                await entry.session.send_resource_updated(uri)
        except Exception as e:  # noqa: BLE001 - the session's stream broke: forget it
            log.info("mcp.notify.session_gone", reason=type(e).__name__)
            self._forget(key)
        finally:
            entry.sender = None

    def _prune(self) -> None:
        for key in [key for key in self._sessions if not self.alive(key)]:
            log.info("mcp.notify.session_gone", reason="ended")
            self._forget(key)

    def _forget(self, key: str) -> None:
        entry = self._sessions.pop(key, None)
        if entry is not None and entry.sender is not None and entry.sender is not asyncio.current_task():
            entry.sender.cancel()


class ScopedListen:
    """The SDK's ``subscriptions/listen`` handler behind the read-scope check, with our bounds."""

    def __init__(self, bus: SubscriptionBus, grant: Callable[[], Grant], *, per_agent: int = PER_AGENT) -> None:
        self.grant = grant
        self.inner = ListenHandler(bus, max_subscriptions=MAX_SUBSCRIBERS, max_buffered_events=LISTEN_BACKLOG)
        #: Open listen streams of one agent at once; past it, that agent's next listen is refused.
        self.per_agent = per_agent
        self._open: Counter[str] = Counter()

    async def __call__(self, ctx: ServerRequestContext[Any, Any],
                       params: SubscriptionsListenRequestParams) -> SubscriptionsListenResult:
        agent_id = _require_read(self.grant).agent_id
        if self._open[agent_id] >= self.per_agent:
            raise MCPError(INVALID_REQUEST, f"This agent has {self.per_agent} listen streams open on this server, "
                                            "the most it may hold; close one first.")
        self._open[agent_id] += 1
        try:  # the request lasts as long as its stream
            return await self.inner(ctx, params)
        finally:
            self._open[agent_id] -= 1
            if not self._open[agent_id]:
                del self._open[agent_id]

    def close(self) -> None:
        """End every listen stream gracefully (each sends its final result)."""
        self.inner.close()


def _require_read(grant: Callable[[], Grant]) -> Grant:
    try:
        current = grant()
    except Exception:  # noqa: BLE001 - no grant: the bearer layer normally refused this already
        raise MCPError(INVALID_REQUEST, "This request carries no valid authorization.") from None
    if not current.allows(READ_SCOPE):
        raise MCPError(INVALID_REQUEST, _NO_READ)
    return current


def register_subscriptions(server: MCPServer, listen: ScopedListen, legacy: LegacySubscriptions) -> None:
    """Serve ``subscriptions/listen`` (2026-07-28) and ``resources/subscribe``/``unsubscribe``
    (2025-11-25) on ``server``; the capabilities then advertise ``resources.subscribe`` in both."""
    # MCPServer registers its own listen handler and none for resources/subscribe; the low-level
    # server's public add_request_handler replaces and adds them (MCPServer exposes no other way).
    lowlevel = server._lowlevel_server

    def alive(session_id: str) -> bool:
        # The session manager drops a session the moment it ends; nothing public tells it otherwise
        # (a send to an ended session is dropped silently).
        return session_id in server.session_manager._server_instances

    def stream_open(session_id: str) -> bool:
        # The transport keeps its open standalone stream under GET_STREAM_KEY; the SDK has no public
        # way to ask (it drops a message for a missing stream without telling the sender).
        transport = server.session_manager._server_instances.get(session_id)
        return transport is not None and GET_STREAM_KEY in transport._request_streams

    legacy.alive = alive
    legacy.stream_open = stream_open
    lowlevel.add_request_handler("subscriptions/listen", SubscriptionsListenRequestParams, listen)
    lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, legacy.subscribe)
    lowlevel.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, legacy.unsubscribe)
