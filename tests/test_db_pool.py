"""The Database pool: fast, secret-free failures; JSON codecs; health check; idempotent close."""

from __future__ import annotations

import time
import uuid

import pytest

from infra.db import Database
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
