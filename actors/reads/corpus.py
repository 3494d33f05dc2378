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


#: Where this history comes from, in one round trip (migration 0008, both tables at most one row):
#: a restored history's provenance (written once with the witness, never changed) and a mirror's
#: source and progress; each column null when its row is absent.
ORIGIN_SQL = ("select p.parent_lineage, p.checkpoint_size, encode(p.checkpoint_root, 'hex') as checkpoint_root,"
              " p.restored_through, p.restored_at, m.source as mirror_source,"
              " m.verified_through as mirror_verified_through, m.applied_through as mirror_applied_through,"
              " m.updated_at as mirror_updated_at"
              " from (values (1)) as one left join corpus_provenance p on true left join corpus_mirror m on true")


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
    origin = await pool.fetchrow(ORIGIN_SQL)
    if origin["parent_lineage"] is not None:  # not null in its table: the row is there
        body["provenance"] = {
            "parent_lineage": str(origin["parent_lineage"]), "checkpoint_size": origin["checkpoint_size"],
            "checkpoint_root": origin["checkpoint_root"], "restored_through": origin["restored_through"],
            "restored_at": rep.format_time(origin["restored_at"])}
    if origin["mirror_source"] is not None:  # not null in its table
        body["mirror"] = {"source": origin["mirror_source"], "verified_through": origin["mirror_verified_through"],
                          "applied_through": origin["mirror_applied_through"],
                          "updated_at": rep.format_time(origin["mirror_updated_at"])}
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
