"""Writing archived (or followed) change events back into a corpus database: shared by restore and mirror.

:class:`HistoryLoader` turns event envelopes into the rows the corpus writer writes for them
(conversations, messages, relationships, retractions, the active-relationship index and the change
rows with their original sequences), one run of events at a time; the read models follow from the
change rows' trigger. :func:`ensure_authors` gives a mirror, which has no agent register, one row
per author named in the events, with a credential hash nobody can match.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
import orjson

from protocol import representations as rep
from protocol.corpus import canonical_json
from protocol.errors import ToastMachineError


async def as_mirror(conn: Any) -> None:
    """Mark the caller's transaction as the mirror's own: on a mirror's database (migration 0011)
    only such a transaction may add agents or changes; everything else is refused (SQLSTATE 25006)."""
    await conn.execute("set local toastmachine.mirror_apply = 'on'")


class LoadRefused(ToastMachineError):
    """An event cannot be written: it names another corpus, has an unknown type, or breaks a rule."""


#: Every table a load writes (its own rows and the read models the change rows' trigger maintains).
_LOADED_TABLES = ("agents", "conversations", "messages", "relationships", "retractions", "active_relationships",
                  "changes", "message_feed", "conversation_activity", "agent_activity", "agent_conversations",
                  "tag_conversations", "tag_stats")
#: A loader analyzes those tables once it has written this many events in its transaction, then
#: each time that count doubles. A restore (or a mirror's first build) writes the whole history
#: in one transaction, which autovacuum cannot see, so the planner kept the empty tables'
#: statistics and each statement grew slower with the rows before it: measured on a
#: 120,000-event restore, 3,300 events/s at the start and 1,400 at the end (59 s in all); with
#: these analyzes (about 2 s of them) a steady 2,900 (41 s).
ANALYZE_FROM = 4000


#: The times events carry (``protocol.representations.format_time``: milliseconds, ``Z``), and the
#: shape ``_time`` accepts (1 to 6 fraction digits, as ``%f`` does).
_EVENT_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{1,6}Z")


def _time(text: str) -> datetime:
    """The aware UTC time of an event's ``YYYY-MM-DDTHH:MM:SS.fffZ``; ValueError otherwise.

    The shape is checked first, then ``fromisoformat`` reads it: measured, about 60 times faster
    than ``strptime`` (whose locale look-ups were a fifth of a restore's Python time)."""
    if not isinstance(text, str) or not _EVENT_TIME.fullmatch(text):
        raise ValueError(f"not an event time: {text[:40]!r}" if isinstance(text, str) else "not an event time")
    return datetime.fromisoformat(text)


@dataclass(slots=True)
class LoadBatch:
    """The rows of one run of events, made by :meth:`HistoryLoader.prepare` (no I/O, so it may run
    in a worker thread) and written by :meth:`HistoryLoader.apply`."""

    conversations: list[tuple[Any, ...]] = field(default_factory=list)
    messages: list[tuple[Any, ...]] = field(default_factory=list)
    relationships: list[tuple[Any, ...]] = field(default_factory=list)
    retractions: list[tuple[Any, ...]] = field(default_factory=list)
    #: The change rows, column by column (the arrays of the insert's ``unnest``).
    changes: list[list[Any]] = field(default_factory=lambda: [[] for _ in range(9)])
    last_sequence: int = 0


@dataclass(frozen=True, slots=True)
class LoadProgress:
    """How far a load of archived history is (a restore, a mirror's archive round): told after each
    run it writes, inside its transaction (nothing is visible until that commits)."""

    #: Archived changes gone through so far (written, or found applied already by a mirror's tail).
    changes_done: int
    #: Changes the archive's manifest lists: the end of the load, if every segment checks.
    changes_archived: int
    through_sequence: int
    seconds: float
    #: ``changes_done`` when this load began (a mirror's round starts where the last one ended).
    changes_at_start: int = 0


class HistoryLoader:
    """Writes change events (original sequences) as the corpus writer would have written their rows.

    Args:
        conn: a connection inside the caller's transaction.
        corpus_id: every event must name this corpus.
        lineage: stamped into every stored event (a restore's fresh one; a mirror's source's).
    """

    def __init__(self, conn: Any, corpus_id: str, lineage: str) -> None:
        self.conn = conn
        self.corpus_id = corpus_id
        self.lineage = lineage
        self.counts = {"changes": 0, "conversations": 0, "messages": 0, "relationships": 0, "retractions": 0}
        self.last_sequence = 0
        self._analyze_at = ANALYZE_FROM

    async def segment(self, events: list[tuple[int, dict[str, Any]]], *, with_authors: bool = False) -> None:
        """Write one run of events (ascending sequences after every one written before); with
        ``with_authors``, first the agent rows of their authors (a mirror's, :func:`ensure_authors`).
        Every event is checked before anything is written."""
        batch = self.prepare(events)
        if with_authors:
            await ensure_authors(self.conn, events)
        await self.apply(batch)

    def prepare(self, events: list[tuple[int, dict[str, Any]]]) -> LoadBatch:
        """The rows of ``events``, without writing them: pure, so a caller may run it in a thread
        while :meth:`apply` writes the run before. LoadRefused when an event cannot be written."""
        batch = LoadBatch()
        for sequence, envelope in events:
            if not isinstance(envelope, dict):
                raise LoadRefused(f"archived change {sequence} is not a JSON object")
            if envelope.get("corpus_id") != self.corpus_id or envelope.get("sequence") != sequence:
                raise LoadRefused(f"archived change {sequence} names another corpus or sequence")
            try:
                self._rows(batch, sequence, envelope)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise LoadRefused(f"archived change {sequence} is not a well-formed event "
                                  f"({type(e).__name__})") from None
        return batch

    def _rows(self, batch: LoadBatch, sequence: int, envelope: dict[str, Any]) -> None:
        data, kind = envelope["data"], envelope["type"]
        _time(envelope["occurred_at"])  # written by the database from the event: its shape checked here
        message_id = relationship_id = retraction_id = None
        if kind == rep.CONVERSATION_CREATED:
            c = data["conversation"]
            batch.conversations.append((c["id"], c["subject"], c["author"]["agent_id"], c["root_message_id"],
                                        envelope["partition"], _time(c["created_at"])))
            conversation_id, author_id = c["id"], c["author"]["agent_id"]
        if kind in (rep.CONVERSATION_CREATED, rep.MESSAGE_APPENDED):
            m = data["message"]
            payload = canonical_json(m["payload"]).decode() if "payload" in m else None
            batch.messages.append((m["id"], m["conversation_id"], m["author"]["agent_id"], m["kinds"], m.get("content"),
                                   payload, m.get("schema_name"), m.get("schema_version"), m.get("reply_to"),
                                   m["tags"], [x["agent_id"] for x in m["mentions"]], _time(m["created_at"])))
            message_id = m["id"]
            if kind == rep.MESSAGE_APPENDED:
                conversation_id, author_id = m["conversation_id"], m["author"]["agent_id"]
        elif kind == rep.RELATIONSHIP_ASSERTED:
            r = data["relationship"]
            batch.relationships.append((r["id"], r["type"], r["source_message_id"], r["target_message_id"],
                                        r["author"]["agent_id"], envelope["partition"], _time(r["created_at"])))
            relationship_id, conversation_id, author_id = r["id"], None, r["author"]["agent_id"]
        elif kind == rep.RELATIONSHIP_RETRACTED:
            x = data["retraction"]
            batch.retractions.append((x["id"], x["relationship_id"], _time(x["created_at"])))
            retraction_id, conversation_id, author_id = x["id"], None, None
        elif kind != rep.CONVERSATION_CREATED:
            raise LoadRefused(f"archived change {sequence} has an unknown type")
        restamped = {**envelope, "lineage": self.lineage}
        for column, value in zip(batch.changes, (sequence, kind, envelope["partition"], conversation_id, author_id,
                                                 message_id, relationship_id, retraction_id,
                                                 rep.dumps(restamped).decode()), strict=True):
            column.append(value)
        batch.last_sequence = sequence

    async def apply(self, batch: LoadBatch) -> None:
        """Write a prepared run (after every run written before it, in order). LoadRefused when the
        database refuses one of its values (an id that is no UUID, say): :meth:`prepare` checks the
        shape of every event, not the type of every field."""
        try:
            await self._apply(batch)
        except (asyncpg.DataError, ValueError, TypeError) as e:  # the server's, or asyncpg's encoding of a row
            first = batch.changes[0][0] if batch.changes[0] else None
            raise LoadRefused(f"the archived changes from {first} to {batch.last_sequence} hold a value the "
                              f"database refuses ({type(e).__name__})") from None

    async def _apply(self, batch: LoadBatch) -> None:
        conn = self.conn
        if batch.conversations:
            # COPY, like the seeder: one round trip per table and run (foreign keys are checked
            # at the end of the statement, so a reply may follow its parent within the same COPY).
            await conn.copy_records_to_table("conversations", records=batch.conversations, columns=(
                "id", "subject", "author_id", "root_message_id", "partition", "created_at"))
        if batch.messages:
            await conn.copy_records_to_table("messages", records=batch.messages, columns=(
                "id", "conversation_id", "author_id", "kinds", "content", "payload", "schema_name", "schema_version",
                "reply_to", "tags", "mention_ids", "created_at"))
        if batch.relationships:
            await conn.copy_records_to_table("relationships", records=batch.relationships, columns=(
                "id", "type", "source_message_id", "target_message_id", "author_id", "partition", "created_at"))
        if batch.retractions:
            # Only the assertion's author may retract: the retraction's author is the relationship's.
            await conn.executemany(
                "insert into retractions (id, relationship_id, author_id, created_at) "
                "select $1, r.id, r.author_id, $3 from relationships r where r.id = $2", batch.retractions)
            await conn.execute("delete from active_relationships where relationship_id = any($1::uuid[])",
                               [x[1] for x in batch.retractions])
        if batch.relationships:
            # The index of active assertions after this run: its assertions not retracted by now
            # (built once per run, so a retract-then-assert-again inside it cannot collide).
            await conn.execute(
                "insert into active_relationships (source_message_id, target_message_id, type, author_id, "
                "relationship_id) select r.source_message_id, r.target_message_id, r.type, r.author_id, r.id "
                "from relationships r where r.id = any($1::uuid[]) "
                "and not exists (select 1 from retractions x where x.relationship_id = r.id)",
                [r[0] for r in batch.relationships])
        if batch.changes[0]:
            await self._changes(batch.changes)
            self.last_sequence = batch.last_sequence
        self.counts["changes"] += len(batch.changes[0])
        self.counts["conversations"] += len(batch.conversations)
        self.counts["messages"] += len(batch.messages)
        self.counts["relationships"] += len(batch.relationships)
        self.counts["retractions"] += len(batch.retractions)
        if self.counts["changes"] >= self._analyze_at:
            # ANALYZE inside the transaction samples the rows it wrote (uncommitted, but its own).
            await conn.execute(f"analyze {', '.join(_LOADED_TABLES)}")
            self._analyze_at = 2 * self.counts["changes"]

    async def _changes(self, columns: list[list[Any]]) -> None:
        # An assertion's conversation is its source message's; a retraction's conversation and
        # author are its assertion's: looked up from the rows just written, in the same statement,
        # and only for those rows (coalesce evaluates a subquery only when the value before it is
        # null, so a message's change costs no look-up).
        await self.conn.execute(
            "insert into changes (sequence, type, partition, conversation_id, author_id, message_id, "
            "relationship_id, retraction_id, occurred_at, event) "
            "select e.sequence, e.type, e.partition,"
            " coalesce(e.conversation_id,"
            "  (select m.conversation_id from relationships r join messages m on m.id = r.source_message_id"
            "    where r.id = e.relationship_id),"
            "  (select m.conversation_id from retractions x join relationships r on r.id = x.relationship_id"
            "    join messages m on m.id = r.source_message_id where x.id = e.retraction_id)),"
            " coalesce(e.author_id,"
            "  (select r.author_id from retractions x join relationships r on r.id = x.relationship_id"
            "    where x.id = e.retraction_id)),"
            " e.message_id, e.relationship_id, e.retraction_id,"
            " (e.event::json ->> 'occurred_at')::timestamptz, e.event"
            " from unnest($1::bigint[], $2::text[], $3::smallint[], $4::uuid[], $5::uuid[], $6::uuid[], $7::uuid[],"
            " $8::uuid[], $9::text[]) as e(sequence, type, partition, conversation_id, author_id, message_id,"
            " relationship_id, retraction_id, event)"
            " order by e.sequence", *columns)


def decode_events(bodies: Iterable[tuple[int, bytes]]) -> list[tuple[int, Any]]:
    """``(sequence, event)`` of each archived ``(sequence, body)``; LoadRefused naming the first
    body that is not JSON."""
    events = []
    for sequence, body in bodies:
        try:
            events.append((sequence, orjson.loads(body)))
        except orjson.JSONDecodeError:
            raise LoadRefused(f"archived change {sequence} is not JSON") from None
    return events


async def ensure_authors(conn: Any, events: list[tuple[int, dict[str, Any]]]) -> None:
    """Insert an agent row for each author of ``events`` not yet known (a mirror's register).

    The name is the one the events show; the credential hash is SHA-256 of random bytes, so no
    credential authenticates as anyone on a mirror: it is read-only by construction.
    """
    authors: dict[str, tuple[str, datetime]] = {}
    for sequence, envelope in events:
        try:
            for item in envelope["data"].values():
                author = item.get("author") if isinstance(item, dict) else None
                if author is not None and author["agent_id"] not in authors:
                    authors[author["agent_id"]] = (str(author["name"]), _time(envelope["occurred_at"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LoadRefused(f"archived change {sequence} is not a well-formed event ({type(e).__name__})") from None
    if authors:
        await conn.executemany(
            "insert into agents (agent_id, name, credential_hash, created_at) values ($1, $2, $3, $4) "
            "on conflict do nothing",
            [(agent_id, name, hashlib.sha256(os.urandom(32)).digest(), created)
             for agent_id, (name, created) in authors.items()])
