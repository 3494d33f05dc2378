"""``toastmachine archive verify``: the archive against itself, then every archived event against the database.

:func:`verify_archive` runs an :class:`~actors.recovery.walk.ArchiveWalk` and, when a database is
given, compares as the segments stream by: for each segment, the change rows with a sequence after
the previous segment's last and up to this one's last must be exactly the segment's frames, each
frame's bytes equal to the row's stored event as the segment's format version holds it
(:func:`protocol.archive.change_body`).
So a row edited behind the immutability triggers' back (``event_mismatch``), an archived event the
database does not have (``missing_in_database``) and a committed change the archiver skipped
(``not_archived``) are each reported with their sequence. Rows after the archive's last sequence are
*lag*, reported with their count, never a failure, unless the database records a checkpoint as
published beyond the store's newest (``archive_behind_database``): then the store lacks what the
archiver wrote, and those rows are not merely waiting to be archived.

The report (:class:`VerifyReport`) is JSON; ``ok`` is false on any finding, and also when nothing
was verified (an empty or absent archive proves nothing).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from actors.reads.archive import NEWEST_CHECKPOINT
from actors.recovery.walk import ArchiveSource, ArchiveWalk, PrivateWalk, WalkSummary
from infra.archive_store import ArchiveStoreError
from infra.db import Target, connection
from protocol.archive import DecodedSegment, change_body
from protocol.archive_check import Finding
from protocol.checkpoint import VerifierKey

#: At most this many findings of one kind about database rows are listed (the count is exact).
MAX_ROW_FINDINGS = 100


@dataclass(slots=True)
class DatabaseComparison:
    """How the database's change history compares with the archive."""

    compared: int = 0
    #: Committed changes after the archive's last sequence: archiving lag, not a failure.
    lag_events: int = 0
    head_sequence: int = 0
    lineage: str | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"compared": self.compared, "lag_events": self.lag_events, "head_sequence": self.head_sequence,
                "lineage": self.lineage, "discrepancies": self.counts}


@dataclass(slots=True)
class VerifyReport:
    """The outcome of one verification, printed as JSON by the CLI."""

    archive: WalkSummary
    database: DatabaseComparison | None
    findings: list[Finding]
    #: The private stream's counts and root (None: the source has none to check).
    private: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "archive": self.archive.to_json(), "private": self.private,
                "database": None if self.database is None else self.database.to_json(),
                "findings": [f.report() for f in self.findings]}


class _RowComparer:
    """Compares each checked segment with the database rows of its range, one query per segment."""

    def __init__(self, conn: Any, comparison: DatabaseComparison, findings: list[Finding]) -> None:
        self.conn = conn
        self.comparison = comparison
        self.findings = findings
        self.after = 0

    def _find(self, kind: str, message: str, sequence: int) -> None:
        counts = self.comparison.counts
        counts[kind] = counts.get(kind, 0) + 1
        if counts[kind] <= MAX_ROW_FINDINGS:
            self.findings.append(Finding(kind, message, sequence=sequence))

    async def segment(self, segment: DecodedSegment, after: int) -> None:
        """Compare ``segment`` with the rows after ``after`` (the previous segment's last sequence in
        the manifest, so a skipped bad segment's rows are not taken for unarchived ones)."""
        rows = await self.conn.fetch("select sequence, event from changes where sequence > $1 and sequence <= $2 "
                                     "order by sequence", after, segment.last_sequence)
        stored = {r["sequence"]: r["event"] for r in rows}
        for event in segment.events:
            text = stored.pop(event.sequence, None)
            if text is None:
                self._find("missing_in_database", f"archived change {event.sequence} is not in the database",
                           event.sequence)
                continue
            self.comparison.compared += 1
            if change_body(text, segment.version) != event.body:
                self._find("event_mismatch", f"change {event.sequence} in the database differs from its archived "
                           "bytes", event.sequence)
        for sequence in sorted(stored):
            self._find("not_archived", f"committed change {sequence} lies inside the archived range but is in "
                       "no segment", sequence)
        self.after = segment.last_sequence

    def skip(self, last_sequence: int) -> None:
        """A segment that failed its own checks: its rows cannot be compared; carry on after it."""
        self.after = max(self.after, last_sequence)

    async def finish(self) -> None:
        row = await self.conn.fetchrow("select count(*) filter (where sequence > $1) as lag, "
                                       "coalesce(max(sequence), 0) as head from changes", self.after)
        self.comparison.lag_events = row["lag"]
        self.comparison.head_sequence = row["head"]


async def verify_archive(source: ArchiveSource, lineage: uuid.UUID, *, trusted: VerifierKey | None = None,
                         db: Target | None = None, archiver_store: bool = False) -> VerifyReport:
    """Check the archive of ``lineage`` in ``source`` (against ``trusted``, else its own public key)
    and, when ``db`` is given, compare it with that database's change history. ``archiver_store``:
    ``source`` is the store the archiver writes to (not a copy, which may lag), so it must hold
    every checkpoint the database records as published (``archive_behind_database``)."""
    walk = ArchiveWalk(source, lineage, trusted=trusted)
    findings: list[Finding] = []
    comparison: DatabaseComparison | None = None
    # Read before the store is: the archiver puts a checkpoint (and syncs it) before it records it
    # published, so the store read after this holds at least what it says, however busy the archiver.
    recorded = await _recorded_checkpoint(db) if db is not None and archiver_store else None
    await walk.open()
    if db is None:
        async for _ in walk.segments():
            pass
    else:
        comparison = DatabaseComparison()
        async with connection(db) as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            witness = await conn.fetchrow("select lineage from corpus_witness")
            comparison.lineage = None if witness is None else str(witness["lineage"])
            if comparison.lineage != str(lineage):
                findings.append(Finding("lineage_mismatch", f"the database holds lineage {comparison.lineage}, "
                                        f"the archive is of {lineage}"))
            provenance = await conn.fetchval("select parent_lineage from corpus_provenance")
            if walk.manifest is not None and provenance != walk.manifest.parent_lineage:
                findings.append(Finding("parent_lineage_mismatch", f"the manifest names parent lineage "
                                        f"{walk.manifest.parent_lineage}, the database was restored from {provenance}"))
            comparer = _RowComparer(conn, comparison, findings)
            manifest = walk.manifest
            if manifest is not None:
                async for segment in walk.segments():
                    after = manifest.segments[segment.index - 1].last_sequence if segment.index else 0
                    await comparer.segment(segment, after)
                # Rows up to the archive's end belong to it (a segment that failed its own checks
                # is not compared); only rows after it are lag.
                comparer.skip(manifest.archived_through or 0)
            await comparer.finish()
    walk.finish()
    unread = any(f.kind in _UNREAD for f in walk.findings)
    newest = walk.summary.latest_checkpoint
    if (recorded is not None and comparison is not None and comparison.lineage == str(lineage)
            and newest is not None and not unread):
        # (Compared only when the store's checkpoints were read: one that could not be is reported
        # as such, and would make the store look behind when it is not.)
        size, root = recorded
        if size > newest["size"]:
            findings.append(Finding(
                "archive_behind_database", f"the database records the checkpoint of size {size} as published, "
                f"the store's newest is of size {newest['size']}: the store lacks what the archiver wrote (it is "
                "not the store the archiver writes to, or objects were lost from it)"))
        elif size == newest["size"] and root != newest["root"]:
            findings.append(Finding("checkpoint_mismatch", f"the checkpoint of size {size} the database records "
                                    f"has root {root}, the store's has {newest['root']}"))
    private: dict[str, Any] | None = None
    if walk.manifest is not None and await _has_private_stream(source, lineage):
        private_walk = PrivateWalk(source, lineage, walk.verifier)
        if await private_walk.open():
            async for _ in private_walk.segments():
                pass
            private_walk.finish()
        findings += private_walk.findings
        private = private_walk.to_json()
    all_findings = walk.findings + findings
    if walk.summary.segments_checked == 0:
        # Checking nothing proves nothing: an empty, absent or wholly unreadable archive fails.
        all_findings.insert(0, Finding("nothing_verified", "no segment of the archive could be checked"))
    return VerifyReport(walk.summary, comparison, all_findings, private)


#: Findings that say the walk could not read part of the store (the checkpoints among it).
_UNREAD = frozenset({"unreadable_object", "unlistable_store", "missing_public_key", "public_key_mismatch"})


async def _recorded_checkpoint(db: Target) -> tuple[int, str] | None:
    """The size and root (hex) of the newest public checkpoint the database records as published."""
    async with connection(db) as conn:
        row = await conn.fetchrow(NEWEST_CHECKPOINT, 0)
    return None if row is None else (row["tree_size"], bytes(row["root"]).hex())


async def _has_private_stream(source: ArchiveSource, lineage: uuid.UUID) -> bool:
    """Whether ``source`` lists any private object (a node's public routes never show them)."""
    try:
        return bool(await source.keys(f"{lineage}/private"))
    except ArchiveStoreError:
        return False
