"""``toastmachine archive restore``: an archive into an empty database, under a fresh lineage.

What a restore writes, all in **one transaction** that commits only when every check passed, so a
restore that finds a problem half-way leaves the database as empty as it found it ("verify before
writing": nothing is visible before the whole archive has been checked):

1. the corpus witness: the archive's corpus id (from the checkpoint origin, cross-checked with every
   event) and a **fresh lineage**, and its provenance (``corpus_provenance``: parent lineage, the
   verified checkpoint's size and root, migration 0008), shown by ``GET /corpus``;
2. the private stream, checked and applied in private-sequence order: the agent register (ids,
   names, descriptions, credential hashes, onboarding state: every agent keeps its credential) and
   the operation records (a client retrying an old write with its old token gets the stored answer);
   agents first, in a first pass, then operation records in a second (they reference agents);
3. the public history, in runs of whole segments: conversations, messages, relationships, retractions and
   the active-relationship index rebuilt from the events, then the change rows with their
   **original sequence numbers**, each event re-stamped with the new lineage (the only field that
   differs); the read models follow from the change rows' own trigger;
4. ``change_sequence`` set to the highest restored sequence (a new write continues after it) and the
   publisher's cursor set to it too, so the restored history is not published to RabbitMQ again
   unless asked (``republish``).

Refused (:class:`RestoreRefused`, nothing written): a database that holds anything (a witness row,
an agent, a change or an operation record), an archive with any finding of the walk, an archive
without a private stream or without a signed checkpoint covering its segments.

Not restored, because not archived: OAuth clients, grants and tokens of the MCP front (people
consent again), rate-limit state and the curated guide (``toastmachine guide set``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from actors.recovery.load import HistoryLoader, LoadBatch, LoadProgress, LoadRefused, decode_events
from actors.recovery.walk import ArchiveSource, ArchiveWalk, PrivateWalk
from actors.writer.store import SEQUENCE_LOCK
from infra.db import Target, connection
from infra.logs import get_logger
from protocol.archive import DecodedSegment
from protocol.archive_check import Finding
from protocol.archive_private import AgentRecord, OperationRecord, decode_private_record
from protocol.checkpoint import VerifierKey
from protocol.errors import ToastMachineError

log = get_logger("toastmachine.actors.recovery.restore")

_ORIGIN_PREFIX = "toastmachine.archive/"


class RestoreRefused(ToastMachineError):
    """The restore wrote nothing: the database is not empty, or the archive did not verify."""

    def __init__(self, message: str, findings: list[Finding] | None = None) -> None:
        self.findings = findings or []
        # A store that could not be read says so in the one line, with its cause (the variable to
        # check), not only inside the JSON findings.
        unread = next((f for f in self.findings if f.kind in ("unreadable_object", "unlistable_store")), None)
        super().__init__(f"{message}: {unread.message}" if unread is not None else message)


@dataclass(slots=True)
class RestoreReport:
    """What a restore did, printed as JSON by the CLI."""

    corpus_id: uuid.UUID
    lineage: uuid.UUID
    parent_lineage: uuid.UUID
    checkpoint_size: int
    checkpoint_root: str
    restored_through: int
    counts: dict[str, int] = field(default_factory=dict)
    republish: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "corpus_id": str(self.corpus_id), "lineage": str(self.lineage),
                "provenance": {"parent_lineage": str(self.parent_lineage), "checkpoint_size": self.checkpoint_size,
                               "checkpoint_root": self.checkpoint_root},
                "restored_through": self.restored_through, "counts": self.counts, "republish": self.republish}


async def _refuse_unless_empty(conn: Any) -> None:
    row = await conn.fetchrow(
        "select exists (select 1 from corpus_witness) as witness, exists (select 1 from agents) as agents,"
        " exists (select 1 from changes) as changes, exists (select 1 from operations) as operations")
    held = [name for name in ("witness", "agents", "changes", "operations") if row[name]]
    if held:
        raise RestoreRefused("the database is not empty (it holds: " + ", ".join(held) + "); a restore "
                             "writes only into an empty database, under a fresh lineage")


async def _apply_private(conn: Any, walk: PrivateWalk, kind: type[AgentRecord | OperationRecord]) -> int:
    """Apply every record of ``kind`` in private-sequence order (a later snapshot of a key wins)."""
    applied = 0
    async for segment in walk.segments():
        agents, operations = [], []
        for event in segment.events:
            record = decode_private_record(event.body)
            if isinstance(record, AgentRecord) and kind is AgentRecord:
                agents.append((record.agent_id, record.name, record.description, record.credential_hash,
                               record.onboarded_at, record.created_at))
            elif isinstance(record, OperationRecord) and kind is OperationRecord:
                operations.append((record.author_id, record.operation, record.token, record.request_hash,
                                   record.status, record.response, record.sequence, record.created_at))
        if agents:
            await conn.executemany(
                "insert into agents (agent_id, name, description, credential_hash, onboarded_at, created_at) "
                "values ($1, $2, $3, $4, $5, $6) on conflict (agent_id) do update set name = excluded.name, "
                "description = excluded.description, credential_hash = excluded.credential_hash, "
                "onboarded_at = excluded.onboarded_at, created_at = excluded.created_at", agents)
        if operations:
            await conn.executemany(
                "insert into operations (author_id, operation, token, request_hash, status, response, sequence, "
                "created_at) values ($1, $2, $3, $4, $5, $6, $7, $8) on conflict (author_id, operation, token) do "
                "update set request_hash = excluded.request_hash, status = excluded.status, "
                "response = excluded.response, sequence = excluded.sequence, created_at = excluded.created_at",
                operations)
        applied += len(agents) + len(operations)
    return applied


#: Events written per run of statements at least (whole segments are gathered up to it): fewer,
#: larger statements, each firing the read models' trigger once. Measured on a 120,000-event
#: restore: 5-6% faster than a run per 500-event segment (the rest is per-row work in the database).
RUN_EVENTS = 4000


def _rows_of(loader: HistoryLoader, segments: list[DecodedSegment]) -> LoadBatch:
    return loader.prepare(decode_events((e.sequence, e.body) for segment in segments for e in segment.events))


async def _load_history(walk: ArchiveWalk, loader: HistoryLoader,
                        progress: Callable[[LoadProgress], None] | None = None) -> None:
    """Write every segment the walk passes, in order, in runs of about :data:`RUN_EVENTS` events,
    each run's rows made (in a worker thread) while the database writes the run before it;
    ``progress`` is told after each run.

    The database is most of a restore's time (measured on a 120,000-event restore: about 27 of 33
    s awaiting statements, above all the messages' search vectors), and making the rows (JSON,
    times, tuples) most of the rest: overlapped, the second hides behind the first.
    """
    started = time.monotonic()
    archived = walk.manifest.tree_size if walk.manifest is not None else 0
    writing: asyncio.Task[None] | None = None
    run: list[DecodedSegment] = []

    async def apply(batch: LoadBatch) -> None:
        await loader.apply(batch)
        if progress is not None:
            progress(LoadProgress(loader.counts["changes"], archived, loader.last_sequence,
                                     time.monotonic() - started))

    async def write(segments: list[DecodedSegment]) -> asyncio.Task[None]:
        batch = await asyncio.to_thread(_rows_of, loader, segments)
        if writing is not None:
            await writing  # runs in order: a run's rows may refer to the one before
        return asyncio.ensure_future(apply(batch))

    try:
        async for segment in walk.segments():
            run.append(segment)
            if sum(s.event_count for s in run) >= RUN_EVENTS:
                writing, run = await write(run), []
        if run:
            writing = await write(run)
        if writing is not None:
            await writing
    finally:
        if writing is not None and not writing.done():
            # Failed while a write was in flight: stop it (the transaction rolls back anyway).
            writing.cancel()
            await asyncio.wait([writing])
        if writing is not None and writing.done() and not writing.cancelled():
            writing.exception()  # retrieved (raised above, or superseded by the failure in flight)


async def restore_archive(source: ArchiveSource, lineage: uuid.UUID, db: Target, *,
                          trusted: VerifierKey | None = None, new_lineage: uuid.UUID | None = None,
                          republish: bool = False, keep_signing_key: bool = True,
                          progress: Callable[[LoadProgress], None] | None = None) -> RestoreReport:
    """Restore the archive of ``lineage`` from ``source`` into the empty database ``db``.

    ``trusted``: the pinned verifier key (None: the archive's own); ``new_lineage``: the fresh
    lineage to use (default a random one; never the parent's); ``republish``: leave the publisher's
    cursor at 0 so the whole restored history is published again; ``progress``: told how far the
    history load is after each run it writes (see :class:`LoadProgress`). RestoreRefused when
    anything is wrong; nothing is written then. ``keep_signing_key``: record the restored archive's
    key as the one the corpus signs with (its archivers are held to it); False when that key is lost:
    the first archiver of the restored corpus records its own.
    """
    new_lineage = new_lineage or uuid.uuid4()
    if new_lineage == lineage:
        raise RestoreRefused("a restored history needs a fresh lineage, not its parent's")
    async with connection(db) as conn, conn.transaction():
        # Another restore into the same database (or a node creating its witness) waits here until
        # this one ends, then finds the database taken and is refused by the check below, instead
        # of failing on the witness's key after reading the whole archive.
        await conn.execute("lock table corpus_witness in exclusive mode")
        await _refuse_unless_empty(conn)
        walk = ArchiveWalk(source, lineage, trusted=trusted)
        if not await walk.open() or walk.findings:
            raise RestoreRefused("the archive does not verify", walk.findings)
        checkpoint = walk.checkpoint
        if checkpoint is None or not checkpoint.origin.startswith(_ORIGIN_PREFIX):
            raise RestoreRefused("the archive has no signed checkpoint of a ToastMachine corpus", walk.findings)
        try:
            corpus_id = uuid.UUID(checkpoint.origin.removeprefix(_ORIGIN_PREFIX))
        except ValueError:
            raise RestoreRefused(f"the checkpoint origin {checkpoint.origin!r} names no corpus") from None
        # Witness first: a concurrent restore into the same database waits on it, then finds it taken.
        await conn.execute("insert into corpus_witness (corpus_id, lineage) values ($1, $2)", corpus_id, new_lineage)
        private = PrivateWalk(source, lineage, walk.verifier)
        if not await private.open() or private.findings:
            raise RestoreRefused("the archive has no usable private stream", private.findings)
        agent_records = await _apply_private(conn, private, AgentRecord)
        private.finish()  # the first pass read every record: the private checkpoint must match
        if private.findings:
            raise RestoreRefused("the private stream does not verify", private.findings)
        operation_records = await _apply_private(conn, private, OperationRecord)
        if private.findings:
            raise RestoreRefused("the private stream does not verify", private.findings)
        loader = HistoryLoader(conn, str(corpus_id), str(new_lineage))
        try:
            await _load_history(walk, loader, progress)
        except (LoadRefused, asyncpg.IntegrityConstraintViolationError) as e:
            # A segment that failed its check is skipped by the walk, so what follows it does not
            # fit: the walk's finding (a CRC mismatch, a missing segment) is the reason, not the gap.
            walk.finish()
            if walk.findings:
                raise RestoreRefused("the archive does not verify", walk.findings) from None
            if isinstance(e, LoadRefused):
                raise RestoreRefused(str(e)) from None
            # An event naming an agent the register lacks, say: the archive is not a whole corpus.
            raise RestoreRefused(f"the archived history does not fit together ({type(e).__name__}: "
                                 f"{getattr(e, 'constraint_name', None) or 'constraint'})") from None
        walk.finish()
        if walk.findings or walk.summary.segments_checked == 0:
            raise RestoreRefused("the archive does not verify" if walk.findings else "the archive has no segment",
                                 walk.findings)
        if checkpoint.size != walk.summary.tree_size:
            raise RestoreRefused("the newest checkpoint does not cover every archived segment", walk.findings)
        last = loader.last_sequence
        # Under the writer's lock, as the writer draws sequences (nothing else runs on an empty
        # database, but the rule costs nothing).
        await conn.execute("select pg_advisory_xact_lock($1)", SEQUENCE_LOCK)
        await conn.execute("select setval('change_sequence', $1)", last)
        if not republish:
            await conn.execute("update publisher_cursor set sequence = $1, updated_at = now()", last)
        await conn.execute(
            "insert into corpus_provenance (parent_lineage, checkpoint_size, checkpoint_root, restored_through, "
            "private_records) values ($1, $2, $3, $4, $5)",
            lineage, checkpoint.size, checkpoint.root, last, private.records_checked)
        if keep_signing_key and walk.verifier is not None:
            # The restored corpus goes on signing with its key: its archivers are held to it
            # (actors/archiver.py), so one given another key is refused before it signs.
            await conn.execute("insert into archive_signing_key (public_key) values ($1)", walk.verifier.text())
        counts = {**loader.counts, "agent_records": agent_records, "operation_records": operation_records,
                  "agents": await conn.fetchval("select count(*) from agents"),
                  "operations": await conn.fetchval("select count(*) from operations"),
                  # Changes whose idempotency record is not in the private stream (seeded history, or
                  # a private stream behind the public one): a retry of those would not be recognised.
                  "changes_without_operation_record": await conn.fetchval(
                      "select count(*) from changes c where not exists "
                      "(select 1 from operations o where o.sequence = c.sequence)")}
    log.info("archive.restored", parent_lineage=str(lineage), lineage=str(new_lineage), through=last,
             changes=counts["changes"])
    return RestoreReport(corpus_id, new_lineage, lineage, checkpoint.size, checkpoint.root.hex(), last, counts,
                         republish)
