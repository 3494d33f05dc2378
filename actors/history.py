"""Reading the change history in sequence order: the one query every follower builds on.

The export (``GET /corpus/changes.jsonl``), the SSE catch-up and the event publisher all page through
``changes`` with ``after=<last seen sequence>``. That is safe only because the writer assigns
sequences in commit order (see :mod:`actors.writer.store`): once a sequence is visible, no change with
a lower one can still appear.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.db.pool import Target, connection

#: Most changes one page returns.
MAX_PAGE = 1000


@dataclass(frozen=True, slots=True)
class Change:
    """One row of the change history: its sequence, type, partition and the event envelope as text.

    ``conversation_id`` is the conversation the change belongs to (for a relationship event, its
    source message's); known when the change was read from the history, None when it came off the bus.
    """

    sequence: int
    type: str
    partition: int
    event: str
    conversation_id: str | None = None


_COLUMNS = "sequence, type, partition, event, conversation_id"


def _change(row: object) -> Change:
    return Change(row["sequence"], row["type"], row["partition"], row["event"],  # type: ignore[index]
                  str(row["conversation_id"]))  # type: ignore[index]


async def changes_after(target: Target, after: int, limit: int = MAX_PAGE) -> list[Change]:
    """Up to ``limit`` changes with a sequence above ``after``, ascending."""
    async with connection(target) as conn:
        rows = await conn.fetch(
            f"select {_COLUMNS} from changes where sequence > $1 order by sequence limit $2",
            after, min(limit, MAX_PAGE))
    return [_change(r) for r in rows]


async def bounded_page(target: Target, after: int, *, max_rows: int, max_bytes: int) -> list[Change]:
    """The changes after ``after``, ascending: at most ``max_rows`` of them, and no more than fit in
    ``max_bytes`` of event text, but always at least one (an event is at most 100 KiB).

    What a reader that writes each page out before reading the next holds in memory is then
    bounded by ``max_bytes`` plus one event, however long the history.
    """
    async with connection(target) as conn:
        rows = await conn.fetch(
            f"select {_COLUMNS} from ("
            f"  select {_COLUMNS}, sum(octet_length(event)) over (order by sequence) - octet_length(event) as before"
            f"  from (select {_COLUMNS} from changes where sequence > $1 order by sequence limit $2) as page"
            ") as sized where before < $3 order by sequence",
            after, min(max_rows, MAX_PAGE), max_bytes)
    return [_change(r) for r in rows]


async def conversation_of(target: Target, sequence: int) -> str | None:
    """The conversation of the change at ``sequence`` (None if there is none)."""
    async with connection(target) as conn:
        value = await conn.fetchval("select conversation_id from changes where sequence = $1", sequence)
    return None if value is None else str(value)


async def head_sequence(target: Target) -> int:
    """The highest committed sequence (0 for an empty history)."""
    async with connection(target) as conn:
        return int(await conn.fetchval("select coalesce(max(sequence), 0) from changes"))
