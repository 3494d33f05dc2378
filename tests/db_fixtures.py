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
  after the test. Use it to test migrations, or to open extra connections or processes. When the
  test also asks for ``db``, the database is a clone of a migrated template instead (see
  ``migrated_template``): ``db`` would migrate it anyway, and cloning is cheaper.
- ``db`` -> Database: a connected, migrated pool on ``database_dsn``, closed after the test
  (``apply_migrations`` still runs on it and finds nothing pending).

A test that asks for any of them runs twice, once per backend::

    async def test_something(db: Database) -> None:
        await db.pool.execute(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import asyncpg
import pytest
import pytest_asyncio

from infra.db import Database, EmbeddedPostgres, apply_migrations, start_embedded

__all__ = ["database_dsn", "database_server", "database_url", "db", "embedded_postgres", "fresh_database",
           "migrated_template", "template_databases", "with_database"]

#: Seconds allowed for creating or dropping a test database.
ADMIN_TIMEOUT = 30.0


def with_database(dsn: str, name: str) -> str:
    """``dsn`` pointing at database ``name`` instead (host, user and query options unchanged)."""
    return urlsplit(dsn)._replace(path="/" + name).geturl()


#: Per server (maintenance DSN): this test process's migrated template database, made on first use.
_TEMPLATES: dict[str, str] = {}


async def migrated_template(server_dsn: str) -> str:
    """Name of a database on the server of ``server_dsn`` with every migration applied, made once
    per test process (each xdist worker has its own) and dropped at the session's end.

    Cloning it (``create database … template``) costs a fraction of running the migrations on an
    empty database, which half the suite's tests would otherwise do. It accepts no connections once
    made: a clone fails while anyone (autovacuum included) is connected to its template.
    """
    name = _TEMPLATES.get(server_dsn)
    if name is not None:
        return name
    name = f"tm_test_template_{uuid.uuid4().hex[:12]}"
    await _admin(server_dsn, f'create database "{name}"')
    try:
        database = await Database.connect(with_database(server_dsn, name), min_size=1, max_size=2,
                                          connect_timeout=10)
        try:
            await apply_migrations(database)
        finally:
            await database.close()
        await _admin(server_dsn, f'alter database "{name}" with is_template true allow_connections false')
    except BaseException:
        await _drop_template(server_dsn, name)
        raise
    _TEMPLATES[server_dsn] = name
    return name


async def _drop_template(server_dsn: str, name: str) -> None:
    await _admin(server_dsn, f'alter database "{name}" with is_template false')
    await _admin(server_dsn, f'drop database if exists "{name}" with (force)')


@pytest.fixture(scope="session", autouse=True)
def template_databases() -> Iterator[None]:
    """Drops the templates :func:`migrated_template` made, at the end of the session."""
    yield
    for server_dsn, name in _TEMPLATES.items():
        # An embedded server may be stopped (and its directory gone) by now: nothing to drop then.
        with contextlib.suppress(OSError, asyncpg.PostgresError, TimeoutError):
            asyncio.run(_drop_template(server_dsn, name))
    _TEMPLATES.clear()


@contextlib.asynccontextmanager
async def fresh_database(server_dsn: str, *, migrated: bool = False) -> AsyncIterator[str]:
    """Create a database on the server of ``server_dsn``, yield its DSN, drop it afterwards: empty,
    or with every migration applied when ``migrated`` (a clone of :func:`migrated_template`)."""
    name = f"tm_test_{uuid.uuid4().hex[:16]}"
    template = f' template "{await migrated_template(server_dsn)}"' if migrated else ""
    await _admin(server_dsn, f'create database "{name}"{template}')
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
async def database_dsn(database_server: str, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """DSN of a fresh empty database on the backend under test, dropped after the test; already
    migrated when the test also asks for ``db`` (which would migrate this very database)."""
    async with fresh_database(database_server, migrated="db" in request.fixturenames) as dsn:
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
