"""The corpus witness on both backends: generated once, checked against configuration, immutable."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from infra.db import CorpusIdentity, Database, ensure_identity, read_identity
from protocol.errors import LineageMismatch


@pytest.fixture
async def conns(db: Database, database_dsn: str) -> AsyncIterator[list[asyncpg.Connection]]:
    """Four plain connections to the migrated test database."""
    opened = [await asyncpg.connect(database_dsn) for _ in range(4)]
    try:
        yield opened
    finally:
        for conn in opened:
            await conn.close()


async def test_identity_is_generated_once_and_persisted(db: Database, database_dsn: str) -> None:
    assert await read_identity(db) is None
    first = await ensure_identity(db, None, None)
    assert first.corpus_id.version == 4 and first.lineage.version == 4
    assert first.corpus_id != first.lineage
    assert await ensure_identity(db, None, None) == first
    # A new pool (a restarted node) finds the same identity.
    other = await Database.connect(database_dsn, max_size=1)
    try:
        assert await read_identity(other) == first
        assert await ensure_identity(other, first.corpus_id, first.lineage) == first
    finally:
        await other.close()


async def test_configured_identity_is_written_to_an_empty_database(db: Database) -> None:
    corpus_id, lineage = uuid.uuid4(), uuid.uuid4()
    assert await ensure_identity(db, corpus_id, lineage) == CorpusIdentity(corpus_id, lineage)
    assert await read_identity(db) == CorpusIdentity(corpus_id, lineage)
    assert await ensure_identity(db, corpus_id, None) == CorpusIdentity(corpus_id, lineage)
    assert await ensure_identity(db, None, lineage) == CorpusIdentity(corpus_id, lineage)


@pytest.mark.parametrize("configured", ["corpus_id", "lineage"])
async def test_the_unconfigured_half_is_generated(db: Database, configured: str) -> None:
    value = uuid.uuid4()
    ident = await ensure_identity(db, value if configured == "corpus_id" else None,
                                  value if configured == "lineage" else None)
    assert getattr(ident, configured) == value
    other = ident.lineage if configured == "corpus_id" else ident.corpus_id
    assert other != value and other.version == 4
    assert await ensure_identity(db, None, None) == ident


async def test_a_mismatch_names_the_field_and_both_values(db: Database) -> None:
    stored = await ensure_identity(db, None, None)
    wrong_lineage, wrong_corpus = uuid.uuid4(), uuid.uuid4()

    with pytest.raises(LineageMismatch) as lineage_err:
        await ensure_identity(db, stored.corpus_id, wrong_lineage)
    text = str(lineage_err.value)
    assert "lineage" in text and "corpus_id" not in text
    assert str(wrong_lineage) in text and str(stored.lineage) in text

    with pytest.raises(LineageMismatch) as corpus_err:
        await ensure_identity(db, wrong_corpus, None)
    text = str(corpus_err.value)
    assert "corpus_id" in text and str(wrong_corpus) in text and str(stored.corpus_id) in text

    with pytest.raises(LineageMismatch) as both_err:
        await ensure_identity(db, wrong_corpus, wrong_lineage)
    assert "corpus_id" in str(both_err.value) and "lineage" in str(both_err.value)
    assert await read_identity(db) == stored


async def test_concurrent_first_starts_end_with_one_row(db: Database, conns: list[asyncpg.Connection]) -> None:
    results = await asyncio.gather(*(ensure_identity(c, None, None) for c in conns))
    assert len(set(results)) == 1
    assert await db.pool.fetchval("select count(*) from corpus_witness") == 1
    assert await read_identity(db) == results[0]


async def test_losers_of_the_insert_race_adopt_the_winner(db: Database, conns: list[asyncpg.Connection]) -> None:
    winner, *racers = conns
    winning = CorpusIdentity(uuid.uuid4(), uuid.uuid4())
    # The winner's insert stays uncommitted until both racers have read "no row" and are blocked
    # on its primary key: that forces the ON CONFLICT path deterministically.
    tx = winner.transaction()
    await tx.start()
    try:
        await winner.execute("insert into corpus_witness (corpus_id, lineage) values ($1, $2)",
                             winning.corpus_id, winning.lineage)
        mine = CorpusIdentity(uuid.uuid4(), uuid.uuid4())
        races = asyncio.gather(
            ensure_identity(racers[0], None, None),
            ensure_identity(racers[1], None, winning.lineage),
            ensure_identity(racers[2], mine.corpus_id, mine.lineage),
            return_exceptions=True,
        )
        racer_pids = [c.get_server_pid() for c in racers]
        async with asyncio.timeout(20):
            while await db.pool.fetchval(
                    "select count(*) from pg_locks where locktype = 'transactionid' and not granted "
                    "and pid = any($1::int[])", racer_pids) < len(racers):
                await asyncio.sleep(0.02)
    except BaseException:
        await tx.rollback()
        raise
    await tx.commit()
    adopted, configured_ok, mismatched = await asyncio.wait_for(races, 20)
    assert adopted == winning and configured_ok == winning
    assert isinstance(mismatched, LineageMismatch)
    assert await db.pool.fetchval("select count(*) from corpus_witness") == 1


async def test_the_witness_row_cannot_be_changed_deleted_or_duplicated(db: Database) -> None:
    stored = await ensure_identity(db, None, None)
    for sql in ("update corpus_witness set lineage = gen_random_uuid()",
                "delete from corpus_witness",
                "truncate corpus_witness"):
        with pytest.raises(asyncpg.RestrictViolationError, match="corpus_witness is immutable"):
            await db.pool.execute(sql)
    with pytest.raises(asyncpg.UniqueViolationError):
        await db.pool.execute("insert into corpus_witness (corpus_id, lineage) values ($1, $1)", uuid.uuid4())
    with pytest.raises(asyncpg.CheckViolationError):
        await db.pool.execute("insert into corpus_witness (singleton, corpus_id, lineage) values (false, $1, $1)",
                              uuid.uuid4())
    assert await read_identity(db) == stored


async def test_read_identity_before_migrations_is_none(database_dsn: str) -> None:
    bare = await Database.connect(database_dsn, max_size=1)
    try:
        assert await read_identity(bare) is None
    finally:
        await bare.close()
