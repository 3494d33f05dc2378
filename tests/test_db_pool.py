"""The Database pool: fast, secret-free failures; JSON codecs; health check; idempotent close."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
import pytest

from infra.db import Database
from infra.db.pool import connection, transaction
from protocol.errors import ConfigError, DatabaseUnavailable
from tests.db_fixtures import with_database


async def test_a_closed_port_fails_fast_without_leaking_the_password() -> None:
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as err:
        await Database.connect("postgresql://postgres:secretpw@127.0.0.1:1/x", connect_timeout=5)
    assert time.monotonic() - started < 5
    message = str(err.value)
    assert "secretpw" not in message and "secretpw" not in repr(err.value)
    assert "127.0.0.1:1/x" in message
    assert err.value.__cause__ is None and err.value.__suppress_context__


@pytest.mark.parametrize("dsn", ["postgresql://u:s3cr3t@127.0.0.1:notaport/db",
                                 "postgresql://u:s3cr3t@127.0.0.1/db?sslmode=bogus"])
async def test_a_malformed_dsn_is_a_config_error_without_the_password(dsn: str) -> None:
    with pytest.raises(ConfigError, match="is not valid") as err:
        await Database.connect(dsn)
    assert "s3cr3t" not in str(err.value)


async def test_an_unknown_database_is_unavailable_not_a_driver_error(database_server: str) -> None:
    missing = with_database(database_server, f"tm_missing_{uuid.uuid4().hex[:8]}")
    with pytest.raises(DatabaseUnavailable, match="InvalidCatalogNameError"):
        await Database.connect(missing, max_size=1)


async def test_json_and_jsonb_round_trip_as_python_values(db: Database) -> None:
    value = {"text": "ünïcode", "n": [1, 2.5, None, True], "nested": {"k": "v"}}
    row = await db.pool.fetchrow("select $1::jsonb as b, $2::json as j, '{\"x\": 1}'::jsonb as literal",
                                 value, value)
    assert row["b"] == value and row["j"] == value and row["literal"] == {"x": 1}
    await db.pool.execute("create table docs (body jsonb not null)")
    await db.pool.execute("insert into docs values ($1)", value)
    assert await db.pool.fetchval("select body->'nested'->>'k' from docs") == "v"


async def test_check_passes_then_fails_after_close(db: Database) -> None:
    await db.check()
    await db.close()
    await db.close()  # idempotent
    assert db.closed
    with pytest.raises(DatabaseUnavailable, match="closed"):
        await db.check()


# --- transaction(): BEGIN and a prelude in one round trip (the writer's batches) -----------------

_PRELUDE = "set local enable_hashjoin = off"


async def _hashjoin(conn: object) -> str:
    return await conn.fetchval("show enable_hashjoin")  # type: ignore[attr-defined, no-any-return]


async def test_transaction_commits_with_its_prelude_set_only_inside(db: Database) -> None:
    await db.pool.execute("create table t (n int)")
    async with connection(db) as conn:
        async with transaction(conn, _PRELUDE):
            assert conn.is_in_transaction() and await _hashjoin(conn) == "off"
            await conn.execute("insert into t values (1)")
        assert not conn.is_in_transaction() and await _hashjoin(conn) == "on"
    assert await db.pool.fetchval("select count(*) from t") == 1


async def test_transaction_rolls_back_and_the_blocks_own_error_surfaces(db: Database) -> None:
    await db.pool.execute("create table t (n int primary key)")
    async with connection(db) as conn:
        with pytest.raises(asyncpg.UniqueViolationError):
            async with transaction(conn, _PRELUDE):
                await conn.execute("insert into t values (1)")
                await conn.execute("insert into t values (1)")
        assert not conn.is_in_transaction()
        with pytest.raises(asyncpg.UndefinedObjectError):  # a prelude that fails: nothing left open
            async with transaction(conn, "set local no_such_setting_at_all = 1"):
                pass  # pragma: no cover - not reached
        assert not conn.is_in_transaction()
        await conn.execute("insert into t values (2)")  # the connection is fine
    assert await db.pool.fetchval("select array_agg(n) from t") == [2]


async def test_transaction_inside_a_callers_transaction_is_a_savepoint(db: Database) -> None:
    await db.pool.execute("create table t (n int)")
    async with connection(db) as conn, conn.transaction():
        with pytest.raises(ZeroDivisionError):
            async with transaction(conn, _PRELUDE):
                await conn.execute("insert into t values (1)")
                raise ZeroDivisionError
        async with transaction(conn, _PRELUDE):
            await conn.execute("insert into t values (2)")
        assert conn.is_in_transaction()  # the caller's, still open
    assert await db.pool.fetchval("select array_agg(n) from t") == [2]


async def test_a_connection_killed_inside_a_transaction_surfaces_as_the_loss_not_a_pool_error(
        db: Database, database_dsn: str) -> None:
    """The server ends the session mid-transaction (pg_terminate_backend, a real fault): the caller
    sees the error the block met, not one of the rollback that cannot be done (nor the pool's "released
    back to the pool"), and a cancellation of a task in that state stays a cancellation."""

    async def kill(pid: int) -> None:
        other = await asyncpg.connect(database_dsn)
        try:
            await other.execute("select pg_terminate_backend($1)", pid)
        finally:
            await other.close()

    raised: list[BaseException] = []
    with pytest.raises(Exception) as err:
        async with connection(db) as conn, transaction(conn, _PRELUDE):
            await kill(conn.get_server_pid())
            try:
                await conn.fetchval("select pg_sleep(0.2)")
            except Exception as e:
                raised.append(e)
                raise
    assert raised and err.value is raised[0], (raised, err.value)  # not replaced by a rollback's error

    entered = asyncio.Event()

    async def parked() -> None:
        async with connection(db) as conn, transaction(conn, _PRELUDE):
            await kill(conn.get_server_pid())
            entered.set()
            await asyncio.Event().wait()  # until cancelled

    task = asyncio.create_task(parked())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert await db.pool.fetchval("select 1") == 1  # the pool replaced what it lost


async def test_a_cancellation_during_the_first_round_trip_leaves_no_transaction_for_the_pool(db: Database) -> None:
    """Cancelled while ``BEGIN`` and its prelude are still on their way (asyncpg does not know yet
    that a transaction is open): rolled back here, so the pool does not find one to reset (which
    asyncpg reports as an error through the loop's exception handler)."""
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(str(context.get("message"))))
    try:
        started = asyncio.Event()

        async def slow() -> None:
            async with connection(db) as conn:
                started.set()
                async with transaction(conn, "select pg_sleep(5)"):
                    pass  # pragma: no cover - cancelled before

        task = asyncio.create_task(slow())
        await started.wait()
        async with asyncio.timeout(30):  # until the server runs it, seen from another connection
            while not await db.pool.fetchval(
                    "select count(*) from pg_stat_activity where state = 'active' and query like 'begin; select pg_sleep%'"):
                await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await db.pool.fetchval("select 1") == 1
    finally:
        loop.set_exception_handler(previous)
    assert not [m for m in reported if "active transaction" in m], reported
