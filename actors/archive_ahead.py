"""The archiver's read-ahead: the batches of one stream after a point, read and encoded before the
archiver's seal asks for them, while it puts, reads back and publishes the batch before.

Two tasks and two one-place hand-offs, so three batches are alive at most: the one the archiver
is sealing, writing and verifying; the next one, encoded and waiting; and the one after it, read
and waiting to be encoded. The reader reads batch after batch, each after the previous one's last
cut and up to twice its size (``grow``); the encoder encodes each from where the one before it
ends (index, previous hash, Merkle tree). Both stop after the first batch that is not full: the
archiver has caught up, and what follows is decided by the database (the age rule) or not yet
written.

Everything here is a cache of what the archiver would compute itself: :meth:`ReadAhead.take` hands
a batch only to a seal that starts exactly where it does, and a failure here only means the seal
reads and encodes the batch itself (and meets the error then). Measured on a 120,000-event
catch-up: reading the next batch while the current one is encoded (instead of after it) takes the
read off the path between two seals.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

#: Where a batch's encoding starts: the index of its first segment, the hash of the segment
#: before it, and the stream's tree size before it.
Start = tuple[int, bytes, int]
#: The events and event bytes a batch is read with at most.
Limits = tuple[int, int]
#: (start, end, rule) index ranges of a batch's rows, one per segment the size rules cut.
Cuts = list[tuple[int, int, str]]

E = TypeVar("E")  # one encoded segment (the archiver's own type)
T = TypeVar("T")  # the stream's Merkle tree state


@dataclass(frozen=True, slots=True)
class Rows:
    """One batch as read: the sequence it starts after, its limits, its rows, and how the events
    and bytes rules cut them (``tail``: where the uncut rest starts)."""

    after: int
    limits: Limits
    sequences: list[int]
    bodies: list[bytes]
    cuts: Cuts
    tail: int

    @property
    def full(self) -> bool:
        """True when rows may follow the batch (it stopped at a limit, not at the history's end)."""
        return len(self.sequences) == self.limits[0] or sum(map(len, self.bodies)) >= self.limits[1]

    @property
    def continues(self) -> bool:
        """True when the batch after this one can be read now: it is full and cut (its last cut is
        where the next starts)."""
        return self.full and bool(self.cuts)

    @property
    def next_after(self) -> int:
        return self.sequences[self.cuts[-1][1] - 1]


@dataclass(frozen=True, slots=True)
class Ready(Generic[E]):
    """A batch read and encoded ahead: its rows, where its encoding started, and its segments
    (None when encoding failed: the seal encodes it itself)."""

    rows: Rows
    start: Start
    encoded: list[E] | None


class ReadAhead(Generic[E, T]):
    """The read-ahead of one stream from ``after`` with ``limits``, encoding from ``start`` and ``tree``.

    Args:
        read: the rows of the batch after a sequence, with limits (one query).
        cut: the events and bytes rules: ``(cuts, tail)`` for a batch's body lengths.
        encode: a batch's segments (sequences, bodies per cut), from a start and tree (which it extends).
        follow: where the next batch's encoding starts, and its tree, from a batch's last segment.
        grow: the limits of the batch after one read with these.
    """

    def __init__(self, *, read: Callable[[int, Limits], Awaitable[tuple[list[int], list[bytes]]]],
                 cut: Callable[[list[int]], tuple[Cuts, int]],
                 encode: Callable[[Start, list[tuple[list[int], list[bytes]]], T], Awaitable[list[E]]],
                 follow: Callable[[E], tuple[Start, T]], grow: Callable[[Limits], Limits],
                 after: int, limits: Limits, start: Start, tree: T) -> None:
        self._read, self._cut, self._encode, self._follow, self._grow = read, cut, encode, follow, grow
        # One place each; a producer waits until its item is taken (join) before making the next.
        self._rows: asyncio.Queue[Rows | None] = asyncio.Queue(maxsize=1)
        self._ready: asyncio.Queue[Ready[E] | None] = asyncio.Queue(maxsize=1)
        self._done = False
        self._tasks = [asyncio.ensure_future(self._reader(after, limits)),
                       asyncio.ensure_future(self._encoder(start, tree))]

    async def _reader(self, after: int, limits: Limits) -> None:
        try:
            while True:
                sequences, bodies = await self._read(after, limits)
                cuts, tail = self._cut(list(map(len, bodies)))
                rows = Rows(after, limits, sequences, bodies, cuts, tail)
                await self._rows.put(rows)
                if not rows.continues:
                    return
                await self._rows.join()  # the encoder took it: read the next one
                after, limits = rows.next_after, self._grow(limits)
        except Exception:  # noqa: BLE001 - a failed read only ends the read-ahead
            await self._rows.put(None)

    async def _encoder(self, start: Start, tree: T) -> None:
        try:
            while True:
                rows = await self._rows.get()
                self._rows.task_done()
                if rows is None:
                    break
                encoded: list[E] | None = None
                if rows.cuts:
                    with contextlib.suppress(Exception):  # the seal encodes it itself and meets the error
                        encoded = await self._encode(start, [(rows.sequences[lo:hi], rows.bodies[lo:hi])
                                                             for lo, hi, _ in rows.cuts], tree)
                await self._ready.put(Ready(rows, start, encoded))
                if encoded is None or not rows.continues:
                    break
                await self._ready.join()  # the seal took it: encode the next one
                start, tree = self._follow(encoded[-1])
        finally:
            self._done = True
            with contextlib.suppress(asyncio.QueueFull):
                self._ready.put_nowait(None)  # wakes a seal waiting for a batch that will not come

    async def take(self, after: int, start: Start) -> Ready[E] | None:
        """The next batch, when it starts after ``after`` and its encoding at ``start``; else None
        (including when the read-ahead has ended), and the caller reads and encodes it itself."""
        if self._done and self._ready.empty():
            return None
        ready = await self._ready.get()
        self._ready.task_done()
        if ready is None or ready.rows.after != after or ready.start != start:
            return None
        return ready

    @property
    def ended(self) -> bool:
        """True when no batch will follow the ones already handed out."""
        return self._done and self._ready.empty()

    def close(self) -> None:
        """Stop reading and encoding ahead (what is in flight is dropped)."""
        for task in self._tasks:
            task.cancel()
