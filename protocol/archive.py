"""The archive's segment format, version 1: deterministic bytes and a strict decoder (SPEC §5).

A segment holds a contiguous run of the change history (or of the private stream) as
length-prefixed frames, each with its sequence and a CRC32C, between a fixed header and a trailer
carrying the segment's Merkle subtree root and the SHA-256 of everything before it. The layout is
documented byte by byte in ``docs/archive-format.md``; this module is its reference implementation.

The bytes depend only on (stream, lineage, index, previous segment hash, events): no clock, no
host, no random padding, so re-encoding a sealed range gives the same hash after a restart.

:func:`decode_segment` refuses any corruption with a typed :class:`ArchiveFormatError` subclass whose
``kind`` names the failure (``truncated``, ``bad_magic``, ``crc_mismatch``, ...) and, where it
applies, the byte offset and sequence: the verifier reports those, never a bare "invalid".

Pure: no I/O. The object store is ``infra/archive_store.py``; the Merkle tree ``protocol/merkle.py``.
"""

from __future__ import annotations

import enum
import hashlib
import re
import struct
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import google_crc32c

from protocol.corpus import canonical_json
from protocol.errors import ToastMachineError
from protocol.merkle import leaf_hash, tree_root

#: First 8 bytes of every segment. CR LF and 0x1A catch a file mangled by text-mode transfers.
MAGIC = b"TMSEG\r\n\x1a"
FORMAT_VERSION = 1
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

    @property
    def event_count(self) -> int:
        return len(self.events)


def event_body(envelope: Mapping[str, Any]) -> bytes:
    """The archived bytes of a change: the event envelope as canonical JSON (sorted keys, no
    whitespace), the same form the change history's payloads are hashed in."""
    return canonical_json(dict(envelope))


def encode_segment(stream: Stream, lineage: uuid.UUID, index: int, previous_hash: bytes,
                   events: Sequence[ArchivedEvent]) -> bytes:
    """The version-1 bytes of a segment. ValueError when the input could never decode (empty,
    unordered, out of bounds, a genesis link on a later segment or the reverse)."""
    if not events:
        raise ValueError("a segment holds at least one event")
    if len(events) > MAX_EVENTS:
        raise ValueError(f"a segment holds at most {MAX_EVENTS} events")
    if not 0 <= index <= MAX_INDEX:
        raise ValueError(f"segment index must be 0..{MAX_INDEX}")
    if len(previous_hash) != HASH_SIZE:
        raise ValueError("previous hash must be 32 bytes")
    if (index == 0) != (previous_hash == GENESIS_HASH):
        raise ValueError("segment 0, and only segment 0, links to the genesis hash")
    last = -1
    for e in events:
        if not last < e.sequence <= MAX_SEQUENCE:
            raise ValueError(f"sequences must strictly increase within 0..{MAX_SEQUENCE}")
        if len(e.body) > MAX_EVENT_BYTES:
            raise ValueError(f"event {e.sequence} is larger than {MAX_EVENT_BYTES} bytes")
        last = e.sequence
    parts = [_HEADER.pack(MAGIC, FORMAT_VERSION, int(stream), 0, lineage.bytes, index,
                          events[0].sequence, events[-1].sequence, len(events), previous_hash)]
    for e in events:
        head = _FRAME_HEAD.pack(len(e.body), e.sequence)
        parts += (head, e.body, _CRC.pack(google_crc32c.extend(google_crc32c.value(head), e.body)))
    parts.append(tree_root([e.leaf_hash for e in events]))
    body = b"".join(parts)
    if len(body) + HASH_SIZE > MAX_SEGMENT_BYTES:
        raise ValueError(f"a segment is at most {MAX_SEGMENT_BYTES} bytes")
    return body + hashlib.sha256(body).digest()


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
    n = len(data)
    if n > MAX_SEGMENT_BYTES:
        raise MalformedHeader(f"{n} bytes is more than a segment may hold ({MAX_SEGMENT_BYTES})")
    if n < 8:
        raise SegmentTruncated(f"{n} bytes is shorter than the magic", offset=n)
    view = memoryview(data)
    if bytes(view[:8]) != MAGIC:
        raise BadMagic("the first 8 bytes are not a ToastMachine segment's magic", offset=0)
    if n < HEADER_SIZE + TRAILER_SIZE:
        raise SegmentTruncated(f"{n} bytes is shorter than a header and trailer "
                               f"({HEADER_SIZE + TRAILER_SIZE})", offset=n)
    (_magic, version, stream_code, reserved, lineage_raw, index, first, last, count,
     previous_hash) = _HEADER.unpack_from(view, 0)
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"format version {version}; this reader knows {FORMAT_VERSION}", offset=8)
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
    events: list[ArchivedEvent] = []
    pos = HEADER_SIZE
    previous_sequence = -1
    while pos < frames_end:
        if len(events) == count:
            raise CountMismatch(f"the header counts {count} events but more frames follow", offset=pos)
        if pos + _FRAME_HEAD.size > frames_end:
            raise SegmentTruncated(f"frame {len(events)} at byte {pos} is cut short", offset=pos)
        length, sequence = _FRAME_HEAD.unpack_from(view, pos)
        body_start = pos + _FRAME_HEAD.size
        crc_at = body_start + length
        if length > MAX_EVENT_BYTES or crc_at + 4 > frames_end:
            raise SegmentTruncated(f"frame {len(events)} at byte {pos} claims {length} bytes that are not there",
                                   offset=pos)
        # google_crc32c takes bytes, not memoryviews; the body is kept as bytes anyway.
        head = bytes(view[pos:body_start])
        body = bytes(view[body_start:crc_at])
        (crc,) = _CRC.unpack_from(view, crc_at)
        if google_crc32c.extend(google_crc32c.value(head), body) != crc:
            raise CrcMismatch(f"frame {len(events)} at byte {pos} fails its CRC32C", offset=pos, sequence=sequence)
        if sequence <= previous_sequence:
            raise SequenceOrder(f"frame {len(events)} has sequence {sequence} after {previous_sequence}",
                                offset=pos, sequence=sequence)
        previous_sequence = sequence
        events.append(ArchivedEvent(sequence, body))
        pos = crc_at + 4
    if len(events) != count:
        raise CountMismatch(f"the header counts {count} events but {len(events)} frames are present",
                            offset=52)
    if events[0].sequence != first or events[-1].sequence != last:
        raise RangeMismatch(f"the header says {first}..{last}, the frames hold "
                            f"{events[0].sequence}..{events[-1].sequence}", offset=36)
    merkle_root = bytes(view[frames_end:frames_end + HASH_SIZE])
    if tree_root([e.leaf_hash for e in events]) != merkle_root:
        raise MerkleRootMismatch("the trailer's Merkle root is not the root of these frames", offset=frames_end)
    digest = bytes(view[n - HASH_SIZE:])
    if hashlib.sha256(view[:n - HASH_SIZE]).digest() != digest:
        raise HashMismatch("the trailer's SHA-256 is not the hash of the segment", offset=n - HASH_SIZE)

    lineage = uuid.UUID(bytes=lineage_raw)
    if expected_previous_hash is not None and previous_hash != expected_previous_hash:
        raise BrokenLink(f"segment {index} links to {previous_hash.hex()}, the previous segment is "
                         f"{expected_previous_hash.hex()}", offset=56)
    if expected_lineage is not None and lineage != expected_lineage:
        raise IdentityMismatch(f"segment belongs to lineage {lineage}, expected {expected_lineage}", offset=12)
    if expected_index is not None and index != expected_index:
        raise IdentityMismatch(f"segment has index {index}, expected {expected_index}", offset=28)
    if expected_stream is not None and stream != expected_stream:
        raise IdentityMismatch(f"segment is in the {stream.name.lower()} stream, expected "
                               f"{expected_stream.name.lower()}", offset=10)
    return DecodedSegment(stream, lineage, index, first, last, bytes(previous_hash), tuple(events),
                          merkle_root, digest, n)


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


def public_key_key(lineage: uuid.UUID) -> str:
    """``<lineage>/public-key.txt``: the checkpoint signer's note verifier key."""
    return f"{lineage}/public-key.txt"


def leaf_hashes(segments: Iterable[DecodedSegment]) -> list[bytes]:
    """Every leaf hash of the given segments, in order: the leaves of the history's tree."""
    return [e.leaf_hash for s in segments for e in s.events]
