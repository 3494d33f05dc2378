"""The C extension ``protocol._hashes`` and the pure-Python fallbacks compute the same bytes: leaf and
node hashes, CRC32C, frames, whole segments, decoded segments and the history's tree; a damaged
segment is refused with the same typed error either way; the read-back check against the bytes
written; the Merkle subtree reused by the history's tree."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import _hashes, merkle
from protocol import archive as fmt
from protocol.archive import (
    GENESIS_HASH,
    ArchivedEvent,
    ArchiveFormatError,
    Stream,
    decode_segment,
    encode_segment,
)
from protocol.merkle import CompactTree, leaf_hash, node_hash, subtree, tree_root

LINEAGE = uuid.UUID("3f1e2d4c-5b6a-4978-8899-aabbccddeeff")


@pytest.fixture
def pure() -> Iterator[None]:
    """The pure-Python fallbacks, as where the extension is not built."""
    saved = fmt._native, merkle._native
    fmt._native = merkle._native = None  # type: ignore[assignment]
    try:
        yield
    finally:
        fmt._native, merkle._native = saved


def test_the_extension_is_built_here() -> None:
    """This machine kind has gcc and libssl-dev: `pip install -e .` builds it, so the fast path is
    the one measured and tested."""
    assert merkle.NATIVE_HASHES


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=40))
def test_leaf_hashes_and_crc32c_match_hashlib_and_google_crc32c(bodies: list[bytes]) -> None:
    assert _hashes.leaf_hashes(bodies) == [leaf_hash(b) for b in bodies]
    assert [_hashes.crc32c(b) for b in bodies] == [google_crc32c.value(b) for b in bodies]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=32, max_size=32), max_size=41))
def test_node_hashes_pair_neighbours_and_leave_an_odd_one_out(level: list[bytes]) -> None:
    assert _hashes.node_hashes(level) == [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]


def test_the_extension_refuses_what_is_not_bytes() -> None:
    with pytest.raises(TypeError):
        _hashes.leaf_hashes(["text"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        _hashes.node_hashes([b"short", b"x" * 32])
    with pytest.raises(ValueError):
        _hashes.encode_frames([1, 2], [b"a"])


@st.composite
def histories(draw: st.DrawFn) -> list[list[ArchivedEvent]]:
    """Consecutive segments of increasing sequences, of sizes that hit every alignment."""
    out, sequence = [], draw(st.integers(0, 1 << 40))
    for size in draw(st.lists(st.integers(1, 70), min_size=1, max_size=6)):
        events = []
        for body in draw(st.lists(st.binary(max_size=200), min_size=size, max_size=size)):
            sequence += draw(st.integers(1, 3))
            events.append(ArchivedEvent(sequence, body))
        out.append(events)
    return out


def _encode_all(history: list[list[ArchivedEvent]]) -> tuple[list[bytes], bytes]:
    previous, datas, tree = GENESIS_HASH, [], CompactTree()
    for index, events in enumerate(history):
        data = encode_segment(Stream.PUBLIC, LINEAGE, index, previous, events)
        segment = decode_segment(data, expected_previous_hash=previous, expected_index=index)
        assert list(segment.events) == events and segment.tree is not None
        tree.extend(segment.tree)
        previous = segment.hash
        datas.append(data)
    return datas, tree.root()


@settings(max_examples=60, deadline=None)
@given(histories())
def test_native_and_pure_python_make_and_read_the_same_segments(history: list[list[ArchivedEvent]]) -> None:
    native = _encode_all(history)
    saved = fmt._native, merkle._native
    fmt._native = merkle._native = None  # type: ignore[assignment]
    try:
        assert _encode_all(history) == native
    finally:
        fmt._native, merkle._native = saved
    leaves = [leaf_hash(e.body) for events in history for e in events]
    assert native[1] == tree_root(leaves)


@pytest.mark.parametrize("mode", ["native", "pure"])
def test_every_byte_flip_gets_the_same_typed_error_either_way(mode: str, request: pytest.FixtureRequest) -> None:
    events = [ArchivedEvent(5 + i, b"event %d" % i) for i in range(4)]
    data = encode_segment(Stream.PUBLIC, LINEAGE, 0, GENESIS_HASH, events)
    kinds = _flip_errors(data)
    if mode == "pure":
        request.getfixturevalue("pure")
        assert _flip_errors(data) == kinds
    assert "crc_mismatch" in {k for k, _ in kinds}


def test_the_read_back_check_against_the_written_bytes() -> None:
    """With the bytes written at hand, the read-back must be identical and re-hash to the
    recorded hash; a difference anywhere is reported with its offset."""
    events = [ArchivedEvent(1 + i, b"x" * i) for i in range(6)]
    data = encode_segment(Stream.PRIVATE, LINEAGE, 3, b"\x07" * 32, events)
    expect = {"expected_hash": data[-32:], "expected_previous_hash": b"\x07" * 32, "expected_lineage": LINEAGE,
              "expected_index": 3, "expected_stream": Stream.PRIVATE}
    checked = fmt.check_read_back(data, written=data, **expect)  # type: ignore[arg-type]
    assert (checked.index, checked.size, checked.hash) == (3, len(data), hashlib.sha256(data[:-32]).digest())
    broken = bytearray(data)
    broken[200] ^= 1
    with pytest.raises(fmt.HashMismatch) as caught:
        fmt.check_read_back(bytes(broken), written=data, **expect)  # type: ignore[arg-type]
    assert caught.value.offset == 200
    with pytest.raises(fmt.HashMismatch):
        fmt.check_read_back(data[:-1], written=data, **expect)  # type: ignore[arg-type]
    # Identical bytes, but not those recorded: the re-hash is compared with the row's hash.
    with pytest.raises(fmt.HashMismatch):
        fmt.check_read_back(data, written=data, **{**expect, "expected_hash": bytes(32)})  # type: ignore[arg-type]
    with pytest.raises(fmt.IdentityMismatch):
        fmt.check_read_back(data, written=data, **{**expect, "expected_index": 4})  # type: ignore[arg-type]
    with pytest.raises(fmt.BrokenLink):
        fmt.check_read_back(data, written=data, **{**expect, "expected_previous_hash": bytes(32)})  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=8))
def test_a_subtree_extends_the_tree_as_its_leaves_do(sizes: list[int]) -> None:
    plain, reused = CompactTree(), CompactTree()
    leaves: list[bytes] = []
    for n in sizes:
        batch = [hashlib.sha256(b"%d" % (len(leaves) + i)).digest() for i in range(n)]
        leaves += batch
        part = subtree(batch)
        assert part.root == tree_root(batch) and part.size == n
        plain.extend(batch)
        reused.extend(part)
        assert (reused.size, reused.frontier) == (plain.size, plain.frontier)
        assert reused.root() == tree_root(leaves)


@settings(max_examples=60, deadline=None)
@given(histories(), st.integers(0, 5))
def test_encode_chain_is_encode_segment_linked_either_way(history: list[list[ArchivedEvent]], start: int) -> None:
    previous = GENESIS_HASH if start == 0 else b"\x05" * 32
    segments = [([e.sequence for e in events], [e.body for e in events]) for events in history]
    made = fmt.encode_chain(Stream.PRIVATE, LINEAGE, start, previous, segments)
    expected, link = [], previous
    for i, events in enumerate(history):
        expected.append(encode_segment(Stream.PRIVATE, LINEAGE, start + i, link, events))
        link = expected[-1][-32:]
    assert [data for data, _ in made] == expected
    assert [tree.root for _, tree in made] == [decode_segment(d).merkle_root for d in expected]
    assert [tree.levels for _, tree in made] == [subtree([leaf_hash(e.body) for e in events]).levels
                                                 for events in history]
    saved = fmt._native, merkle._native
    fmt._native = merkle._native = None  # type: ignore[assignment]
    try:
        assert [data for data, _ in fmt.encode_chain(Stream.PRIVATE, LINEAGE, start, previous, segments)] == expected
    finally:
        fmt._native, merkle._native = saved
    with pytest.raises(ValueError):
        fmt.encode_chain(Stream.PRIVATE, LINEAGE, start + 1, GENESIS_HASH, segments)  # genesis link on a later one


def _flip_errors(data: bytes) -> list[tuple[str, int | None]]:
    """The (kind, offset) that decoding reports for ``data`` with each byte flipped in turn."""
    kinds = []
    for at in range(len(data)):
        broken = bytearray(data)
        broken[at] ^= 0x10
        with pytest.raises(ArchiveFormatError) as caught:
            decode_segment(bytes(broken))
        kinds.append((caught.value.kind, caught.value.offset))
    return kinds
