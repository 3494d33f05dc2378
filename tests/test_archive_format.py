"""The segment format (version 2; version 1 still decodes): deterministic round trips, and every kind of corruption refused with
its own typed error (a flipped byte anywhere, truncation, reordered frames, broken links)."""

from __future__ import annotations

import hashlib
import struct
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import archive as fmt
from protocol.archive import (
    GENESIS_HASH,
    ArchivedEvent,
    ArchiveFormatError,
    Stream,
    decode_segment,
    encode_segment,
    event_body,
    parse_segment_key,
    segment_key,
)
from protocol.merkle import CompactTree, leaf_hash, tree_root

LINEAGE = uuid.UUID("3f1e2d4c-5b6a-4978-8899-aabbccddeeff")


@st.composite
def segments(draw: st.DrawFn) -> tuple[Stream, uuid.UUID, int, bytes, list[ArchivedEvent]]:
    stream = draw(st.sampled_from(Stream))
    index = draw(st.integers(0, 50))
    previous = GENESIS_HASH if index == 0 else draw(st.binary(min_size=32, max_size=32).filter(
        lambda b: b != GENESIS_HASH))
    gaps = draw(st.lists(st.integers(1, 5), min_size=1, max_size=40))
    start = draw(st.integers(0, 1 << 40))
    sequences, s = [], start
    for g in gaps:
        s += g
        sequences.append(s)
    bodies = draw(st.lists(st.binary(max_size=300), min_size=len(sequences), max_size=len(sequences)))
    return stream, uuid.UUID(int=draw(st.integers(0, (1 << 128) - 1))), index, previous, [
        ArchivedEvent(q, b) for q, b in zip(sequences, bodies)]


def _sample(n: int = 5, index: int = 0, previous: bytes = GENESIS_HASH) -> tuple[list[ArchivedEvent], bytes]:
    events = [ArchivedEvent(10 + 2 * i, event_body({"sequence": 10 + 2 * i, "type": "message.appended",
                                                    "data": {"message": {"content": f"m{i}"}}}))
              for i in range(n)]
    return events, encode_segment(Stream.PUBLIC, LINEAGE, index, previous, events)


@settings(max_examples=150, deadline=None)
@given(segments())
def test_round_trip_is_exact_and_deterministic(seg: tuple[Stream, uuid.UUID, int, bytes, list[ArchivedEvent]]) -> None:
    stream, lineage, index, previous, events = seg
    data = encode_segment(stream, lineage, index, previous, events)
    # The bytes depend only on the inputs: encoding twice gives the same bytes, hence the same hash.
    assert encode_segment(stream, lineage, index, previous, list(events)) == data
    out = decode_segment(data, expected_previous_hash=previous, expected_lineage=lineage,
                         expected_index=index, expected_stream=stream)
    assert (out.stream, out.lineage, out.index, out.previous_hash) == (stream, lineage, index, previous)
    assert list(out.events) == events
    assert (out.first_sequence, out.last_sequence, out.event_count) == (
        events[0].sequence, events[-1].sequence, len(events))
    assert out.size == len(data)
    assert out.hash == hashlib.sha256(data[:-32]).digest() == fmt.segment_hash(data)
    assert out.merkle_root == tree_root([leaf_hash(e.body) for e in events])


def test_layout_is_the_documented_one() -> None:
    """Spot-check the byte offsets docs/archive-format.md gives, on a small known segment."""
    events, data = _sample(2, index=3, previous=b"\x11" * 32)
    assert data[:8] == b"TMSEG\r\n\x1a"
    assert struct.unpack(">HBB", data[8:12]) == (2, 0, 0)
    assert data[12:28] == LINEAGE.bytes
    assert struct.unpack(">QQQI", data[28:56]) == (3, 10, 12, 2)
    assert data[56:88] == b"\x11" * 32
    length, seq = struct.unpack(">IQ", data[88:100])
    assert (length, seq) == (len(events[0].body), 10)
    assert data[100:100 + length] == events[0].body
    assert len(data) == 88 + sum(16 + len(e.body) for e in events) + 64
    assert data[-64:-32] == tree_root([leaf_hash(e.body) for e in events])


def test_a_version_1_segment_still_decodes_and_change_bodies_follow_the_version() -> None:
    """Version 2 changed only what a public frame holds (the stored envelope text instead of its
    canonical re-encoding): a version-1 segment decodes and reports its version."""
    events, _ = _sample(3)
    old = decode_segment(encode_segment(Stream.PUBLIC, LINEAGE, 0, GENESIS_HASH, events, version=1))
    assert (old.version, [e.body for e in old.events]) == (1, [e.body for e in events])
    assert decode_segment(encode_segment(Stream.PUBLIC, LINEAGE, 0, GENESIS_HASH, events)).version == 2
    stored = '{"sequence":1,"type":"message.appended","data":{}}'
    assert fmt.change_body(stored) == stored.encode()
    assert fmt.change_body(stored, 1) == b'{"data":{},"sequence":1,"type":"message.appended"}'


def test_the_read_back_check_walks_frames_and_compares_the_hash() -> None:
    """check_read_back: the written hash, the link and identity, and every frame's CRC."""
    _, data = _sample(3, index=1, previous=b"\x22" * 32)
    good = decode_segment(data)
    expect = {"expected_hash": good.hash, "expected_previous_hash": b"\x22" * 32, "expected_lineage": LINEAGE,
              "expected_index": 1, "expected_stream": Stream.PUBLIC}
    assert fmt.check_read_back(data, **expect).event_count == 0  # type: ignore[arg-type]
    broken = bytearray(data)
    broken[88 + 12 + 3] ^= 0x04
    with pytest.raises(fmt.CrcMismatch):
        fmt.check_read_back(bytes(broken), **expect)  # type: ignore[arg-type]
    with pytest.raises(fmt.HashMismatch):
        fmt.check_read_back(data, **{**expect, "expected_hash": bytes(32)})  # type: ignore[arg-type]
    with pytest.raises(fmt.IdentityMismatch):
        fmt.check_read_back(data, **{**expect, "expected_index": 2})  # type: ignore[arg-type]


def test_segments_chain_and_the_history_tree_spans_them() -> None:
    """Consecutive segments link by hash; the whole-history root is one tree over all their leaves."""
    previous, tree, all_leaves = GENESIS_HASH, CompactTree(), []
    for index in range(4):
        events = [ArchivedEvent(index * 100 + i, b"e%d" % (index * 100 + i)) for i in range(1, 4 + index)]
        data = encode_segment(Stream.PUBLIC, LINEAGE, index, previous, events)
        seg = decode_segment(data, expected_previous_hash=previous)
        for e in seg.events:
            tree.append(e.body)
            all_leaves.append(e.leaf_hash)
        previous = seg.hash
    assert tree.root() == tree_root(all_leaves)


def _kind(data: bytes, **expect: object) -> str:
    with pytest.raises(ArchiveFormatError) as caught:
        decode_segment(data, **expect)  # type: ignore[arg-type]
    return caught.value.kind


def test_every_single_byte_flip_is_detected() -> None:
    _, data = _sample(3)
    kinds = set()
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            broken = bytearray(data)
            broken[i] ^= bit
            kinds.add(_kind(bytes(broken)))
    # Each region reports its own failure: header fields, frame CRCs, Merkle root and hash.
    assert {"bad_magic", "unsupported_version", "malformed_header", "crc_mismatch", "merkle_mismatch",
            "hash_mismatch"} <= kinds


@pytest.mark.parametrize("region,kind", [
    ("magic", "bad_magic"), ("version", "unsupported_version"), ("stream", "malformed_header"),
    ("reserved", "malformed_header"), ("event body", "crc_mismatch"), ("frame crc", "crc_mismatch"),
    ("lineage", "hash_mismatch"), ("previous hash", "hash_mismatch"), ("merkle root", "merkle_mismatch"),
    ("sha256", "hash_mismatch")])
def test_a_flip_in_each_region_names_that_region(region: str, kind: str) -> None:
    events, data = _sample(3, index=1, previous=b"\x22" * 32)
    offset = {"magic": 2, "version": 9, "stream": 10, "reserved": 11, "lineage": 20, "previous hash": 60,
              "event body": 88 + 12 + 3, "frame crc": 88 + 12 + len(events[0].body) + 1,
              "merkle root": len(data) - 50, "sha256": len(data) - 1}[region]
    broken = bytearray(data)
    broken[offset] ^= 0x04
    assert _kind(bytes(broken)) == kind


def test_crc_error_names_the_frame() -> None:
    events, data = _sample(4)
    second = 88 + 16 + len(events[0].body)
    broken = bytearray(data)
    broken[second + 12] ^= 0xFF
    with pytest.raises(fmt.CrcMismatch) as caught:
        decode_segment(bytes(broken))
    assert caught.value.offset == second and caught.value.sequence == events[1].sequence
    assert caught.value.report()["kind"] == "crc_mismatch"


@pytest.mark.parametrize("cut", [0, 5, 87, 88, 95, 120, -65, -33, -1])
def test_truncation_is_detected(cut: int) -> None:
    _, data = _sample(3)
    short = data[:cut] if cut >= 0 else data[:len(data) + cut]
    assert _kind(short) in {"truncated", "hash_mismatch", "merkle_mismatch", "crc_mismatch"}
    if 8 <= len(short) < 88 + 64:
        assert _kind(short) == "truncated"


def test_a_frame_cut_mid_way_is_truncated() -> None:
    _, data = _sample(3)
    # Drop the last 10 bytes of the last frame but keep a 64-byte trailer after it.
    cut = bytearray(data[:-64 - 10] + data[-64:])
    assert _kind(bytes(cut)) == "truncated"


def _frames(data: bytes) -> list[bytes]:
    out, pos = [], 88
    while pos < len(data) - 64:
        (length,) = struct.unpack_from(">I", data, pos)
        out.append(data[pos:pos + 16 + length])
        pos += 16 + length
    return out


def test_reordered_frames_are_detected() -> None:
    _, data = _sample(4)
    frames = _frames(data)
    swapped = data[:88] + frames[0] + frames[2] + frames[1] + frames[3] + data[-64:]
    assert _kind(swapped) == "sequence_order"
    duplicated = data[:88] + frames[0] + frames[0] + frames[2] + frames[3] + data[-64:]
    assert _kind(duplicated) == "sequence_order"


def test_frame_count_and_range_must_match_the_header() -> None:
    _, data = _sample(4)
    frames = _frames(data)
    assert _kind(data[:88] + b"".join(frames[:3]) + data[-64:]) == "count_mismatch"
    assert _kind(data[:88] + b"".join(frames) + frames[3] + data[-64:]) == "count_mismatch"
    # A consistent count but a header range that the frames do not cover.
    header = bytearray(data[:88])
    struct.pack_into(">Q", header, 44, struct.unpack_from(">Q", data, 44)[0] + 1)
    assert _kind(bytes(header) + data[88:]) == "range_mismatch"


def test_link_and_identity_expectations() -> None:
    _, first = _sample(3)
    head = decode_segment(first)
    _, second = _sample(3, index=1, previous=head.hash)
    decode_segment(second, expected_previous_hash=head.hash)
    assert _kind(second, expected_previous_hash=hashlib.sha256(b"another").digest()) == "broken_link"
    assert _kind(second, expected_lineage=uuid.uuid4()) == "identity_mismatch"
    assert _kind(second, expected_index=2) == "identity_mismatch"
    assert _kind(second, expected_stream=Stream.PRIVATE) == "identity_mismatch"


def test_not_a_segment_and_oversized_input() -> None:
    assert _kind(b"") == "truncated"
    assert _kind(b"PK\x03\x04 a zip file, not a segment" * 10) == "bad_magic"
    assert _kind(fmt.MAGIC + b"\x00" * 10) == "truncated"


def test_encoder_refuses_what_could_never_decode() -> None:
    with pytest.raises(ValueError):
        encode_segment(Stream.PUBLIC, LINEAGE, 0, GENESIS_HASH, [])
    with pytest.raises(ValueError):
        encode_segment(Stream.PUBLIC, LINEAGE, 0, GENESIS_HASH, [ArchivedEvent(2, b""), ArchivedEvent(2, b"")])
    with pytest.raises(ValueError):
        encode_segment(Stream.PUBLIC, LINEAGE, 1, GENESIS_HASH, [ArchivedEvent(1, b"")])
    with pytest.raises(ValueError):
        encode_segment(Stream.PUBLIC, LINEAGE, 0, b"\x01" * 32, [ArchivedEvent(1, b"")])
    with pytest.raises(ValueError):
        encode_segment(Stream.PUBLIC, LINEAGE, 0, GENESIS_HASH, [ArchivedEvent(1, b"x" * (fmt.MAX_EVENT_BYTES + 1))])


def test_keys_are_zero_padded_sortable_and_parse_back() -> None:
    key = segment_key(LINEAGE, 7, 12, 3456)
    assert key == f"{LINEAGE}/segments/0000000007-0000000000000000012-0000000000000003456"
    parsed = parse_segment_key(key)
    assert parsed is not None and (parsed.index, parsed.first_sequence, parsed.last_sequence) == (7, 12, 3456)
    assert parsed.stream is Stream.PUBLIC and parsed.lineage == LINEAGE
    private = parse_segment_key(segment_key(LINEAGE, 0, 1, 1, Stream.PRIVATE))
    assert private is not None and private.stream is Stream.PRIVATE
    keys = [segment_key(LINEAGE, i, i * 100 + 1, i * 100 + 99) for i in (10, 2, 1, 100)]
    assert sorted(keys) == [keys[2], keys[1], keys[0], keys[3]]
    for bad in [f"{LINEAGE}/segments/7-12-3456", f"{LINEAGE}/segments/0000000007-0000000000000000012",
                "orphan.bin", f"{LINEAGE}/segments/0000000007-0000000000000000099-0000000000000000012"]:
        assert parse_segment_key(bad) is None
    assert fmt.checkpoint_key(LINEAGE, 42) == f"{LINEAGE}/checkpoints/0000000000000000042"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_damage_raises_only_a_typed_format_error(draw: st.DataObject) -> None:
    """Random edits (overwrite, insert, delete, cut) never crash the decoder with anything but an
    ArchiveFormatError, and never pass."""
    _, data = _sample(4)
    broken = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        op = draw.draw(st.sampled_from(["overwrite", "insert", "delete", "cut"]))
        at = draw.draw(st.integers(0, max(0, len(broken) - 1)))
        if op == "overwrite" and broken:
            broken[at] = draw.draw(st.integers(0, 255).filter(lambda b, at=at: b != broken[at]))
        elif op == "insert":
            broken[at:at] = draw.draw(st.binary(min_size=1, max_size=20))
        elif op == "delete" and broken:
            del broken[at:at + draw.draw(st.integers(1, 20))]
        else:
            del broken[at:]
    if bytes(broken) == data:
        return
    with pytest.raises(ArchiveFormatError):
        decode_segment(bytes(broken))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_are_refused_cleanly(data: bytes) -> None:
    with pytest.raises(ArchiveFormatError):
        decode_segment(fmt.MAGIC + data)
