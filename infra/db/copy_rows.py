"""Rows of ``(bigint, text or bytea)`` read with PostgreSQL's binary ``COPY ... TO STDOUT``.

The archiver reads the history a batch of up to 16,000 events (16 MiB) at a time. Through
``fetch`` every row becomes an asyncpg ``Record`` whose columns are then picked apart again; binary
COPY streams the same rows as one byte string, which one C call
(``protocol._hashes.copy_rows``) turns into the two lists the encoder takes. Measured on a
120,000-event history: about half the client CPU of ``fetch`` and a third less wall time. Without
the C extension, :func:`parse_copy_rows` parses the same format in Python (slower, same result).

Only integer arguments are inlined into the statement (COPY takes no bind parameters), as their
decimal text: nothing a client sends ever reaches it.
"""

from __future__ import annotations

import struct
from typing import Any

try:
    from protocol import _hashes as _native
except ImportError:  # built on install where a compiler and libssl-dev exist; see setup.py
    _native = None  # type: ignore[assignment]  # (the module or nothing)

_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
_HEADER = struct.Struct(">11sII")
_ROW = struct.Struct(">hiqi")  # field count, length of the integer (8), the integer, length of the bytes


def _parse_python(data: bytes) -> tuple[list[int], list[bytes]]:
    """What the C extension's ``copy_rows`` returns (and the ValueError it raises), in Python."""
    if len(data) < _HEADER.size:
        raise ValueError("not a binary COPY output (no signature)")
    signature, flags, extension = _HEADER.unpack_from(data)
    if signature != _SIGNATURE:
        raise ValueError("not a binary COPY output (no signature)")
    if flags & 0xFFFF0000:
        raise ValueError("binary COPY output with unknown critical flags")
    pos = _HEADER.size + extension
    if pos > len(data):
        raise ValueError("binary COPY header extension past the end")
    sequences: list[int] = []
    bodies: list[bytes] = []
    view = memoryview(data)
    while True:
        if len(data) - pos < 2:
            raise ValueError("binary COPY output ends without its trailer")
        if data[pos:pos + 2] == b"\xff\xff":
            pos += 2
            break
        # The same checks in the same order as the C parser, so both refuse alike.
        if data[pos:pos + 2] != b"\x00\x02":
            raise ValueError("binary COPY row without exactly two fields")
        if len(data) - pos < _ROW.size:
            raise ValueError("binary COPY row whose first field is not an 8-byte integer")
        _fields, size, number, length = _ROW.unpack_from(data, pos)
        if size != 8:
            raise ValueError("binary COPY row whose first field is not an 8-byte integer")
        if length == -1:
            raise ValueError("binary COPY row whose second field is NULL")
        pos += _ROW.size
        if length < 0 or length > len(data) - pos:
            raise ValueError("binary COPY row whose second field runs past the end")
        sequences.append(number)
        bodies.append(bytes(view[pos:pos + length]))
        pos += length
    if pos != len(data):
        raise ValueError("bytes after the binary COPY trailer")
    return sequences, bodies


def parse_copy_rows(data: bytes) -> tuple[list[int], list[bytes]]:
    """The (integers, byte strings) of a binary COPY output of ``(bigint, text or bytea)`` rows;
    ValueError when ``data`` is not exactly that."""
    if _native is not None:
        return _native.copy_rows(data)
    return _parse_python(data)


async def copy_rows(conn: Any, query: str) -> tuple[list[int], list[bytes]]:
    """The rows of ``query`` (a SELECT of a non-null bigint and a non-null text or bytea column,
    its arguments already inlined as integers) through binary COPY, as two lists."""
    chunks: list[bytes] = []

    async def sink(chunk: bytes) -> None:
        chunks.append(chunk)

    await conn.copy_from_query(query, output=sink, format="binary")
    return parse_copy_rows(b"".join(chunks))
