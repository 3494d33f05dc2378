"""``actors.archive_ahead.ReadAhead``: batches chained after one another and growing, encoded from
where the one before ends, at most two ahead of the one taken, ended by the first batch that is not
full; a failed read or encoding, or a seal starting elsewhere, gets None (the seal does the work
itself). The archiver's own tests (tests/test_archiver.py) run it against PostgreSQL and stores."""

from __future__ import annotations

import asyncio

from actors.archive_ahead import Cuts, Limits, ReadAhead, Start

EVENTS = 3  # events per segment


def cut(lengths: list[int]) -> tuple[Cuts, int]:
    """Whole segments of EVENTS events; the rest is the tail."""
    whole = len(lengths) - len(lengths) % EVENTS
    return [(i, i + EVENTS, "events") for i in range(0, whole, EVENTS)], whole


class History:
    """``n`` events 1..n, read in batches, with a record of what was read when."""

    def __init__(self, n: int, *, fail_after: int | None = None) -> None:
        self.n = n
        self.fail_after = fail_after
        self.reads: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def read(self, after: int, limits: Limits) -> tuple[list[int], list[bytes]]:
        await self.gate.wait()
        if self.fail_after is not None and after >= self.fail_after:
            raise OSError("the connection dropped")
        self.reads.append(after)
        sequences = list(range(after + 1, min(self.n, after + limits[0]) + 1))
        return sequences, [b"e%d" % s for s in sequences]


async def encode(start: Start, segments: list[tuple[list[int], list[bytes]]], tree: int) -> list[tuple[int, int]]:
    """(segment index, last sequence) per segment; the 'tree' is the count of events so far."""
    return [(start[0] + i, sequences[-1]) for i, (sequences, _) in enumerate(segments)]


def follow(last: tuple[int, int]) -> tuple[Start, int]:
    return (last[0] + 1, b"h%d" % last[0], last[1]), last[1]


def grow(limits: Limits) -> Limits:
    return min(4 * EVENTS, limits[0] * 2), limits[1]


def ahead(history: History) -> ReadAhead[tuple[int, int], int]:
    return ReadAhead(read=history.read, cut=cut, encode=encode, follow=follow, grow=grow,
                     after=0, limits=(EVENTS, 1 << 20), start=(0, b"genesis", 0), tree=0)


async def test_batches_follow_one_another_grow_and_end_at_the_first_that_is_not_full() -> None:
    history = History(40)
    read_ahead = ahead(history)
    after, start, taken = 0, (0, b"genesis", 0), []
    while (ready := await read_ahead.take(after, start)) is not None:
        assert ready.encoded is not None
        taken.append((ready.rows.after, ready.rows.limits[0], ready.encoded))
        if not ready.rows.continues:
            break
        after = ready.rows.next_after
        start, _ = follow(ready.encoded[-1])
    # 3, then 6, then 12 events per batch (the limit), until the batch that is not full: 40 = 3 + 6 + 12 + 12 + 7.
    assert [(a, n) for a, n, _ in taken] == [(0, 3), (3, 6), (9, 12), (21, 12), (33, 12)]
    assert [seg for _, _, segs in taken for seg in segs] == [(i, 3 * (i + 1)) for i in range(13)]
    assert read_ahead.ended
    assert await read_ahead.take(after, start) is None


async def test_the_reader_stays_at_most_two_batches_ahead_of_the_one_taken() -> None:
    history = History(1000)
    read_ahead = ahead(history)
    ready = await read_ahead.take(0, (0, b"genesis", 0))
    assert ready is not None
    # Nothing more is taken: the next batch is encoded and waits, the one after it is read and waits.
    for _ in range(50):
        await asyncio.sleep(0)
    assert history.reads == [0, 3, 9]
    read_ahead.close()


async def test_a_failed_read_or_a_seal_starting_elsewhere_gets_none() -> None:
    failing = History(100, fail_after=9)
    read_ahead = ahead(failing)
    first = await read_ahead.take(0, (0, b"genesis", 0))
    assert first is not None and first.encoded is not None
    second = await read_ahead.take(3, follow(first.encoded[-1])[0])
    assert second is not None
    assert await read_ahead.take(9, (3, b"h2", 9)) is None  # the third read failed
    assert read_ahead.ended

    elsewhere = ahead(History(100))
    assert await elsewhere.take(5, (0, b"genesis", 0)) is None  # the seal starts after 5, not 0
    elsewhere.close()
