"""Verified access tokens kept in memory for a few seconds, answered only behind a barrier.

Every MCP call presents its bearer token, and verifying it is a four-table database read (token,
grant, client, agent). A client calls many times a second with the same token, so each MCP process
keeps what a verification returned for :data:`TTL` seconds at most, and never past the token's own
expiry as the database counts it: the entry's deadline is "when the query was sent" plus "how long
the database said was left", so clock skew between the node and the database can only make it
earlier.

Revocation stays immediate on every node:

- migration ``0012_oauth_notify`` has triggers that notify ``tm_oauth_changed`` in the same
  transaction as any update or delete of a token or grant (a client's revocation, the operator's
  CLI, family revocation on refresh-token or code reuse, an edit by hand), naming the grant, and
  ``*`` on any change to a client or to an agent's identity; :class:`TokenCacheListener` LISTENs on a
  connection of its own and forgets what each one names;
- an entry is answered only after a **barrier**: a ``select 1`` on that same LISTEN connection, sent
  after the request arrived. PostgreSQL signals every listening session before the notifying
  commit is acknowledged, and a session passes on the notifications it has been signalled before
  the ReadyForQuery of its next query (``PostgresMain``: "if any notifies were received during the
  just-finished transaction, they'll be seen by the client before ReadyForQuery is"); asyncpg hands
  them to the listener before it completes that query. So any change committed before the request
  arrived has been applied to the cache when the barrier returns. Requests that arrive together
  share one barrier (the next one sent), so its cost is one small round trip per batch, not a
  four-table read per call.

Fail closed: the cache answers only while its LISTEN connection is up. When the connection ends, or
a barrier fails or takes longer than :data:`BARRIER_TIMEOUT`, everything is dropped, the waiting
requests and every later one verify against the database, and the connection is opened again (its
new LISTEN starts from an empty cache). A verification whose read was in flight while any
notification arrived is not kept (it may have read the row before the change), so a revocation is
never undone by a racing read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from infra.logs import get_logger

if TYPE_CHECKING:
    from infra.db.pool import Database

log = get_logger("toastmachine.mcp.token_cache")

#: The channel migration 0012's triggers notify on; the payload is a grant id or ``*``.
CHANNEL = "tm_oauth_changed"
#: Longest time a verified token is answered from memory (also bounded by its expiry).
TTL = 10.0
#: Most tokens kept (least recently used first out).
MAX_ENTRIES = 10_000
#: Longest wait for a barrier; past it the LISTEN connection counts as lost.
BARRIER_TIMEOUT = 2.0
#: Seconds before opening the LISTEN connection again after a failure (doubling up to the max).
RETRY = (0.5, 10.0)

T = TypeVar("T")


@dataclass(slots=True)
class _Entry(Generic[T]):
    value: T
    grant_id: str
    deadline: float  # time.monotonic()


class TokenCache(Generic[T]):
    """Verified tokens by digest, each with its grant and deadline.

    :meth:`lookup` answers only through :attr:`barrier` (set by the listener while its LISTEN is
    up; None means the cache is bypassed)."""

    def __init__(self, *, ttl: float = TTL, max_entries: int = MAX_ENTRIES) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, _Entry[T]] = OrderedDict()
        self._by_grant: dict[str, set[bytes]] = {}
        #: Bumped by every notification and every loss of the LISTEN: a read begun before is not kept.
        self._generation = 0
        #: Waits until every change committed before the call has been applied; False: it could not.
        self.barrier: Callable[[], Awaitable[bool]] | None = None

    # -- the listener's side --

    def resume(self, barrier: Callable[[], Awaitable[bool]]) -> None:
        """A new LISTEN is up: answer through ``barrier`` from now on. Reads begun before are not
        kept (they may have missed a change committed before the LISTEN started)."""
        self._generation += 1
        self.barrier = barrier

    def suspend(self) -> None:
        """The LISTEN is down: forget everything and answer nothing until a barrier is set again."""
        self.barrier = None
        self._generation += 1
        self._entries.clear()
        self._by_grant.clear()

    def forget(self, payload: str) -> None:
        """A notification: forget the tokens of grant ``payload``, or all of them for ``*``."""
        self._generation += 1
        if payload == "*":
            self._entries.clear()
            self._by_grant.clear()
            return
        for key in self._by_grant.pop(payload, ()):
            self._entries.pop(key, None)

    # -- the verifier's side --

    async def lookup(self, key: bytes) -> T | None:
        """The verification kept for ``key``, if any, current as of the call (after a barrier)."""
        barrier = self.barrier
        if barrier is None or self._current(key) is None:
            return None
        if not await barrier():
            return None
        return self._current(key)  # a notification the barrier let through may have removed it

    def generation(self) -> int:
        """Take before the database read; hand to :meth:`put` with its result."""
        return self._generation

    def put(self, key: bytes, value: T, *, grant_id: str, generation: int, sent: float, remaining: float) -> None:
        """Keep ``value`` (read by a query sent at ``sent``, monotonic, that found ``remaining``
        seconds left before the token expires) unless anything changed since ``generation``."""
        if generation != self._generation or self.barrier is None:
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

    def _current(self, key: bytes) -> T | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if time.monotonic() >= entry.deadline:
            self._entries.pop(key, None)
            self._unlink(key, entry)
            return None
        self._entries.move_to_end(key)
        return entry.value

    def _unlink(self, key: bytes, entry: _Entry[T]) -> None:
        keys = self._by_grant.get(entry.grant_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_grant[entry.grant_id]


class TokenCacheListener:
    """Keeps :class:`TokenCache` ``cache`` in step with the database: LISTEN on :data:`CHANNEL` on a
    connection of its own, barriers on it, and the cache bypassed whenever it is lost."""

    def __init__(self, db: Database, cache: TokenCache[Any], *, application_name: str = "toastmachine mcp tokens",
                 barrier_timeout: float = BARRIER_TIMEOUT) -> None:
        self.db = db
        self.cache = cache
        self.application_name = application_name
        self.barrier_timeout = barrier_timeout
        self._task: asyncio.Task[None] | None = None
        self._lost = asyncio.Event()
        self._conn: Any = None
        #: The barrier requests are waiting for (not sent yet), and the one task sending barriers.
        self._next: asyncio.Future[bool] | None = None
        self._pump: asyncio.Task[None] | None = None
        #: LISTEN sessions established so far.
        self.sessions = 0
        self._established = asyncio.Condition()

    async def start(self) -> None:
        """Start following in the background (the cache stays bypassed until the LISTEN is up)."""
        self._task = asyncio.create_task(self._run(), name="mcp-token-cache")

    async def close(self) -> None:
        """Stop following and bypass the cache from now on."""
        self.cache.suspend()
        for task in (self._pump, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._fail_waiting()
        self._pump = self._task = None

    async def wait_for_session(self, number: int) -> None:
        """Wait until the ``number``-th LISTEN session is established (1: the first)."""
        async with self._established:
            await self._established.wait_for(lambda: self.sessions >= number)

    # -- barriers --

    async def barrier(self) -> bool:
        """Wait for a ``select 1`` on the LISTEN connection sent after this call; True when it was
        answered (so every notification committed before this call has been applied)."""
        if self._lost.is_set() or self._conn is None:
            return False
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        waiting = self._next
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._send_barriers(), name="mcp-token-cache-barrier")
        return await asyncio.shield(waiting)

    async def _send_barriers(self) -> None:
        while self._next is not None:
            # Everyone waiting on this future asked before it is sent: it is a barrier for each.
            waiting, self._next = self._next, None
            ok = False
            try:
                async with asyncio.timeout(self.barrier_timeout):
                    await self._conn.fetchval("select 1")
                # One more loop turn: the listener callbacks asyncpg scheduled run before we answer.
                await asyncio.sleep(0)
                ok = not self._lost.is_set()
            except Exception as e:  # noqa: BLE001 - any failure: bypass, and open the connection again
                log.warning("mcp.token_cache_barrier_failed", error=type(e).__name__)
                self._lose()
            if not waiting.done():
                waiting.set_result(ok)
            if not ok:
                self._fail_waiting()
                return

    def _fail_waiting(self) -> None:
        waiting, self._next = self._next, None
        if waiting is not None and not waiting.done():
            waiting.set_result(False)

    # -- the connection --

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self.cache.forget(payload)

    def _on_terminated(self, _conn: Any) -> None:
        self._lose()

    def _lose(self) -> None:
        self.cache.suspend()
        self._lost.set()

    async def _run(self) -> None:
        delay = RETRY[0]
        logged = False
        while True:
            try:
                conn = await self.db.connect_session(self.application_name)
            except Exception as e:  # noqa: BLE001 - keep trying; the cache stays bypassed meanwhile
                if not logged:
                    log.warning("mcp.token_cache_unavailable", error=type(e).__name__, retry_in=delay)
                    logged = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY[1])
                continue
            try:
                self._lost.clear()
                conn.add_termination_listener(self._on_terminated)
                self.cache.suspend()  # nothing kept before this LISTEN was told of later changes
                await conn.add_listener(CHANNEL, self._on_notify)
                self._conn = conn
                self.cache.resume(self.barrier)
                async with self._established:
                    self.sessions += 1
                    self._established.notify_all()
                await self._lost.wait()
                log.warning("mcp.token_cache_lost")
            except Exception as e:  # noqa: BLE001 - whatever ended it, bypass the cache and start again
                log.warning("mcp.token_cache_lost", error=type(e).__name__)
            finally:
                self._lose()
                self._conn = None
                self._fail_waiting()
                with contextlib.suppress(Exception):
                    conn.remove_termination_listener(self._on_terminated)
                conn.terminate()
            delay, logged = RETRY[0], False
            await asyncio.sleep(delay)


@contextlib.asynccontextmanager
async def following(db: Database, cache: TokenCache[Any]) -> AsyncIterator[TokenCacheListener]:
    """Run a :class:`TokenCacheListener` for ``cache`` for the duration of the block."""
    listener = TokenCacheListener(db, cache)
    await listener.start()
    try:
        yield listener
    finally:
        await listener.close()
