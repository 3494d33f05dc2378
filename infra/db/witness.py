"""The corpus witness row: which corpus and which history lineage this database holds.

SPEC §4: corpus_id and lineage are configured UUIDs that must match a single witness row. When they
are not configured, the first node to start generates them once and every later node adopts them.
The table (migration 0001) admits one row and its trigger rejects UPDATE, DELETE and TRUNCATE.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from uuid import UUID

import asyncpg

from infra.db.pool import Target, connection
from infra.logs import get_logger
from protocol.errors import LineageMismatch
from protocol.routing import CorpusScope

log = get_logger("toastmachine.db.witness")


@dataclass(frozen=True, slots=True)
class CorpusIdentity:
    """The identity of a corpus history. Neither value is a secret; both appear in every event."""

    #: Which corpus this is; stays the same across restores.
    corpus_id: UUID
    #: Which history of that corpus; a restore into a new database gets a fresh one.
    lineage: UUID

    @property
    def scope(self) -> CorpusScope:
        """The corpus binding of this identity's bus traffic (queue, routing keys, headers)."""
        return CorpusScope(str(self.corpus_id), str(self.lineage))


async def read_identity(target: Target) -> CorpusIdentity | None:
    """The witness row, or None when there is none yet (or the schema is not migrated yet)."""
    async with connection(target) as conn:
        try:
            row = await conn.fetchrow("select corpus_id, lineage from corpus_witness")
        except asyncpg.UndefinedTableError:
            return None
    return None if row is None else CorpusIdentity(row["corpus_id"], row["lineage"])


async def ensure_identity(target: Target, corpus_id: UUID | None, lineage: UUID | None) -> CorpusIdentity:
    """Return the database's identity, creating the witness row on first use.

    - A row exists: every configured (non-None) value must equal it, else LineageMismatch naming
      the field(s) that differ with both values.
    - No row: insert the configured values, generating a random UUID for each one not configured.
      Two processes racing here end with a single row (the loser adopts the winner's, then is
      checked against its own configuration like anyone else).
    """
    async with connection(target) as conn:
        row = await conn.fetchrow("select corpus_id, lineage from corpus_witness")
        if row is None:
            proposed = CorpusIdentity(corpus_id or uuid.uuid4(), lineage or uuid.uuid4())
            # ON CONFLICT waits for a concurrent inserter to commit, then does nothing; the SELECT
            # that follows (a new statement, a new snapshot) then sees that winner's row.
            inserted = await conn.fetchrow(
                "insert into corpus_witness (corpus_id, lineage) values ($1, $2) "
                "on conflict (singleton) do nothing returning corpus_id, lineage",
                proposed.corpus_id, proposed.lineage,
            )
            if inserted is not None:
                log.info("corpus.identity_created", corpus_id=str(proposed.corpus_id),
                         lineage=str(proposed.lineage),
                         generated=[name for name, value in (("corpus_id", corpus_id), ("lineage", lineage))
                                    if value is None])
                return proposed
            row = await conn.fetchrow("select corpus_id, lineage from corpus_witness")
            if row is None:  # pragma: no cover - the trigger forbids deleting it
                raise LineageMismatch("the corpus witness row vanished while it was being created")
    stored = CorpusIdentity(row["corpus_id"], row["lineage"])
    differences = [
        f"{name} is configured as {want} but the database holds {have}"
        for name, want, have in (("corpus_id", corpus_id, stored.corpus_id), ("lineage", lineage, stored.lineage))
        if want is not None and want != have
    ]
    if differences:
        raise LineageMismatch("corpus identity mismatch: " + "; ".join(differences))
    return stored
