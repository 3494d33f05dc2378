"""The process's PostgreSQL connection pool.

:class:`Database` wraps one asyncpg pool. Every connection it opens decodes ``json`` / ``jsonb``
through orjson, so callers pass and receive plain Python values, never JSON text. The first connect
fails fast with :class:`~protocol.errors.DatabaseUnavailable` naming the server (never a password)
instead of a driver traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeAlias
from urllib.parse import urlsplit

import asyncpg
import orjson

from infra.logs import get_logger
from infra.redact import redact_url
from protocol.errors import ConfigError, DatabaseUnavailable

log = get_logger("toastmachine.db")

#: Seconds :meth:`Database.check` waits for ``select 1`` by default.
CHECK_TIMEOUT = 2.0
#: Seconds a borrowed connection may take to go back to the pool (the cancellation of a statement
#: the borrower gave up on, then the reset); past them the pool closes it. Unbounded, a server that
#: stopped answering without closing the connection would hold the borrower for ever.
RELEASE_TIMEOUT = 5.0
#: Seconds :func:`transaction` gives a rollback after its block failed (it takes milliseconds).
ROLLBACK_TIMEOUT = 2.0
#: Seconds :meth:`Database.close` waits for borrowed connections to come back before terminating them.
CLOSE_TIMEOUT = 10.0

#: What the helpers of this package accept: the wrapper, a raw pool, or one connection
#: (possibly a pooled proxy, possibly inside a caller's transaction).
Target: TypeAlias = "Database | asyncpg.Pool | asyncpg.Connection | asyncpg.pool.PoolConnectionProxy"

# Errors that mean "the server is not there or will not have us", as opposed to a bug in our SQL.
# PostgresError covers the server refusing us at start-up (unknown database or role, bad password,
# too many connections, "the database system is starting up").
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)

#: Errors raised *while using* a connection that mean "the database went away" (server stopped or
#: restarting, connection cut), as opposed to a problem with one statement. Callers answer 503.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    DatabaseUnavailable,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,  # admin/crash shutdown, "cannot connect now"
    # A pooled connection the server dropped mid-use can be handed out once more before the pool
    # notices; using it fails with a client-state error rather than a connection error.
    asyncpg.InternalClientError,
)


class Database:
    """An asyncpg pool with JSON codecs, a health check and an idempotent close.

    Build it with :meth:`connect`; use :attr:`pool` for queries. One per process, passed down from
    the node; nothing connects at import time.
    """

    def __init__(self, pool: asyncpg.Pool, *, label: str, dsn: str | None = None) -> None:
        """Wrap an already created pool; ``label`` is the redacted DSN used in messages; ``dsn`` (if
        known) lets :meth:`connect_session` open connections of its own."""
        self._pool = pool
        self._label = label
        self._dsn = dsn
        self._closed = False
        self._close_lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout: float = 10.0,
        command_timeout: float | None = None,
        application_name: str = "toastmachine",
        custom_plans: bool = False,
    ) -> Database:
        """Open a pool on ``dsn`` and prove it works with ``select 1``.

        ``connect_timeout`` bounds the whole start-up (every initial connection plus the probe).
        ``command_timeout`` is asyncpg's default per-statement timeout (None: no limit).
        ``custom_plans`` plans every execution of a prepared statement with its actual parameters
        (``plan_cache_mode = force_custom_plan``): the read routes' filters are selective in very
        different ways (a rare tag or a common one), and a generic plan, chosen after five
        executions, is then several times slower than the plan for the actual values. The writer's
        statements do not vary like that and keep the default (no planning per execution).
        Raises DatabaseUnavailable, naming the server with its password masked, when PostgreSQL
        cannot be reached or refuses the connection.
        """
        label = _safe_label(dsn)
        pool: asyncpg.Pool | None = None
        try:
            async with asyncio.timeout(connect_timeout):
                # Create first, await second: if start-up times out half way, we still hold the
                # pool object and can terminate the connections it already opened.
                pool = asyncpg.create_pool(
                    dsn,
                    min_size=min_size,
                    max_size=max_size,
                    timeout=connect_timeout,
                    command_timeout=command_timeout,
                    init=_init_connection,
                    reset=_keep_session,
                    server_settings={"application_name": application_name,
                                     **({"plan_cache_mode": "force_custom_plan"} if custom_plans else {})},
                )
                await pool
                # min_size=0 opens nothing up front; the probe makes "connected" mean it in every case.
                await pool.fetchval("select 1")
        except ValueError as e:
            # A DSN asyncpg cannot parse (bad port, unknown option) is a configuration mistake.
            if pool is not None:
                pool.terminate()
            raise ConfigError(f"database URL {label} is not valid: {_reason(e, dsn)}") from None
        except _CONNECT_ERRORS as e:
            if pool is not None:
                pool.terminate()
            raise DatabaseUnavailable(f"PostgreSQL at {label} is unavailable: {_reason(e, dsn)}") from None
        except BaseException:
            if pool is not None:
                pool.terminate()
            raise
        log.info("db.connected", database=label, min_size=min_size, max_size=max_size)
        return cls(pool, label=label, dsn=dsn)

    @property
    def pool(self) -> asyncpg.Pool:
        """The underlying asyncpg pool (``fetch``, ``execute``, ``acquire``, ...)."""
        return self._pool

    @property
    def label(self) -> str:
        """The DSN with its password masked, for logs and messages."""
        return self._label

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    async def connect_session(self, application_name: str, *, timeout: float = 10.0) -> asyncpg.Connection:
        """A connection of its own to the pool's server (not from the pool, so it may LISTEN for as
        long as it likes without taking a slot from queries); the caller closes it.

        Raises DatabaseUnavailable when it cannot be opened (or the DSN is unknown)."""
        if self._dsn is None or self._closed:
            raise DatabaseUnavailable(f"no dedicated connection to {self._label}")
        try:
            return await asyncpg.connect(self._dsn, timeout=timeout,
                                         server_settings={"application_name": application_name})
        except _CONNECT_ERRORS as e:
            raise DatabaseUnavailable(f"PostgreSQL at {self._label} is unavailable: {_reason(e, self._dsn)}") from None

    def acquire(self, *, timeout: float | None = None) -> asyncpg.pool.PoolAcquireContext:
        """``async with db.acquire() as conn:`` borrows one connection from the pool."""
        return self._pool.acquire(timeout=timeout)

    async def check(self, timeout: float = CHECK_TIMEOUT) -> None:
        """Run ``select 1``; raise DatabaseUnavailable if it fails or takes longer than ``timeout``."""
        if self._closed:
            raise DatabaseUnavailable(f"the connection pool to {self._label} is closed")
        try:
            async with asyncio.timeout(timeout):
                await self._pool.fetchval("select 1")
        except TimeoutError:
            raise DatabaseUnavailable(f"PostgreSQL at {self._label} did not answer within {timeout:g} s") from None
        except _CONNECT_ERRORS as e:
            raise DatabaseUnavailable(f"PostgreSQL at {self._label} is unavailable: {_reason(e, None)}") from None

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close the pool; safe to call more than once and from several tasks.

        Waits up to ``timeout`` seconds for borrowed connections to be released, then terminates
        whatever is left so shutdown never hangs on a stuck query.
        """
        async with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                await asyncio.wait_for(self._pool.close(), timeout)
            except TimeoutError:
                log.warning("db.close_timeout", database=self._label, timeout=timeout)
                self._pool.terminate()
            log.info("db.closed", database=self._label)


@contextlib.asynccontextmanager
async def connection(target: Target) -> AsyncIterator[Any]:
    """Yield one connection from ``target``: borrowed from a pool, or ``target`` itself.

    Helpers that need session state (an advisory lock, a transaction) take any :data:`Target`
    through this, so they work on the node's pool and on a test's single connection alike.
    """
    if isinstance(target, Database):
        target = target.pool
    if isinstance(target, asyncpg.Pool):
        try:
            conn = await target.acquire()
        except _CONNECT_ERRORS as e:
            raise DatabaseUnavailable(f"could not get a database connection: {_reason(e, None)}") from None
        try:
            yield conn
        finally:
            try:
                await target.release(conn, timeout=RELEASE_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - the pool terminated it; the block's outcome stands
                log.warning("db.connection_dropped", error=type(e).__name__,
                            detail="the connection could not be reset in time and was closed")
    else:
        yield target


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Skip asyncpg's per-release reset query (a round trip on every release).

    Our code leaves no session state behind: transactions are context-managed (asyncpg still rolls
    back an open one), nothing LISTENs or SETs, and the only session-level advisory lock (the
    migration lock) is released in a ``finally``.
    """


async def _init_connection(conn: asyncpg.Connection) -> None:
    # Binary format skips a text round trip; jsonb's binary form is a version byte (1) and the text.
    await conn.set_type_codec(
        "jsonb", schema="pg_catalog", format="binary",
        encoder=_encode_jsonb, decoder=_decode_jsonb,
    )
    await conn.set_type_codec(
        "json", schema="pg_catalog", format="binary",
        encoder=orjson.dumps, decoder=orjson.loads,
    )


def _encode_jsonb(value: Any) -> bytes:
    return b"\x01" + orjson.dumps(value)


def _decode_jsonb(data: bytes) -> Any:
    return orjson.loads(data[1:])


def _reason(error: BaseException, dsn: str | None) -> str:
    """A one-line, secret-free description of a connection failure."""
    if isinstance(error, TimeoutError):
        return "no answer before the connect timeout"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    reason = f"{type(error).__name__}: {text}" if text else type(error).__name__
    # Drivers do not normally echo the password, but a DSN-parsing error may quote the DSN itself.
    if dsn is not None:
        try:
            password = urlsplit(dsn).password
        except ValueError:
            password = None
        if password:
            reason = reason.replace(password, "***")
        reason = reason.replace(dsn, redact_url(dsn))
    return reason


def _safe_label(dsn: str) -> str:
    """``redact_url`` that never raises: an unparseable DSN is shown as its scheme only."""
    try:
        return redact_url(dsn)
    except ValueError:
        return f"{dsn.split(':', 1)[0]}://(unparseable URL)"


@contextlib.asynccontextmanager
async def transaction(conn: Any, prelude: str) -> AsyncIterator[None]:
    """One transaction on ``conn`` whose first round trip is ``BEGIN`` and ``prelude`` together
    (e.g. ``set local`` planner settings), committed when the block ends, rolled back when it raises.

    asyncpg's ``conn.transaction()`` sends ``BEGIN`` alone, so a transaction that must first set
    something pays a round trip more; for the writer's batches that was a few percent of a write's
    CPU. Inside a transaction the caller opened (a test's connection) it is a savepoint instead.
    Whatever ends the block (its own error, a cancellation, the connection lost) is what the caller
    sees: a rollback that cannot be done is left to the pool, which resets or drops the connection.
    """
    nested = conn.is_in_transaction()
    savepoint = "savepoint tm_transaction"
    begin, rollback, commit = ((savepoint, f"rollback to {savepoint}; release {savepoint}", f"release {savepoint}")
                               if nested else ("begin", "rollback", "commit"))
    try:
        await conn.execute(f"{begin}; {prelude}")
        yield
    except BaseException:
        # is_closed() too raises, on a proxy the pool took back. Not conditional on
        # is_in_transaction(): a cancellation during the first round trip comes before the server's
        # answer that the transaction is open. Bounded: after a statement was cancelled, asyncpg
        # holds the next one until the server confirms the cancellation, which a server that
        # stopped answering never does (the pool then drops the connection).
        with contextlib.suppress(Exception):
            if not conn.is_closed():
                async with asyncio.timeout(ROLLBACK_TIMEOUT):
                    await conn.execute(rollback)
        raise
    await conn.execute(commit)
