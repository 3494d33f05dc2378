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
    """One row of the change history: its sequence, type, partition and the event envelope as text."""

    sequence: int
    type: str
    partition: int
    event: str


async def changes_after(target: Target, after: int, limit: int = MAX_PAGE) -> list[Change]:
    """Up to ``limit`` changes with a sequence above ``after``, ascending."""
    async with connection(target) as conn:
        rows = await conn.fetch(
            "select sequence, type, partition, event from changes where sequence > $1 order by sequence limit $2",
            after, min(limit, MAX_PAGE))
    return [Change(r["sequence"], r["type"], r["partition"], r["event"]) for r in rows]


async def head_sequence(target: Target) -> int:
    """The highest committed sequence (0 for an empty history)."""
    async with connection(target) as conn:
        return int(await conn.fetchval("select coalesce(max(sequence), 0) from changes"))
