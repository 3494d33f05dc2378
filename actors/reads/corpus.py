"""The corpus as a whole, front-neutral: its info (identity, head, counts, links) and pages of its
change history as parsed envelopes (the web front streams the same rows as JSONL)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson

from protocol import representations as rep

#: Where the web front serves the synchronization feeds (linked from the corpus info).
CHANGES_PATH = "/corpus/changes.jsonl"
SNAPSHOT_PATH = "/corpus/snapshot.jsonl"
STREAM_PATH = "/corpus/stream"
ARCHIVE_PATH = "/corpus/archive"

# Counts from the read models where they are exact (they commit with the changes they count): every
# message is counted in its author's agent_activity, every conversation has one
# conversation_activity row, and every change records exactly one message, assertion or retraction.
CORPUS_INFO_SQL = (
    "with counts as (select (select count(*) from agents) as agents,"
    " (select count(*) from conversation_activity) as conversations,"
    " (select coalesce(sum(message_count), 0) from agent_activity)::bigint as messages,"
    " (select count(*) from relationships) as relationships,"
    " (select count(*) from retractions) as retractions)"
    " select (select coalesce(max(sequence), 0) from changes) as head,"
    " (select coalesce(min(sequence), 0) from changes) as earliest,"
    " agents, conversations, messages, relationships, messages + relationships + retractions as changes,"
    " (select archived_through from archive_watermarks where stream = 0) as archived_through,"
    " (select verified_through from archive_watermarks where stream = 0) as verified_through"
    " from counts")


#: A restored history's provenance (migration 0008): written once with the witness, never changed.
PROVENANCE_SQL = ("select parent_lineage, checkpoint_size, encode(checkpoint_root, 'hex') as checkpoint_root,"
                  " restored_through, restored_at from corpus_provenance")


#: A mirror's source and progress (migration 0008), when this database is a mirror's.
MIRROR_SQL = "select source, verified_through, applied_through, updated_at from corpus_mirror"


async def corpus_info_body(pool: asyncpg.Pool, corpus_id: str, lineage: str) -> dict[str, Any]:
    """``GET /corpus``'s body. One statement sees one snapshot: the counts and the head agree.
    A restored history also says where it came from (``provenance``; absent for an original one),
    and a mirror's database what it mirrors and how far (``mirror``; absent on a corpus of its own)."""
    row = await pool.fetchrow(CORPUS_INFO_SQL)
    body: dict[str, Any] = {
        "corpus_id": corpus_id, "lineage": lineage,
        "head_sequence": row["head"], "earliest_sequence": row["earliest"],
        "counts": {name: row[name] for name in ("agents", "conversations", "messages", "relationships", "changes")},
        "archive": {"archived_through": row["archived_through"] or 0, "verified_through": row["verified_through"] or 0},
        "links": {"changes": CHANGES_PATH, "snapshot": SNAPSHOT_PATH, "stream": STREAM_PATH, "archive": ARCHIVE_PATH},
    }
    provenance = await pool.fetchrow(PROVENANCE_SQL)
    if provenance is not None:
        body["provenance"] = {
            "parent_lineage": str(provenance["parent_lineage"]), "checkpoint_size": provenance["checkpoint_size"],
            "checkpoint_root": provenance["checkpoint_root"], "restored_through": provenance["restored_through"],
            "restored_at": rep.format_time(provenance["restored_at"])}
    mirror = await pool.fetchrow(MIRROR_SQL)
    if mirror is not None:
        body["mirror"] = {"source": mirror["source"], "verified_through": mirror["verified_through"],
                          "applied_through": mirror["applied_through"],
                          "updated_at": rep.format_time(mirror["updated_at"])}
    return body


_CHANGES_PAGE = ("select sequence, event, (select coalesce(max(sequence), 0) from changes) as head,"
                 " (select coalesce(min(sequence), 0) from changes) as earliest"
                 " from (values (1)) as one left join lateral"
                 " (select sequence, event from changes where sequence > $1 order by sequence limit $2) as page on true")


@dataclass(slots=True)
class ChangesPage:
    """Envelopes after a sequence, oldest first; ``more`` when the history goes on past the page."""

    envelopes: list[dict[str, Any]]
    head: int
    earliest: int
    more: bool


async def changes_page(pool: asyncpg.Pool, after: int, limit: int) -> ChangesPage:
    """Up to ``limit`` stored envelopes with sequence > ``after`` (exactly as exported), and the head."""
    fetched = await pool.fetch(_CHANGES_PAGE, after, limit + 1)
    head, earliest = fetched[0]["head"], fetched[0]["earliest"]
    found = [r for r in fetched if r["sequence"] is not None]
    return ChangesPage([orjson.loads(r["event"]) for r in found[:limit]], head, earliest, len(found) > limit)
