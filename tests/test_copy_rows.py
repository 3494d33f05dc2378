"""``infra.db.copy_rows``: the archiver's batch reads through binary COPY give exactly the rows a
plain query gives, with the C parser and the pure-Python one alike; output that is not whole
(cut short, a byte too many, a NULL, a wrong field count) is refused by both with the same
ValueError."""

from __future__ import annotations

import itertools

import asyncpg
import pytest

from infra.db import copy_rows as rows_module
from infra.db.copy_rows import copy_rows, parse_copy_rows

#: Texts a history can hold: ASCII, multi-byte UTF-8, a long one, escapes, the empty string.
TEXTS = ["{}", '{"content": "hello"}', "é€😀 " * 40, "x" * 70_000, '{"a": "\\n\\t\\"', ""]


@pytest.fixture
async def conn(database_dsn: str) -> asyncpg.Connection:
    connection = await asyncpg.connect(database_dsn)
    await connection.execute("create table history (sequence bigint primary key, event text not null, "
                             "body bytea, maybe text)")
    await connection.executemany("insert into history values ($1, $2, $3, $4)", [
        (n, text, text.encode() + b"\x00\xff", None if n % 2 else text)
        for n, text in zip((1, 2, 7, 2**40, 2**62, 9_007_199_254_740_991), TEXTS, strict=True)])
    try:
        yield connection
    finally:
        await connection.close()


async def copy_output(conn: asyncpg.Connection, query: str) -> bytes:
    chunks: list[bytes] = []

    async def sink(chunk: bytes) -> None:
        chunks.append(chunk)

    await conn.copy_from_query(query, output=sink, format="binary")
    return b"".join(chunks)


@pytest.mark.parametrize("column", ["event", "body"])
async def test_binary_copy_gives_the_rows_a_query_gives(conn: asyncpg.Connection, column: str) -> None:
    query = f"select sequence, {column} from history order by sequence"
    expected = [(r[0], r[1].encode() if isinstance(r[1], str) else r[1]) for r in await conn.fetch(query)]
    sequences, bodies = await copy_rows(conn, query)
    assert list(zip(sequences, bodies, strict=True)) == expected
    data = await copy_output(conn, query)
    assert parse_copy_rows(data, python=True) == parse_copy_rows(data) == (sequences, bodies)
    assert rows_module._native is not None  # the C parser is the one the archiver runs here


async def test_no_rows_is_two_empty_lists(conn: asyncpg.Connection) -> None:
    assert await copy_rows(conn, "select sequence, event from history where sequence < 0") == ([], [])


def refusals(data: bytes) -> tuple[str, str]:
    """The ValueError text of both parsers for ``data``."""
    assert rows_module._native is not None
    texts = []
    for python in (False, True):
        with pytest.raises(ValueError) as caught:
            parse_copy_rows(data, python=python)
        texts.append(str(caught.value))
    return texts[0], texts[1]


async def test_output_that_is_not_whole_is_refused_alike(conn: asyncpg.Connection) -> None:
    data = await copy_output(conn, "select sequence, event from history where sequence < 100 order by sequence")
    for cut in range(len(data)):  # every prefix: cut short anywhere
        native, python = refusals(data[:cut])
        assert native == python
    assert refusals(data + b"\x00") == ("bytes after the binary COPY trailer",) * 2
    assert refusals(b"PGCOPY\n\xff\r\n\x01" + data[11:])[0] == "not a binary COPY output (no signature)"
    three = await copy_output(conn, "select sequence, event, event from history where sequence < 100 order by sequence")
    assert refusals(three) == ("binary COPY row without exactly two fields",) * 2
    for cut in range(19, len(three)):  # the wrong field count is named first, however short the rest
        native, python = refusals(three[:cut])
        assert native == python
    nulls = await copy_output(conn, "select sequence, maybe from history order by sequence")
    assert refusals(nulls) == ("binary COPY row whose second field is NULL",) * 2
    narrow = await copy_output(conn, "select sequence::integer, event from history where sequence < 100")
    assert refusals(narrow) == ("binary COPY row whose first field is not an 8-byte integer",) * 2


def read_in_pieces(data: bytes, cuts: list[int], parser: str) -> tuple[list[int], list[bytes]]:
    """``data`` fed to a CopyRowsReader in the pieces between ``cuts``, parsed in C or in Python."""
    assert rows_module._native is not None
    reader = rows_module.CopyRowsReader(python=parser == "python")
    for lo, hi in itertools.pairwise([0, *cuts, len(data)]):
        reader.feed(data[lo:hi])
    return reader.finish()


FEEDS = ["c", "python"]


@pytest.mark.parametrize("parser", FEEDS)
async def test_pieces_cut_anywhere_give_the_rows_of_the_whole(conn: asyncpg.Connection, parser: str) -> None:
    data = await copy_output(conn, "select sequence, event from history where sequence < 100 order by sequence")
    whole = parse_copy_rows(data)
    for cut in range(len(data) + 1):  # two pieces, cut at every byte: the header, a row, the trailer
        assert read_in_pieces(data, [cut], parser) == whole
    assert read_in_pieces(data, list(range(1, len(data))), parser) == whole  # a byte at a time
    long_row = await copy_output(conn, "select sequence, event from history order by sequence")
    assert read_in_pieces(long_row, list(range(100, len(long_row), 997)), parser) == parse_copy_rows(long_row)


@pytest.mark.parametrize("parser", FEEDS)
async def test_pieces_are_refused_as_the_whole_is(conn: asyncpg.Connection, parser: str) -> None:
    data = await copy_output(conn, "select sequence, event from history where sequence < 100 order by sequence")
    three = await copy_output(conn, "select sequence, event, event from history where sequence < 100 order by sequence")
    nulls = await copy_output(conn, "select sequence, maybe from history order by sequence")
    # A length past 2**31 - 1 (negative as PostgreSQL's int32): refused as soon as it is read.
    huge = data[:19] + b"\x00\x02" + b"\x00\x00\x00\x08" + (1).to_bytes(8, "big") + b"\x80\x00\x00\x00" + b"x" * 40
    bad = [data[:cut] for cut in range(0, len(data), 3)] + [data + b"\x00", three, nulls, huge,
                                                            b"PGCOPY\n\xff\r\n\x01" + data[11:]]
    for output in bad:
        whole = refusals(output)[0]
        for cut in (1, 7, 19, 25, len(output) // 2, len(output) - 1):
            with pytest.raises(ValueError) as caught:
                read_in_pieces(output, [min(cut, len(output))], parser)
            assert str(caught.value) == whole, (len(output), cut)
    for python in (False, True):  # refused at once, not held until the end
        reader = rows_module.CopyRowsReader(python=python)
        with pytest.raises(ValueError, match="runs past the end"):
            reader.feed(huge)
    reader = rows_module.CopyRowsReader()  # a piece after the trailer
    reader.feed(data)
    with pytest.raises(ValueError, match="bytes after the binary COPY trailer"):
        reader.feed(b"\x00")


async def test_a_refused_output_leaves_the_connection_usable(conn: asyncpg.Connection) -> None:
    with pytest.raises(ValueError, match="NULL"):
        await copy_rows(conn, "select sequence, maybe from history order by sequence")
    assert await conn.fetchval("select count(*) from history") == len(TEXTS)
