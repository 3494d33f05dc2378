"""Verified access tokens kept in memory for a few seconds, forgotten on every node at once on a change.

Every MCP call presents its bearer token, and verifying it is one database round trip (the token,
its grant, client and agent). A client calls many times a second with the same token, so each MCP
process keeps what a verification returned for :data:`TTL` seconds at most, and never past the
token's own expiry, measured on the database's clock: the entry's deadline is "when the query was
sent" plus "how long the database said was left", so clock skew between the node and the database
can only make it earlier.

What keeps it correct across nodes: migration ``0011_oauth_notify`` has triggers that send a
notification on ``tm_oauth_changed`` in the same transaction as any update or delete of a token or
grant (revocation by the client, by the operator's CLI, of a whole family on refresh-token or code
reuse, an edit by hand) naming the grant, and ``*`` on any change of a client or of an agent's
identity. :class:`TokenCacheListener` LISTENs on a connection of its own and forgets what each
notification names.

Fail closed: the cache answers only while that LISTEN is known to be up. When its connection ends
(or a heartbeat on it fails or is late) everything is dropped and every verification goes to the
database until the LISTEN is back. A verification whose query was in flight while any notification
arrived is not kept (it may have read the row before the change committed), so a revocation is
never undone by a racing read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from infra.db.pool import UNAVAILABLE_ERRORS
from infra.logs import get_logger

if TYPE_CHECKING:
    from infra.db.pool import Database

log = get_logger("toastmachine.mcp.token_cache")

#: The channel migration 0011's triggers notify on; the payload is a grant id or ``*``.
CHANNEL = "tm_oauth_changed"
#: Longest time a verified token is answered from memory (also bounded by its expiry).
TTL = 10.0
#: Most tokens kept (least recently used first out).
MAX_ENTRIES = 10_000
#: Seconds between heartbeats on the LISTEN connection; the cache answers only while the last
#: heartbeat succeeded less than :data:`STALE_AFTER` seconds ago.
HEARTBEAT = 2.0
STALE_AFTER = 3 * HEARTBEAT
#: Longest wait of a revocation for its own notification (:meth:`TokenCache.expect`).
DELIVERY_WAIT = 1.0
#: Seconds before trying to open the LISTEN connection again after a failure (doubling up to the max).
RETRY = (0.5, 10.0)

T = TypeVar("T")


@dataclass(slots=True)
class _Entry(Generic[T]):
    value: T
    grant_id: str
    deadline: float  # time.monotonic()


class TokenCache(Generic[T]):
    """Verified tokens by digest, each with its grant and deadline; answers only while :meth:`live`."""

    def __init__(self, *, ttl: float = TTL, max_entries: int = MAX_ENTRIES) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, _Entry[T]] = OrderedDict()
        self._by_grant: dict[str, set[bytes]] = {}
        #: Bumped by every notification and every loss of the LISTEN: a read begun before is not kept.
        self._generation = 0
        #: Until when (monotonic) the LISTEN is known to be up; 0 while it is down.
        self._alive_until = 0.0
        #: Revocations of this process waiting to see their own notification (:meth:`expect`).
        self._waiting: dict[str, list[asyncio.Event]] = {}

    # -- the listener's side --

    def confirm_alive(self, until: float) -> None:
        """The LISTEN is up (a heartbeat just succeeded): answer from memory until ``until`` (monotonic)."""
        self._alive_until = until

    def suspend(self) -> None:
        """The LISTEN is down or unknown: forget everything, answer nothing until it is confirmed again."""
        self._alive_until = 0.0
        self._generation += 1
        self._entries.clear()
        self._by_grant.clear()

    def forget(self, payload: str) -> None:
        """A notification: forget the tokens of grant ``payload``, or all of them for ``*``."""
        self._generation += 1
        for seen in self._waiting.pop(payload, ()):
            seen.set()
        if payload == "*":
            self._entries.clear()
            self._by_grant.clear()
            return
        for key in self._by_grant.pop(payload, ()):
            self._entries.pop(key, None)

    @contextlib.contextmanager
    def expect(self, grant_id: str) -> Iterator[Callable[[], Awaitable[None]]]:
        """Around a change to grant ``grant_id`` made by this process: yields ``delivered()``, which
        waits (at most :data:`DELIVERY_WAIT` seconds, and not at all while the LISTEN is down) until
        this process's LISTEN has received the change's notification. Every node's LISTEN was sent
        it at the same commit, so a revocation answered after that is, in practice, already known
        to the other nodes when the client's next call reaches one of them."""
        seen = asyncio.Event()
        self._waiting.setdefault(grant_id, []).append(seen)

        async def delivered() -> None:
            if self.live():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(seen.wait(), DELIVERY_WAIT)

        try:
            yield delivered
        finally:
            waiting = self._waiting.get(grant_id)
            if waiting is not None and seen in waiting:
                waiting.remove(seen)
                if not waiting:
                    del self._waiting[grant_id]

    # -- the verifier's side --

    def live(self, now: float | None = None) -> bool:
        """Whether the cache may answer now."""
        return (time.monotonic() if now is None else now) < self._alive_until

    def get(self, key: bytes) -> T | None:
        """The verification kept for ``key``, if any, still within its deadline and while live."""
        now = time.monotonic()
        if not self.live(now):
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now >= entry.deadline:
            self._drop(key, entry)
            return None
        self._entries.move_to_end(key)
        return entry.value

    def generation(self) -> int:
        """Take before the database read; hand to :meth:`put` with its result."""
        return self._generation

    def put(self, key: bytes, value: T, *, grant_id: str, generation: int, sent: float, remaining: float) -> None:
        """Keep ``value`` (read by a query sent at ``sent``, monotonic, that found ``remaining``
        seconds left before the token expires) unless anything changed since ``generation``."""
        if generation != self._generation or not self.live():
            return
        deadline = sent + min(self.ttl, remaining)
        if deadline <= time.monotonic():
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._unlink(key, old)
        self._entries[key] = _Entry(value, grant_id, deadline)
        self._by_grant.setdefault(grant_id, set()).add(key)
        while len(self._entries) > self.max_entries:
            dropped, entry = self._entries.popitem(last=False)
            self._unlink(dropped, entry)

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: bytes, entry: _Entry[T]) -> None:
        self._entries.pop(key, None)
        self._unlink(key, entry)

    def _unlink(self, key: bytes, entry: _Entry[T]) -> None:
        keys = self._by_grant.get(entry.grant_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_grant[entry.grant_id]


class TokenCacheListener:
    """Keeps :class:`TokenCache` ``cache`` in step with the database: LISTEN on :data:`CHANNEL` on a
    connection of its own, a heartbeat on it, and back to bypassing the cache whenever it is lost."""

    def __init__(self, db: Database, cache: TokenCache[Any], *, application_name: str = "toastmachine mcp tokens",
                 heartbeat: float = HEARTBEAT) -> None:
        self.db = db
        self.cache = cache
        self.application_name = application_name
        self.heartbeat = heartbeat
        self.stale_after = 3 * heartbeat
        self._task: asyncio.Task[None] | None = None
        self._lost = asyncio.Event()
        #: LISTEN sessions established so far (each confirmed by a first heartbeat).
        self.sessions = 0
        self._established = asyncio.Condition()

    async def start(self) -> None:
        """Start following in the background (the cache stays bypassed until the LISTEN is up)."""
        self._task = asyncio.create_task(self._run(), name="mcp-token-cache")

    async def close(self) -> None:
        """Stop following and bypass the cache from now on."""
        self.cache.suspend()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def wait_for_session(self, number: int) -> None:
        """Wait until the ``number``-th LISTEN session is established (1: the first)."""
        async with self._established:
            await self._established.wait_for(lambda: self.sessions >= number)

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self.cache.forget(payload)

    def _on_terminated(self, _conn: Any) -> None:
        self.cache.suspend()
        self._lost.set()

    async def _run(self) -> None:
        delay = RETRY[0]
        logged = False
        while True:
            try:
                conn = await self.db.connect_session(self.application_name)
            except UNAVAILABLE_ERRORS as e:
                if not logged:
                    log.warning("mcp.token_cache_unavailable", error=type(e).__name__, retry_in=delay)
                    logged = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY[1])
                continue
            try:
                await self._follow(conn)
            except Exception as e:  # noqa: BLE001 - whatever ended it, bypass the cache and start again
                log.warning("mcp.token_cache_lost", error=type(e).__name__)
            finally:
                self.cache.suspend()
                with contextlib.suppress(Exception):
                    conn.remove_termination_listener(self._on_terminated)
                conn.terminate()
            delay, logged = RETRY[0], False
            await asyncio.sleep(delay)

    async def _follow(self, conn: Any) -> None:
        self._lost.clear()
        conn.add_termination_listener(self._on_terminated)
        self.cache.suspend()  # anything kept before this LISTEN may have missed a notification
        await conn.add_listener(CHANNEL, self._on_notify)
        first = True
        while not self._lost.is_set():
            # An answered heartbeat means the session was up when it was sent; notifications reach
            # it in commit order, so until STALE_AFTER past that the cache may answer.
            sent = time.monotonic()
            async with asyncio.timeout(self.heartbeat):
                await conn.fetchval("select 1")
            self.cache.confirm_alive(sent + self.stale_after)
            if first:
                first = False
                async with self._established:
                    self.sessions += 1
                    self._established.notify_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), self.heartbeat)
        raise ConnectionError("the token cache's LISTEN connection ended")


@contextlib.asynccontextmanager
async def following(db: Database, cache: TokenCache[Any]) -> AsyncIterator[TokenCacheListener]:
    """Run a :class:`TokenCacheListener` for ``cache`` for the duration of the block."""
    listener = TokenCacheListener(db, cache)
    await listener.start()
    try:
        yield listener
    finally:
        await listener.close()
