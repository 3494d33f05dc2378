"""Schema migrations on both backends: applied once, safe under concurrency, edits refused."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import asyncpg
import pytest

from infra.db import (
    MIGRATION_LOCK_KEY,
    Database,
    Migration,
    MigrationError,
    apply_migrations,
    load_migrations,
    pending_migrations,
)
from tests.procs import ROOT, clean_env

ALL = [m.name for m in load_migrations()]


@pytest.fixture
async def conns(database_dsn: str) -> AsyncIterator[list[asyncpg.Connection]]:
    """Three plain connections to the fresh database: a lock holder and two migrators."""
    opened = [await asyncpg.connect(database_dsn) for _ in range(3)]
    try:
        yield opened
    finally:
        for conn in opened:
            await conn.close()


async def _recorded(conn: asyncpg.Connection) -> list[tuple[int, str, str]]:
    rows = await conn.fetch("select version, name, checksum from schema_migrations order by version")
    return [(r["version"], r["name"], r["checksum"]) for r in rows]


async def _wait_for_lock_waiters(conn: asyncpg.Connection, count: int, timeout: float = 20) -> None:
    """Wait until ``count`` sessions of this database are blocked on the migration lock."""
    query = """
        select count(*) from pg_locks
        where locktype = 'advisory' and not granted
          and database = (select oid from pg_database where datname = current_database())
    """
    async with asyncio.timeout(timeout):
        while await conn.fetchval(query) < count:
            await asyncio.sleep(0.02)


def test_packaged_migrations_are_numbered_from_one_without_gaps() -> None:
    migrations = load_migrations()
    assert [m.version for m in migrations] == list(range(1, len(migrations) + 1))
    assert migrations[0].name == "0001_corpus_witness"
    assert all(m.sql.strip() and len(m.checksum) == 64 for m in migrations)


async def test_migrations_apply_once_and_are_idempotent(database_dsn: str) -> None:
    db = await Database.connect(database_dsn, max_size=2)
    try:
        assert await pending_migrations(db) == ALL
        assert await apply_migrations(db) == ALL
        assert await apply_migrations(db) == []
        assert await pending_migrations(db) == []
        async with db.acquire() as conn:
            recorded = await _recorded(conn)
            assert recorded == [(m.version, m.name, m.checksum) for m in load_migrations()]
            assert await conn.fetchval("select to_regclass('corpus_witness') is not null")
            # The lock is released: another session can take it at once.
            assert await conn.fetchval("select count(*) from pg_locks where locktype = 'advisory' "
                                  "and database = (select oid from pg_database where datname = current_database())") == 0
    finally:
        await db.close()


async def test_concurrent_migrators_on_two_connections_apply_each_migration_once(
        conns: list[asyncpg.Connection]) -> None:
    holder, first, second = conns
    # Hold the lock so both migrators are provably inside apply_migrations at the same time.
    await holder.execute("select pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
    runs = asyncio.gather(apply_migrations(first), apply_migrations(second))
    try:
        await _wait_for_lock_waiters(holder, 2)
    finally:
        await holder.execute("select pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    results = await asyncio.wait_for(runs, 30)
    assert sorted(results, key=len) == [[], ALL]
    assert [name for _, name, _ in await _recorded(holder)] == ALL


_CHILD = """
import asyncio, json, sys
import asyncpg
from infra.db import apply_migrations

async def main():
    conn = await asyncpg.connect(sys.argv[1])
    try:
        applied = await apply_migrations(conn)
    finally:
        await conn.close()
    print("APPLIED " + json.dumps(applied), flush=True)

asyncio.run(main())
"""


async def test_concurrent_migrators_in_two_processes_apply_each_migration_once(
        database_dsn: str, conns: list[asyncpg.Connection]) -> None:
    holder = conns[0]
    await holder.execute("select pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
    procs = []
    try:
        for _ in range(2):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-c", _CHILD, database_dsn, cwd=ROOT, env=clean_env(),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT))
        await _wait_for_lock_waiters(holder, 2, timeout=60)
    finally:
        await holder.execute("select pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    results = []
    try:
        for proc in procs:
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
            text = out.decode(errors="replace")
            assert proc.returncode == 0, text
            line = next(x for x in text.splitlines() if x.startswith("APPLIED "))
            results.append(json.loads(line.removeprefix("APPLIED ")))
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert sorted(results, key=len) == [[], ALL]
    assert [name for _, name, _ in await _recorded(holder)] == ALL


async def test_an_edited_applied_migration_is_refused(db: Database) -> None:
    first = load_migrations()[0]
    edited = Migration(first.version, first.name, first.sql + "\n-- an innocent-looking edit\n")
    extra = Migration(9001, "9001_never_applied", "create table never_applied (id int)")
    with pytest.raises(MigrationError, match=f"{first.name} was changed after it was applied"):
        await apply_migrations(db, [edited, extra])
    with pytest.raises(MigrationError, match="changed after it was applied"):
        await pending_migrations(db, [edited, extra])
    # Nothing after the check ran, and the lock was released despite the error.
    assert await db.pool.fetchval("select to_regclass('never_applied') is null")
    assert await db.pool.fetchval("select count(*) from pg_locks where locktype = 'advisory' "
                                  "and database = (select oid from pg_database where datname = current_database())") == 0


async def test_a_failing_migration_rolls_back_alone_and_releases_the_lock(db: Database) -> None:
    broken = Migration(9001, "9001_broken", "create table half_done (id int); select 1 / 0;")
    with pytest.raises(MigrationError, match="9001_broken failed and was rolled back"):
        await apply_migrations(db, [*load_migrations(), broken])
    assert await db.pool.fetchval("select to_regclass('half_done') is null")
    assert await db.pool.fetchval("select count(*) from schema_migrations where version = 9001") == 0
    assert await db.pool.fetchval("select count(*) from pg_locks where locktype = 'advisory' "
                                  "and database = (select oid from pg_database where datname = current_database())") == 0
    fixed = Migration(9001, "9001_fixed", "create table half_done (id int);")
    assert await apply_migrations(db, [*load_migrations(), fixed]) == ["9001_fixed"]


async def test_migrations_newer_than_this_code_are_tolerated(db: Database) -> None:
    newer = Migration(9001, "9001_from_the_future", "create table from_the_future (id int);")
    assert await apply_migrations(db, [*load_migrations(), newer]) == ["9001_from_the_future"]
    # An older release (without 9001) still starts against this database.
    assert await apply_migrations(db) == []
    assert await pending_migrations(db) == []
