"""Single-active actors: one database session holding a session-level advisory lock.

The event publisher and the archiver run one active instance per corpus, with automatic take-over.
Every instance opens a session of its own and tries the actor's advisory lock on it; the holder is
active, the others stand by and try again. When the active instance dies its session closes and
PostgreSQL releases the lock, so a standby takes over within its retry interval. The active one does
all its lock-protected work on that same session: if the session drops, :attr:`LockSession.lost`
is set and :func:`guarded` cancels whatever was running on it, because another instance may already
be active.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import asyncpg

from infra.db.pool import UNAVAILABLE_ERRORS, Database, Target, connection
from protocol.errors import ToastMachineError

#: Seconds allowed to open the lock connection.
CONNECT_TIMEOUT = 10.0

_HOLDER = ("select a.application_name from pg_locks l join pg_stat_activity a on a.pid = l.pid "
           "where l.locktype = 'advisory' and l.granted and l.objsubid = 1 "
           "and l.classid = $1 and l.objid = $2 "
           "and l.database = (select oid from pg_database where datname = current_database())")

T = TypeVar("T")


class LockLost(ToastMachineError):
    """The connection holding a single-active lock is gone: another instance may be active now."""


class HandOver(ToastMachineError):
    """Raised by an active instance that holds the lock but cannot do the work (its broker
    unreachable while its database answers): :func:`serve_while_locked` releases the lock and stands
    by for ``pause`` seconds, so that another instance, which may reach the broker, takes over."""

    def __init__(self, reason: str, pause: float) -> None:
        super().__init__(reason)
        self.pause = pause


#: What ends an active period: the lock session went away (the lock may be someone else's now).
SESSION_ERRORS: tuple[type[BaseException], ...] = (LockLost, *UNAVAILABLE_ERRORS)


async def lock_holder(target: Target, key: int) -> str | None:
    """The ``application_name`` of the session holding advisory lock ``key``, or None."""
    classid, objid = (key >> 32) & 0xFFFF_FFFF, key & 0xFFFF_FFFF
    async with connection(target) as conn:
        name = await conn.fetchval(_HOLDER, classid, objid)
    return str(name) if name is not None else None


class LockSession:
    """One instance's own database session: the advisory lock, its LISTENs, its protected work.

    Build with :func:`open_lock_session`. With a DSN it is a dedicated connection, closed at the end
    (which drops the lock and the LISTENs). Without one (tests that hold only a pool) it borrows a
    pool connection for as long as it lives and undoes its session state before giving it back.
    """

    def __init__(self, conn: Any, key: int, release: Callable[[LockSession], Awaitable[None]]) -> None:
        self.conn = conn
        self.key = key
        #: Set when the connection terminates: stop using the lock at once.
        self.lost = asyncio.Event()
        self.locked = False
        self.listeners: list[tuple[str, Callable[..., Any]]] = []
        self._release = release
        self._closed = False
        conn.add_termination_listener(self._on_terminated)

    def _on_terminated(self, _conn: Any) -> None:
        self.lost.set()

    async def try_lock(self) -> bool:
        """Try the advisory lock without waiting; True when this session holds it."""
        self.locked = bool(await self.conn.fetchval("select pg_try_advisory_lock($1)", self.key))
        return self.locked

    async def listen(self, channel: str, callback: Callable[..., Any]) -> None:
        """LISTEN on ``channel`` for as long as the session lives."""
        await self.conn.add_listener(channel, callback)
        self.listeners.append((channel, callback))

    async def close(self) -> None:
        """Give the lock up and release the connection. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.conn.remove_termination_listener(self._on_terminated)
        try:
            await self._release(self)
        except Exception:  # noqa: BLE001 - a broken connection: the server dropped its session anyway
            with contextlib.suppress(Exception):
                self.conn.terminate()


async def open_lock_session(db: Database, dsn: str | None, key: int, app: str) -> LockSession:
    """A session for lock ``key`` named ``app`` (``application_name``, shown in ``pg_stat_activity``):
    a dedicated connection to ``dsn``, or one borrowed from ``db``'s pool when ``dsn`` is None."""
    if dsn is not None:
        conn = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT, server_settings={"application_name": app})

        async def close(_session: LockSession) -> None:
            await conn.close(timeout=2)

        return LockSession(conn, key, close)
    pool = db.pool
    pooled = await pool.acquire(timeout=CONNECT_TIMEOUT)

    async def give_back(session: LockSession) -> None:
        try:
            # The pool does not reset sessions (infra/db/pool.py): undo ours before returning it.
            for channel, callback in session.listeners:
                with contextlib.suppress(Exception):
                    await pooled.remove_listener(channel, callback)
            if not pooled.is_closed():
                await pooled.execute("unlisten *; select pg_advisory_unlock_all(); reset application_name",
                                     timeout=2)
        finally:
            await pool.release(pooled)

    try:
        await pooled.execute("select set_config('application_name', $1, false)", app)
    except BaseException:
        await pool.release(pooled)
        raise
    return LockSession(pooled, key, give_back)


async def guarded(session: LockSession, work: Awaitable[T]) -> T:
    """Run ``work`` unless the lock session is lost first: then cancel it and raise LockLost."""
    task = asyncio.ensure_future(work)
    lost = asyncio.ensure_future(session.lost.wait())
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise LockLost("the single-active lock's database session closed")
    return task.result()


async def pause(seconds: float, *events: asyncio.Event) -> None:
    """Sleep ``seconds``, or less if one of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        if waits:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(seconds)
    finally:
        for w in waits:
            w.cancel()


async def serve_while_locked(
    role: str,
    log: Any,
    stopped: asyncio.Event,
    open_session: Callable[[], Awaitable[LockSession]],
    while_active: Callable[[LockSession], Awaitable[None]],
    inactive: Callable[[], None],
    interval: float,
    *,
    lost_detail: str = "back to standby",
    lost_context: Callable[[], Mapping[str, Any]] = dict,
) -> None:
    """The loop of a single-active actor, until ``stopped`` is set: open a lock session, try the lock
    every ``interval`` seconds, and while it is held run ``while_active`` on that session.

    A database that cannot be reached, a session that drops and a lock lost while active each bring the
    actor back to standby, never down; each is logged as ``<role>.<what>`` (a database that stays
    unreachable and a lock another instance keeps are logged once, not every interval). ``inactive`` is
    called whenever the actor stops being active (it clears the actor's own flag); ``lost_context``
    adds the actor's own fields to the ``lock_lost`` line.
    """
    session: LockSession | None = None
    standby_logged = unavailable_logged = False
    try:
        while not stopped.is_set():
            if session is None:
                try:
                    session = await open_session()
                except UNAVAILABLE_ERRORS as e:
                    if not unavailable_logged:
                        log.warning(f"{role}.database_unavailable", error=repr(e), retry_every=interval)
                        unavailable_logged = True
                    await pause(interval, stopped)
                    continue
                unavailable_logged = False
            try:
                locked = await session.try_lock()
            except UNAVAILABLE_ERRORS as e:
                log.warning(f"{role}.session_lost", error=repr(e))
                await session.close()
                session = None
                continue
            if not locked:
                if not standby_logged:
                    log.info(f"{role}.standby", retry_every=interval, detail=f"another {role} holds the lock")
                    standby_logged = True
                await pause(interval, stopped, session.lost)
                if session.lost.is_set():
                    await session.close()
                    session = None
                continue
            standby_logged = False
            handed_over: HandOver | None = None
            try:
                await while_active(session)
            except SESSION_ERRORS as e:
                # The lock may be someone else's by now: do nothing more on this session.
                log.warning(f"{role}.lock_lost", error=repr(e), **lost_context(), detail=lost_detail)
            except HandOver as e:
                log.warning(f"{role}.handing_over", reason=str(e), **lost_context(), standby_for=e.pause,
                            detail="lock released for an instance that may do the work; standing by")
                handed_over = e
            finally:
                inactive()
                await session.close()  # (closing the session releases its advisory lock)
                session = None
            if handed_over is not None:
                await pause(handed_over.pause, stopped)
    finally:
        inactive()
        if session is not None:
            await session.close()
