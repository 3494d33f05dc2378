"""The archive's segment format, version 2: deterministic bytes and a strict decoder (SPEC §5).

A segment holds a contiguous run of the change history (or of the private stream) as
length-prefixed frames, each with its sequence and a CRC32C, between a fixed header and a trailer
carrying the segment's Merkle subtree root and the SHA-256 of everything before it. The layout is
documented byte by byte in ``docs/archive-format.md``; this module is its reference implementation.

The bytes depend only on (stream, lineage, index, previous segment hash, events): no clock, no
host, no random padding, so re-encoding a sealed range gives the same hash after a restart.

:func:`decode_segment` refuses any corruption with a typed :class:`ArchiveFormatError` subclass whose
``kind`` names the failure (``truncated``, ``bad_magic``, ``crc_mismatch``, ...) and, where it
applies, the byte offset and sequence: the verifier reports those, never a bare "invalid".

Version 2 differs from version 1 only in what a public frame's event bytes are: the change's
stored envelope text exactly as ``changes.jsonl`` serves it (version 1: that envelope re-encoded as
canonical JSON, which cost more than everything else the archiver does per event). Both versions
decode; :func:`change_body` gives the event bytes of a stored change for either.

Pure: no I/O. The object store is ``infra/archive_store.py``; the Merkle tree ``protocol/merkle.py``.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import re
import struct
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import google_crc32c
import orjson

from protocol.corpus import canonical_json
from protocol.errors import ToastMachineError
from protocol.merkle import LEAF_PREFIX, Subtree, hash_leaves, leaf_hash, subtree

try:
    # The frames loops in C (protocol/_hashes.c, built by setup.py); without it, the pure-Python
    # lines below do the same work.
    from protocol import _hashes as _native
except ImportError:  # pragma: no cover - exercised only where the extension is not built
    _native = None  # type: ignore[assignment]  # (the module or nothing)

#: First 8 bytes of every segment. CR LF and 0x1A catch a file mangled by text-mode transfers.
MAGIC = b"TMSEG\r\n\x1a"
FORMAT_VERSION = 2
#: Versions :func:`decode_segment` reads (the layout is the same; see :func:`change_body`).
READABLE_VERSIONS = (1, 2)
HASH_SIZE = 32
#: The previous-segment hash of segment 0 of a lineage.
GENESIS_HASH = bytes(HASH_SIZE)

# magic, version u16, stream u8, reserved u8, lineage 16s, index u64, first u64, last u64,
# count u32, previous hash 32s; all big-endian.
_HEADER = struct.Struct(">8sHBB16sQQQI32s")
HEADER_SIZE = _HEADER.size  # 88
# length u32 (of the event bytes), sequence u64; the event bytes follow, then crc32c u32.
_FRAME_HEAD = struct.Struct(">IQ")
FRAME_OVERHEAD = _FRAME_HEAD.size + 4  # 16
_CRC = struct.Struct(">I")
TRAILER_SIZE = 2 * HASH_SIZE  # Merkle subtree root, then SHA-256 of every byte before it

#: Bounds the decoder enforces before allocating anything (the sealing rules stay far below them:
#: 500 events, 4 MiB plus one event).
MAX_EVENTS = 65_536
MAX_EVENT_BYTES = 1 << 20
MAX_SEGMENT_BYTES = 64 << 20
#: Sequences are PostgreSQL bigints.
MAX_SEQUENCE = (1 << 63) - 1
MAX_INDEX = 9_999_999_999


class Stream(enum.IntEnum):
    """Which history a segment belongs to: the public change history, or the private stream
    (operation records and the agent register; never served publicly)."""

    PUBLIC = 0
    PRIVATE = 1


# --- errors ----------------------------------------------------------------------------------------


class ArchiveFormatError(ToastMachineError):
    """A segment's bytes are not a valid version-1 segment. ``kind`` is a stable machine name."""

    kind: ClassVar[str] = "invalid"

    def __init__(self, message: str, *, offset: int | None = None, sequence: int | None = None) -> None:
        self.offset = offset
        self.sequence = sequence
        super().__init__(message)

    def report(self) -> dict[str, Any]:
        """The error as a JSON-able object for verification reports."""
        out: dict[str, Any] = {"kind": self.kind, "message": str(self)}
        if self.offset is not None:
            out["offset"] = self.offset
        if self.sequence is not None:
            out["sequence"] = self.sequence
        return out


class SegmentTruncated(ArchiveFormatError):
    """The bytes end before the header, a frame or the trailer is complete."""

    kind = "truncated"


class BadMagic(ArchiveFormatError):
    """The first 8 bytes are not :data:`MAGIC`: not a segment at all."""

    kind = "bad_magic"


class UnsupportedVersion(ArchiveFormatError):
    """A format version this code does not read."""

    kind = "unsupported_version"


class MalformedHeader(ArchiveFormatError):
    """A header field is out of its domain (unknown stream, reserved byte set, empty range...)."""

    kind = "malformed_header"


class CrcMismatch(ArchiveFormatError):
    """A frame's CRC32C does not match its length, sequence and event bytes."""

    kind = "crc_mismatch"


class SequenceOrder(ArchiveFormatError):
    """Frame sequences are not strictly increasing (a reordered or duplicated frame)."""

    kind = "sequence_order"


class CountMismatch(ArchiveFormatError):
    """The header's event count differs from the number of frames present."""

    kind = "count_mismatch"


class RangeMismatch(ArchiveFormatError):
    """The header's first/last sequence differ from the first/last frame's."""

    kind = "range_mismatch"


class MerkleRootMismatch(ArchiveFormatError):
    """The trailer's Merkle subtree root differs from the root recomputed from the frames."""

    kind = "merkle_mismatch"


class HashMismatch(ArchiveFormatError):
    """The trailer's SHA-256 differs from the hash of the bytes before it."""

    kind = "hash_mismatch"


class BrokenLink(ArchiveFormatError):
    """The segment's previous-segment hash is not the hash of the segment before it."""

    kind = "broken_link"


class IdentityMismatch(ArchiveFormatError):
    """A valid segment, but not the one expected (other lineage, stream or index)."""

    kind = "identity_mismatch"


# --- values ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArchivedEvent:
    """One frame: a sequence and the exact bytes archived for it (a leaf of the Merkle tree)."""

    sequence: int
    body: bytes

    @property
    def leaf_hash(self) -> bytes:
        """This event's RFC 6962 leaf hash, SHA-256(0x00 || body)."""
        return leaf_hash(self.body)


@dataclass(frozen=True, slots=True)
class DecodedSegment:
    """A segment that passed every check of :func:`decode_segment`."""

    stream: Stream
    lineage: uuid.UUID
    index: int
    first_sequence: int
    last_sequence: int
    previous_hash: bytes
    events: tuple[ArchivedEvent, ...]
    merkle_root: bytes
    #: SHA-256 of every byte before the hash itself: the segment's identity (manifest, ETag, link).
    hash: bytes
    size: int
    #: Each event's leaf hash, in frame order (computed once by the decoder for the root check).
    leaf_hashes: tuple[bytes, ...] = ()
    #: The segment's format version (one of :data:`READABLE_VERSIONS`).
    version: int = FORMAT_VERSION
    #: The events' Merkle subtree (full decodes only): give it to
    #: :meth:`~protocol.merkle.CompactTree.extend`, which then reuses the nodes the root check made.
    tree: Subtree | None = None

    @property
    def event_count(self) -> int:
        return len(self.events)


def event_body(envelope: Mapping[str, Any]) -> bytes:
    """A change's event bytes in a version-1 segment: the event envelope as canonical JSON (sorted
    keys, no whitespace), the same form the change history's payloads are hashed in."""
    return canonical_json(dict(envelope))


def change_body(stored: str, version: int = FORMAT_VERSION) -> bytes:
    """A change's event bytes in a segment of ``version``, from its stored envelope text (the
    ``changes.event`` column, which is what ``changes.jsonl`` serves): verbatim UTF-8 from version 2
    on, the canonical re-encoding (:func:`event_body`) in version 1."""
    if version == 1:
        return event_body(orjson.loads(stored))
    return stored.encode()


def encode_segment(stream: Stream, lineage: uuid.UUID, index: int, previous_hash: bytes,
                   events: Sequence[ArchivedEvent], *, version: int = FORMAT_VERSION) -> bytes:
    """The bytes of a segment (``version``: :data:`FORMAT_VERSION` unless re-encoding an old one).
    ValueError when the input could never decode (empty, unordered, out of bounds, a genesis link
    on a later segment or the reverse)."""
    return encode_frames(stream, lineage, index, previous_hash, [e.sequence for e in events],
                         [e.body for e in events], version=version)[0]


def encode_frames(stream: Stream, lineage: uuid.UUID, index: int, previous_hash: bytes,
                  sequences: Sequence[int], bodies: Sequence[bytes], *,
                  version: int = FORMAT_VERSION) -> tuple[bytes, list[bytes]]:
    """:func:`encode_segment` from parallel lists of sequences and event bytes; also returns every
    event's leaf hash, so a caller extending the stream's tree does not hash the events again."""
    frames, leaves = encode_body(sequences, bodies)
    (data,) = chain_segments(stream, lineage, index, previous_hash,
                             [SegmentBody(sequences[0], sequences[-1], len(sequences), frames)], version=version)
    return data, leaves


@dataclass(frozen=True, slots=True)
class SegmentBody:
    """A segment without its header and hash: what :func:`encode_body` makes, for :func:`chain_segments`."""

    first_sequence: int
    last_sequence: int
    event_count: int
    #: The frames and the Merkle subtree root (the trailer's first half).
    body: bytes


def encode_body(sequences: Sequence[int], bodies: Sequence[bytes]) -> tuple[bytes, list[bytes]]:
    """The frames of a segment followed by its Merkle subtree root, and every event's leaf hash.

    Everything of a segment that does not depend on the segment before it, so a batch's bodies can
    be made before their hashes are chained (:func:`chain_segments`). ValueError when the events
    could never decode (none, too many, unordered, out of bounds).
    """
    data, tree = encode_body_tree(sequences, bodies)
    return data, tree.leaves


def encode_body_tree(sequences: Sequence[int], bodies: Sequence[bytes]) -> tuple[bytes, Subtree]:
    """:func:`encode_body`, with the events' :class:`~protocol.merkle.Subtree` instead of only their
    leaf hashes, so a caller extending the stream's tree reuses the nodes the root was made of."""
    lengths = _check_events(sequences, bodies)
    tree = subtree(hash_leaves(bodies))
    if _native is not None:
        data = b"".join((_native.encode_frames(sequences, bodies), tree.root))
    else:
        # Whole-list steps (map over C callables) rather than a loop of statements: this runs once
        # per archived event, and the interpreter's per-statement cost is most of it.
        frames = list(map(bytes.__add__, map(_FRAME_HEAD.pack, lengths, sequences), bodies))
        parts: list[bytes] = [b""] * (2 * len(frames) + 1)
        parts[0:-1:2] = frames
        parts[1:-1:2] = map(_CRC.pack, map(google_crc32c.value, frames))
        parts[-1] = tree.root
        data = b"".join(parts)
    return data, tree


def encode_chain(stream: Stream, lineage: uuid.UUID, index: int, previous_hash: bytes,
                 segments: Sequence[tuple[Sequence[int], Sequence[bytes]]]) -> list[tuple[bytes, Subtree]]:
    """Consecutive segments ``index``, ``index + 1``, ... from their (sequences, event bytes), each
    linked to the one before (``previous_hash`` for the first), with each one's Merkle subtree:
    what :func:`encode_body_tree` then :func:`chain_segments` make, at the current format version.

    With the C extension, each segment is made in one buffer in one pass over its events (see
    ``build_segment`` in ``protocol/_hashes.c``), instead of being joined from its parts twice and
    read again for each hash. ValueError as those two raise it.
    """
    if _native is None:
        made = [encode_body_tree(sequences, bodies) for sequences, bodies in segments]
        datas = chain_segments(stream, lineage, index, previous_hash, [
            SegmentBody(sequences[0], sequences[-1], len(sequences), body)
            for (sequences, _), (body, _) in zip(segments, made)])
        return [(data, tree) for data, (_, tree) in zip(datas, made)]
    _check_chain(index, len(segments), previous_hash, FORMAT_VERSION)
    out: list[tuple[bytes, Subtree]] = []
    for i, (sequences, bodies) in enumerate(segments):
        _check_events(sequences, bodies)
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, int(stream), 0, lineage.bytes, index + i, sequences[0],
                              sequences[-1], len(sequences), previous_hash)
        # One pass over the events: each is copied into its frame while its CRC32C, its leaf hash and
        # the segment's SHA-256 are computed, then the subtree's levels and root.
        data, levels, root = _native.build_segment(header, sequences, bodies)
        previous_hash = data[-HASH_SIZE:]
        out.append((data, Subtree(levels, root)))
    return out


def _check_events(sequences: Sequence[int], bodies: Sequence[bytes]) -> list[int]:
    """The events' byte lengths; ValueError when they could never decode as one segment (none, too
    many, unordered, out of bounds, too large)."""
    count = len(sequences)
    if not count or len(bodies) != count:
        raise ValueError("a segment holds at least one event, each with a sequence and its bytes")
    if count > MAX_EVENTS:
        raise ValueError(f"a segment holds at most {MAX_EVENTS} events")
    if any(map(int.__ge__, sequences[:-1], sequences[1:])) or not 0 <= sequences[0] <= sequences[-1] <= MAX_SEQUENCE:
        raise ValueError(f"sequences must strictly increase within 0..{MAX_SEQUENCE}")
    lengths = list(map(len, bodies))
    if max(lengths) > MAX_EVENT_BYTES:
        raise ValueError(f"an event is larger than {MAX_EVENT_BYTES} bytes")
    if HEADER_SIZE + TRAILER_SIZE + FRAME_OVERHEAD * count + sum(lengths) > MAX_SEGMENT_BYTES:
        raise ValueError(f"a segment is at most {MAX_SEGMENT_BYTES} bytes")
    return lengths


def chain_segments(stream: Stream, lineage: uuid.UUID, index: int, previous_hash: bytes,
                   bodies: Sequence[SegmentBody], *, version: int = FORMAT_VERSION) -> list[bytes]:
    """Consecutive segments ``index``, ``index + 1``, ... from their bodies: each header links to the
    hash of the segment before (``previous_hash`` for the first), each segment ends with its hash.

    Only SHA-256 over large buffers, which releases the GIL: callers may run it in a thread.
    """
    _check_chain(index, len(bodies), previous_hash, version)
    out: list[bytes] = []
    for i, piece in enumerate(bodies):
        header = _HEADER.pack(MAGIC, version, int(stream), 0, lineage.bytes, index + i, piece.first_sequence,
                              piece.last_sequence, piece.event_count, previous_hash)
        digest = hashlib.sha256(header)
        digest.update(piece.body)
        previous_hash = digest.digest()
        out.append(b"".join((header, piece.body, previous_hash)))
    return out


def _check_chain(index: int, count: int, previous_hash: bytes, version: int) -> None:
    """ValueError unless ``count`` segments from ``index`` linking to ``previous_hash`` could decode."""
    if version not in READABLE_VERSIONS:
        raise ValueError(f"format version must be one of {READABLE_VERSIONS}")
    if not 0 <= index <= MAX_INDEX - count + 1:
        raise ValueError(f"segment index must be 0..{MAX_INDEX}")
    if len(previous_hash) != HASH_SIZE:
        raise ValueError("previous hash must be 32 bytes")
    if (index == 0) != (previous_hash == GENESIS_HASH):
        raise ValueError("segment 0, and only segment 0, links to the genesis hash")


def segment_hash(data: bytes) -> bytes:
    """The hash a segment's trailer claims (its last 32 bytes), without checking anything."""
    return bytes(data[-HASH_SIZE:])


def decode_segment(data: bytes, *, expected_previous_hash: bytes | None = None,
                   expected_lineage: uuid.UUID | None = None, expected_index: int | None = None,
                   expected_stream: Stream | None = None) -> DecodedSegment:
    """Parse and check a segment completely, or raise the :class:`ArchiveFormatError` that says why.

    Checks, in order: size bounds, magic, version, header domains, every frame (bounds, CRC32C,
    strictly increasing sequence), the frame count, the header's range, the Merkle subtree root, the
    SHA-256, then what the caller expects (previous hash: the link; lineage, index, stream).
    """
    segment = _walk(data, True)
    _expect(segment, expected_previous_hash, expected_lineage, expected_index, expected_stream)
    return segment


def check_read_back(data: bytes, *, expected_hash: bytes, expected_previous_hash: bytes,
                    expected_lineage: uuid.UUID, expected_index: int, expected_stream: Stream,
                    computed_hash: bytes | None = None, written: bytes | None = None) -> DecodedSegment:
    """The archiver's check of a segment it wrote and read back: the read-back bytes are re-hashed
    (SHA-256 of ``data[:-32]``), which must equal both the trailer and ``expected_hash``, and the
    header must name the expected lineage, index, stream and previous hash.

    ``written``: the bytes this process encoded and put for this segment, when it still holds them.
    Then the read-back bytes must be identical to them, and that is the whole frame check: those
    bytes are the encoder's output for the recorded decision (range, link, tree size), and identical
    bytes have identical frames, CRCs and root; walking them again would only test the encoder
    against itself. Without ``written`` (a segment written by an earlier run and read back after a
    restart), every frame and CRC32C is walked as :func:`decode_segment` does, the Merkle root
    apart: the SHA-256 covers the root bytes, and ``expected_hash`` is the hash of the bytes
    encoded, whose root was computed from these same frames.

    The result has no events (``events`` and ``leaf_hashes`` are empty); its counts and range are
    the header's (checked against the frames when they are walked).

    ``computed_hash``: the SHA-256 of ``data[:-32]`` when the caller computed it already (e.g. in a
    thread, beside this check), so it is not computed twice.
    """
    if written is None:
        segment = _walk(data, False, computed_hash)
    else:
        if data != written:
            at = next((i for i, (a, b) in enumerate(zip(data, written)) if a != b), min(len(data), len(written)))
            raise HashMismatch(f"segment {expected_index} read back differs from the {len(written)} bytes written "
                               f"({len(data)} bytes, first difference at byte {at})", offset=at)
        segment = _header_only(data, computed_hash)
    if segment.hash != expected_hash:
        raise HashMismatch(f"segment {segment.index} read back hashes to {segment.hash.hex()}, "
                           f"{expected_hash.hex()} was written", offset=len(data) - HASH_SIZE)
    _expect(segment, expected_previous_hash, expected_lineage, expected_index, expected_stream)
    return segment


def _header_only(data: bytes, computed_hash: bytes | None) -> DecodedSegment:
    """The header of bytes identical to an encoder's output, with their SHA-256 recomputed: the
    trailer's hash must match it (HashMismatch otherwise)."""
    n = len(data)
    if n < HEADER_SIZE + TRAILER_SIZE or data[:8] != MAGIC:
        raise SegmentTruncated(f"{n} bytes is not a segment", offset=0)
    (_magic, version, stream_code, _reserved, lineage_raw, index, first, last, _count,
     previous_hash) = _HEADER.unpack_from(data, 0)
    digest = bytes(data[n - HASH_SIZE:])
    if (computed_hash or hashlib.sha256(memoryview(data)[:n - HASH_SIZE]).digest()) != digest:
        raise HashMismatch("the trailer's SHA-256 is not the hash of the segment", offset=n - HASH_SIZE)
    return DecodedSegment(Stream(stream_code), uuid.UUID(bytes=lineage_raw), index, first, last,
                          bytes(previous_hash), (), bytes(data[n - TRAILER_SIZE:n - HASH_SIZE]), digest, n, (),
                          version)


def _walk(data: bytes, full: bool, computed_hash: bytes | None = None) -> DecodedSegment:
    """Check a segment's bytes; ``full``: also build its events and leaf hashes and check its root."""
    n = len(data)
    if n > MAX_SEGMENT_BYTES:
        raise MalformedHeader(f"{n} bytes is more than a segment may hold ({MAX_SEGMENT_BYTES})")
    if n < 8:
        raise SegmentTruncated(f"{n} bytes is shorter than the magic", offset=n)
    data = bytes(data)
    if data[:8] != MAGIC:
        raise BadMagic("the first 8 bytes are not a ToastMachine segment's magic", offset=0)
    if n < HEADER_SIZE + TRAILER_SIZE:
        raise SegmentTruncated(f"{n} bytes is shorter than a header and trailer "
                               f"({HEADER_SIZE + TRAILER_SIZE})", offset=n)
    (_magic, version, stream_code, reserved, lineage_raw, index, first, last, count,
     previous_hash) = _HEADER.unpack_from(data, 0)
    if version not in READABLE_VERSIONS:
        raise UnsupportedVersion(f"format version {version}; this reader knows "
                                 f"{', '.join(map(str, READABLE_VERSIONS))}", offset=8)
    try:
        stream = Stream(stream_code)
    except ValueError:
        raise MalformedHeader(f"unknown stream {stream_code}", offset=10) from None
    if reserved != 0:
        raise MalformedHeader("the reserved header byte is not zero", offset=11)
    if index > MAX_INDEX:
        raise MalformedHeader(f"segment index {index} is above {MAX_INDEX}", offset=28)
    if not 0 <= first <= last <= MAX_SEQUENCE:
        raise MalformedHeader(f"sequence range {first}..{last} is empty or out of bounds", offset=36)
    if not 1 <= count <= MAX_EVENTS or count > last - first + 1:
        raise MalformedHeader(f"event count {count} does not fit the range {first}..{last}", offset=52)
    if (index == 0) != (previous_hash == GENESIS_HASH):
        raise MalformedHeader("segment 0, and only segment 0, links to the genesis hash", offset=56)

    frames_end = n - TRAILER_SIZE
    sha256 = hashlib.sha256
    # Two ways through the frames: the fast one proves them all sound with whole-list steps and
    # returns None at the first doubt; the exact one, a frame at a time, then finds and names the
    # first fault (or, had the fast one doubted wrongly, does the whole work itself).
    fast = _frames_fast(data, frames_end, count, first, last, full)
    if fast is not None:
        sequences, bodies, leaves = fast
        events = tuple(map(ArchivedEvent, sequences, bodies)) if full else ()
    else:
        events, leaves = _frames_exact(data, frames_end, count, first, last, full)
    merkle_root = data[frames_end:frames_end + HASH_SIZE]
    tree = subtree(leaves) if full else None
    if tree is not None and tree.root != merkle_root:
        raise MerkleRootMismatch("the trailer's Merkle root is not the root of these frames", offset=frames_end)
    digest = data[n - HASH_SIZE:]
    if (computed_hash or sha256(memoryview(data)[:n - HASH_SIZE]).digest()) != digest:
        raise HashMismatch("the trailer's SHA-256 is not the hash of the segment", offset=n - HASH_SIZE)
    return DecodedSegment(stream, uuid.UUID(bytes=lineage_raw), index, first, last, bytes(previous_hash),
                          events, merkle_root, digest, n, tuple(leaves), version, tree)


def _frames_fast(data: bytes, frames_end: int, count: int, first: int, last: int,
                 full: bool) -> tuple[list[int], list[bytes], list[bytes]] | None:
    """Every frame's sequence and (``full``) event bytes and leaf hashes when the frames are
    exactly ``count`` well-formed frames from ``first`` to ``last`` in strictly increasing order
    with good CRC32Cs; None at the first doubt, without saying which (:func:`_frames_exact` does)."""
    if _native is not None:
        scanned = _native.scan_frames(data, HEADER_SIZE, frames_end, count, MAX_EVENT_BYTES, full)
        if scanned is None or scanned[0][0] != first or scanned[0][-1] != last:
            return None
        return scanned
    unpack_head, head_size = _FRAME_HEAD.unpack_from, _FRAME_HEAD.size
    starts: list[int] = []
    sequences: list[int] = []
    crc_ats: list[int] = []
    pos = HEADER_SIZE
    # Only what finding the next frame needs, per frame; everything else below in whole-list steps.
    for _ in range(count):
        if pos >= frames_end:
            return None
        length, sequence = unpack_head(data, pos)  # pos < frames_end: the trailer keeps 12 bytes in range
        starts.append(pos)
        sequences.append(sequence)
        pos += head_size + length
        crc_ats.append(pos)
        pos += 4
    if pos != frames_end or sequences[0] != first or sequences[-1] != last:
        return None
    if max(map(int.__sub__, crc_ats, starts)) > head_size + MAX_EVENT_BYTES:
        return None
    if not all(map(int.__lt__, sequences, itertools.islice(sequences, 1, None))):
        return None
    frames = list(map(data.__getitem__, map(slice, starts, crc_ats)))
    # unpack_from gives 1-tuples, and so does zip() of one list.
    if list(map(_CRC.unpack_from, itertools.repeat(data), crc_ats)) != list(zip(map(google_crc32c.value, frames))):
        return None
    bodies = list(map(data.__getitem__, map(slice, map(head_size.__add__, starts), crc_ats))) if full else []
    return sequences, bodies, hash_leaves(bodies)


def _frames_exact(data: bytes, frames_end: int, count: int, first: int, last: int,
                  full: bool) -> tuple[tuple[ArchivedEvent, ...], list[bytes]]:
    """The events and leaf hashes (``full``), a frame at a time; the ArchiveFormatError of the
    first fault."""
    events: list[ArchivedEvent] = []
    leaves: list[bytes] = []
    sha256, crc32c, unpack_head, unpack_crc = hashlib.sha256, google_crc32c.value, _FRAME_HEAD.unpack_from, \
        _CRC.unpack_from
    head_size = _FRAME_HEAD.size
    frames = 0
    pos = HEADER_SIZE
    first_sequence = previous_sequence = -1
    while pos < frames_end:
        if frames == count:
            raise CountMismatch(f"the header counts {count} events but more frames follow", offset=pos)
        if pos + head_size > frames_end:
            raise SegmentTruncated(f"frame {frames} at byte {pos} is cut short", offset=pos)
        length, sequence = unpack_head(data, pos)
        crc_at = pos + head_size + length
        if length > MAX_EVENT_BYTES or crc_at + 4 > frames_end:
            raise SegmentTruncated(f"frame {frames} at byte {pos} claims {length} bytes that are not there",
                                   offset=pos)
        # The CRC covers the frame's length, sequence and event bytes: one contiguous slice.
        if crc32c(data[pos:crc_at]) != unpack_crc(data, crc_at)[0]:
            raise CrcMismatch(f"frame {frames} at byte {pos} fails its CRC32C", offset=pos, sequence=sequence)
        if sequence <= previous_sequence:
            raise SequenceOrder(f"frame {frames} has sequence {sequence} after {previous_sequence}",
                                offset=pos, sequence=sequence)
        if frames == 0:
            first_sequence = sequence
        previous_sequence = sequence
        if full:
            body = data[pos + head_size:crc_at]
            events.append(ArchivedEvent(sequence, body))
            leaves.append(sha256(LEAF_PREFIX + body).digest())
        frames += 1
        pos = crc_at + 4
    if frames != count:
        raise CountMismatch(f"the header counts {count} events but {frames} frames are present",
                            offset=52)
    if first_sequence != first or previous_sequence != last:
        raise RangeMismatch(f"the header says {first}..{last}, the frames hold "
                            f"{first_sequence}..{previous_sequence}", offset=36)
    return tuple(events), leaves


def _expect(segment: DecodedSegment, previous_hash: bytes | None, lineage: uuid.UUID | None,
            index: int | None, stream: Stream | None) -> None:
    """Raise BrokenLink or IdentityMismatch when ``segment`` is not the one the caller expects."""
    if previous_hash is not None and segment.previous_hash != previous_hash:
        raise BrokenLink(f"segment {segment.index} links to {segment.previous_hash.hex()}, the previous segment "
                         f"is {previous_hash.hex()}", offset=56)
    if lineage is not None and segment.lineage != lineage:
        raise IdentityMismatch(f"segment belongs to lineage {segment.lineage}, expected {lineage}", offset=12)
    if index is not None and segment.index != index:
        raise IdentityMismatch(f"segment has index {segment.index}, expected {index}", offset=28)
    if stream is not None and segment.stream != stream:
        raise IdentityMismatch(f"segment is in the {segment.stream.name.lower()} stream, expected "
                               f"{stream.name.lower()}", offset=10)


# --- object keys -----------------------------------------------------------------------------------

_STREAM_DIR = {Stream.PUBLIC: "segments", Stream.PRIVATE: "private/segments"}
_SEGMENT_KEY = re.compile(r"(?P<lineage>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/"
                          r"(?P<dir>segments|private/segments)/"
                          r"(?P<index>[0-9]{10})-(?P<first>[0-9]{19})-(?P<last>[0-9]{19})")


def segment_name(index: int, first: int, last: int) -> str:
    """``<index>-<first>-<last>``, zero-padded (10, 19, 19 digits) so names sort in history order."""
    if not (0 <= index <= MAX_INDEX and 0 <= first <= last <= MAX_SEQUENCE):
        raise ValueError("segment index or range out of bounds")
    return f"{index:010d}-{first:019d}-{last:019d}"


def segment_key(lineage: uuid.UUID, index: int, first: int, last: int, stream: Stream = Stream.PUBLIC) -> str:
    """The object key of a segment: ``<lineage>/segments/<name>`` (private: ``<lineage>/private/segments/<name>``)."""
    return f"{lineage}/{_STREAM_DIR[stream]}/{segment_name(index, first, last)}"


@dataclass(frozen=True, slots=True)
class SegmentKey:
    """A parsed segment key."""

    lineage: uuid.UUID
    stream: Stream
    index: int
    first_sequence: int
    last_sequence: int


def parse_segment_key(key: str) -> SegmentKey | None:
    """The parts of a segment key, or None when ``key`` is not one (e.g. an orphan object)."""
    m = _SEGMENT_KEY.fullmatch(key)
    if m is None:
        return None
    first, last = int(m["first"]), int(m["last"])
    if first > last or last > MAX_SEQUENCE:
        return None
    stream = Stream.PUBLIC if m["dir"] == "segments" else Stream.PRIVATE
    return SegmentKey(uuid.UUID(m["lineage"]), stream, int(m["index"]), first, last)


def checkpoint_key(lineage: uuid.UUID, size: int) -> str:
    """``<lineage>/checkpoints/<size>`` (19 digits): every checkpoint ever published, write-once."""
    if not 0 <= size <= MAX_SEQUENCE:
        raise ValueError("tree size out of bounds")
    return f"{lineage}/checkpoints/{size:019d}"


def private_checkpoint_key(lineage: uuid.UUID, size: int) -> str:
    """``<lineage>/private/checkpoints/<size>``: the private stream's checkpoints (never served)."""
    return f"{lineage}/private/{checkpoint_key(lineage, size).split('/', 1)[1]}"


def manifest_key(lineage: uuid.UUID) -> str:
    """``<lineage>/manifest.json``: the one object that is replaced as segments are published."""
    return f"{lineage}/manifest.json"


#: Where a lineage's manifest pages are: ``<lineage>/manifest-pages/<first index>-<last index>``.
MANIFEST_PAGES_DIR = "manifest-pages"


def manifest_page_name(first_index: int, last_index: int) -> str:
    """``<first index>-<last index>`` of a manifest page, zero-padded (10 digits each) so names sort
    in history order."""
    if not 0 <= first_index <= last_index <= MAX_INDEX:
        raise ValueError("manifest page indexes out of bounds")
    return f"{first_index:010d}-{last_index:010d}"


def manifest_page_key(lineage: uuid.UUID, first_index: int, last_index: int) -> str:
    """``<lineage>/manifest-pages/<name>``: a write-once page of the manifest's segment list."""
    return f"{lineage}/{MANIFEST_PAGES_DIR}/{manifest_page_name(first_index, last_index)}"


def public_key_key(lineage: uuid.UUID) -> str:
    """``<lineage>/public-key.txt``: the checkpoint signer's note verifier key."""
    return f"{lineage}/public-key.txt"


def leaf_hashes(segments: Iterable[DecodedSegment]) -> list[bytes]:
    """Every leaf hash of the given segments, in order: the leaves of the history's tree."""
    return [h for s in segments for h in (s.leaf_hashes or tuple(e.leaf_hash for e in s.events))]
