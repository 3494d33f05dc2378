"""Numbered SQL migrations, applied once each, safely from several processes at a time.

Migrations are the files ``infra/db/migrations/NNNN_name.sql`` shipped as package data. Each is
applied in its own transaction and recorded in ``schema_migrations`` with the SHA-256 of its text;
an applied file must never change afterwards (write a new migration instead), and
:func:`apply_migrations` refuses to run when one did. A file must not contain its own
``BEGIN`` / ``COMMIT``, nor statements that cannot run in a transaction (``CREATE INDEX
CONCURRENTLY``).

Concurrency: every caller first takes a session-level advisory lock on :data:`MIGRATION_LOCK_KEY`,
so when several processes start at once exactly one applies each migration and the others wait,
then find nothing left to do.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import asyncpg

from infra.db.pool import Target, connection
from infra.logs import get_logger
from protocol.errors import DatabaseUnavailable, ToastMachineError

log = get_logger("toastmachine.db.migrations")

#: Key of the session-level advisory lock held while migrating: the first 8 bytes of
#: sha256(b"toastmachine:schema_migrations") as a signed big-endian integer. Fixed forever, so
#: different versions of ToastMachine also exclude each other. Other advisory locks in this
#: project must use other keys.
MIGRATION_LOCK_KEY = -2909354881498994430

_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

_CREATE_TABLE = """
create table if not exists schema_migrations (
    version    int primary key,
    name       text not null,
    checksum   text not null,
    applied_at timestamptz not null default now()
)
"""


class MigrationError(ToastMachineError):
    """The schema cannot be brought up to date: a migration failed, or an applied one was edited."""


@dataclass(frozen=True, slots=True)
class Migration:
    """One migration file: its number, its name (file name without ``.sql``) and its SQL text."""

    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """SHA-256 (hex) of the SQL text, recorded when applied and compared on every later run."""
        return hashlib.sha256(self.sql.encode()).hexdigest()


def load_migrations() -> list[Migration]:
    """Read the packaged migration files, ordered by version.

    Raises MigrationError for a ``.sql`` file that is not named ``NNNN_name.sql`` or for two files
    with the same number: both would otherwise be skipped or applied in an arbitrary order.
    """
    found: dict[int, Migration] = {}
    for entry in resources.files("infra.db").joinpath("migrations").iterdir():
        if not entry.name.endswith(".sql"):
            continue
        m = _FILE_RE.match(entry.name)
        if m is None:
            raise MigrationError(f"migration file {entry.name!r} is not named NNNN_lowercase_name.sql")
        version = int(m.group(1))
        if version in found:
            raise MigrationError(f"two migration files have number {version:04d}: "
                                 f"{found[version].name}.sql and {entry.name}")
        # Read as text (universal newlines) so a CRLF checkout does not change the checksum.
        found[version] = Migration(version, entry.name.removesuffix(".sql"), entry.read_text(encoding="utf-8"))
    return [found[v] for v in sorted(found)]


async def apply_migrations(target: Target, migrations: Sequence[Migration] | None = None) -> list[str]:
    """Apply every migration not yet recorded in ``schema_migrations``; return their names in order.

    ``migrations`` defaults to :func:`load_migrations`. Holds the advisory lock on one connection of
    ``target`` for the whole run and releases it before returning. Raises MigrationError when an
    applied migration's checksum differs from the file's (nothing is applied then) or when a
    migration's SQL fails (that migration is rolled back; earlier ones stay applied).
    """
    wanted = list(load_migrations() if migrations is None else migrations)
    applied_now: list[str] = []
    async with connection(target) as conn:
        await _lock(conn)
        try:
            await conn.execute(_CREATE_TABLE)
            applied = await _applied(conn)
            _verify(wanted, applied)
            for migration in wanted:
                if migration.version in applied:
                    continue
                try:
                    async with conn.transaction():
                        await conn.execute(migration.sql)
                        await conn.execute(
                            "insert into schema_migrations (version, name, checksum) values ($1, $2, $3)",
                            migration.version, migration.name, migration.checksum,
                        )
                except asyncpg.PostgresError as e:
                    raise MigrationError(f"migration {migration.name} failed and was rolled back: "
                                         f"{type(e).__name__}: {e}") from e
                log.info("db.migration_applied", migration=migration.name)
                applied_now.append(migration.name)
        finally:
            await _unlock(conn)
    return applied_now


async def pending_migrations(target: Target, migrations: Sequence[Migration] | None = None) -> list[str]:
    """Names of the migrations :func:`apply_migrations` would apply now (read-only, takes no lock).

    Raises MigrationError, like apply_migrations, if an applied migration was edited.
    """
    wanted = list(load_migrations() if migrations is None else migrations)
    async with connection(target) as conn:
        exists = await conn.fetchval("select to_regclass('schema_migrations') is not null")
        applied = await _applied(conn) if exists else {}
    _verify(wanted, applied)
    return [m.name for m in wanted if m.version not in applied]


async def _lock(conn: Any) -> None:
    # Try first so a waiting process says why it is stuck instead of hanging silently.
    if await conn.fetchval("select pg_try_advisory_lock($1)", MIGRATION_LOCK_KEY):
        return
    log.info("db.migration_lock_wait", detail="another process is migrating; waiting for it to finish")
    await conn.execute("select pg_advisory_lock($1)", MIGRATION_LOCK_KEY)


async def _unlock(conn: Any) -> None:
    try:
        await conn.execute("select pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    except (OSError, asyncpg.InterfaceError, asyncpg.PostgresError) as e:
        # The connection is gone, and the server drops a session's advisory locks with it.
        log.warning("db.migration_unlock_failed", error=type(e).__name__)


async def _applied(conn: Any) -> dict[int, tuple[str, str]]:
    try:
        rows = await conn.fetch("select version, name, checksum from schema_migrations order by version")
    except (OSError, asyncpg.InterfaceError) as e:
        raise DatabaseUnavailable(f"lost the database connection while migrating: {type(e).__name__}") from None
    return {r["version"]: (r["name"], r["checksum"]) for r in rows}


def _verify(wanted: Sequence[Migration], applied: dict[int, tuple[str, str]]) -> None:
    known = {m.version: m for m in wanted}
    for version, (name, checksum) in sorted(applied.items()):
        migration = known.get(version)
        if migration is None:
            # Like Flyway's default: a newer release migrated this database; its extra migrations
            # are additive, so an older node may still run (a rolling upgrade relies on it).
            log.warning("db.migration_unknown", migration=name,
                        detail="applied by a newer version of ToastMachine")
            continue
        if checksum != migration.checksum:
            raise MigrationError(
                f"migration {migration.name} was changed after it was applied (recorded checksum "
                f"{checksum[:12]}..., file {migration.checksum[:12]}...): applied migrations must never "
                "be edited; restore the original file and put the change in a new migration")
