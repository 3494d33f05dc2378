"""Database fixtures: every database test runs on both PostgreSQL backends, each in a fresh database.

Backends (the ``database_server`` parameter, shown in test ids as ``[postgres]`` / ``[embedded]``):

- ``postgres``: the real server from ``postgres_url`` (TOASTMACHINE_TEST_DATABASE_URL); skipped
  locally or failed on CI when unreachable, like every real-service test. Marked ``postgres``.
- ``embedded``: one pgserver instance for the whole session, in a pytest temp directory, stopped at
  session end. Always available.

Fixtures, from low to high level:

- ``database_server`` -> str: DSN of the backend's maintenance database (``postgres``). Use it only
  to create or drop databases; do not create tables there.
- ``database_dsn`` -> str: DSN of a fresh, empty, uniquely named database, dropped (WITH (FORCE))
  after the test. Use it to test migrations, or to open extra connections or processes.
- ``db`` -> Database: a connected, migrated pool on ``database_dsn``, closed after the test.

A test that asks for any of them runs twice, once per backend::

    async def test_something(db: Database) -> None:
        await db.pool.execute(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import pytest
import pytest_asyncio

from infra.db import Database, EmbeddedPostgres, apply_migrations, start_embedded

__all__ = ["database_dsn", "database_server", "database_url", "db", "embedded_postgres", "fresh_database",
           "with_database"]

#: Seconds allowed for creating or dropping a test database.
ADMIN_TIMEOUT = 30.0


def with_database(dsn: str, name: str) -> str:
    """``dsn`` pointing at database ``name`` instead (host, user and query options unchanged)."""
    return urlsplit(dsn)._replace(path="/" + name).geturl()


@contextlib.asynccontextmanager
async def fresh_database(server_dsn: str) -> AsyncIterator[str]:
    """Create an empty database on the server of ``server_dsn``, yield its DSN, drop it afterwards."""
    name = f"tm_test_{uuid.uuid4().hex[:16]}"
    await _admin(server_dsn, f'create database "{name}"')
    try:
        yield with_database(server_dsn, name)
    finally:
        # FORCE ends sessions a failed test left open (a leaked pool, a killed child's backend).
        await _admin(server_dsn, f'drop database if exists "{name}" with (force)')


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def embedded_postgres(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedPostgres]:
    """One embedded PostgreSQL for the session (initdb costs about a second), stopped at the end."""
    server = await start_embedded(tmp_path_factory.mktemp("embedded-postgres"))
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "embedded"])
def database_server(request: pytest.FixtureRequest) -> str:
    """DSN of the maintenance database of the backend under test (see the module docstring)."""
    # Looked up lazily so an unreachable real server skips only the "postgres" half.
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_url"))
    embedded: EmbeddedPostgres = request.getfixturevalue("embedded_postgres")
    return embedded.dsn


@pytest.fixture
async def database_dsn(database_server: str) -> AsyncIterator[str]:
    """DSN of a fresh empty database on the backend under test, dropped after the test."""
    async with fresh_database(database_server) as dsn:
        yield dsn


@pytest.fixture
async def database_url(postgres_url: str) -> AsyncIterator[str]:
    """A fresh database on the real PostgreSQL server only (for tests of processes run against it)."""
    async with fresh_database(postgres_url) as dsn:
        yield dsn


@pytest.fixture
async def db(database_dsn: str) -> AsyncIterator[Database]:
    """A connected, migrated Database on a fresh database of the backend under test."""
    database = await Database.connect(database_dsn, min_size=1, max_size=4, connect_timeout=10)
    try:
        await apply_migrations(database)
        yield database
    finally:
        await database.close()


async def _admin(server_dsn: str, sql: str) -> None:
    # A short-lived connection per statement: nothing bound to an event loop outlives the test.
    async with asyncio.timeout(ADMIN_TIMEOUT):
        conn = await asyncpg.connect(server_dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()
