"""``manifest.json``: the list of a lineage's published segments (format version 1).

The manifest names every published segment with its index, sequence range, event count, size and
hash, in order, so a verifier can tell a missing object from an orphan without trusting listings.
It is derived data: every field can be recomputed from the segments themselves, and the checkpoint
(not the manifest) is what is signed. Encoding is deterministic (sorted keys, two-space indent,
final newline); decoding is strict: unknown keys, wrong types, gaps or overlaps are refused with a
:class:`ManifestError` saying where.

Not here yet: the private stream's segments (item 5 of issue #11) will need their own list.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from protocol.archive import (
    FORMAT_VERSION,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAX_INDEX,
    MAX_SEQUENCE,
    READABLE_VERSIONS,
    TRAILER_SIZE,
    DecodedSegment,
)
from protocol.errors import ToastMachineError

#: A manifest larger than this is refused before parsing (about 300,000 segments).
MAX_MANIFEST_BYTES = 64 << 20
_HEX_HASH = re.compile(r"[0-9a-f]{64}")
_TOP_KEYS = {"format_version", "lineage", "parent_lineage", "segments"}
_SEGMENT_KEYS = {"index", "first_sequence", "last_sequence", "event_count", "size", "hash"}
#: The smallest possible segment: header, one empty frame, trailer.
_MIN_SEGMENT_SIZE = HEADER_SIZE + FRAME_OVERHEAD + TRAILER_SIZE


class ManifestError(ToastMachineError):
    """A manifest is not valid JSON of the version-1 shape, or its segment list is inconsistent."""


@dataclass(frozen=True, slots=True)
class ManifestSegment:
    """One published segment as the manifest lists it."""

    index: int
    first_sequence: int
    last_sequence: int
    event_count: int
    size: int
    #: Lowercase hex SHA-256 of the segment (its trailer hash).
    hash: str

    @classmethod
    def of(cls, segment: DecodedSegment) -> ManifestSegment:
        """The manifest entry of a decoded (hence verified) segment."""
        return cls(segment.index, segment.first_sequence, segment.last_sequence, segment.event_count,
                   segment.size, segment.hash.hex())

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "first_sequence": self.first_sequence, "last_sequence": self.last_sequence,
                "event_count": self.event_count, "size": self.size, "hash": self.hash}


@dataclass(frozen=True, slots=True)
class Manifest:
    """A lineage's published segments, in index order. Build with :func:`validate_manifest`-checked
    values only (:meth:`appended` and :func:`decode_manifest` check)."""

    lineage: uuid.UUID
    parent_lineage: uuid.UUID | None
    segments: tuple[ManifestSegment, ...] = ()
    format_version: int = FORMAT_VERSION

    @property
    def tree_size(self) -> int:
        """Events in all listed segments: the size of the Merkle tree they make."""
        return sum(s.event_count for s in self.segments)

    @property
    def archived_through(self) -> int | None:
        """The last sequence of the last listed segment (None when empty)."""
        return self.segments[-1].last_sequence if self.segments else None

    @property
    def last_hash(self) -> str | None:
        """Hash of the last listed segment: the next segment's previous hash."""
        return self.segments[-1].hash if self.segments else None

    def appended(self, segment: ManifestSegment) -> Manifest:
        """A new manifest with ``segment`` added at the end; ManifestError if it does not follow."""
        out = Manifest(self.lineage, self.parent_lineage, self.segments + (segment,), self.format_version)
        validate_manifest(out)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"format_version": self.format_version, "lineage": str(self.lineage),
                "parent_lineage": None if self.parent_lineage is None else str(self.parent_lineage),
                "segments": [s.to_json() for s in self.segments]}


def validate_manifest(manifest: Manifest) -> None:
    """Raise ManifestError unless indexes run 0, 1, 2... and ranges strictly follow each other."""
    if manifest.format_version not in READABLE_VERSIONS:
        raise ManifestError(f"format_version {manifest.format_version} is not one of "
                            f"{', '.join(map(str, READABLE_VERSIONS))}")
    if manifest.parent_lineage is not None and manifest.parent_lineage == manifest.lineage:
        raise ManifestError("parent_lineage equals lineage")
    previous_last = -1
    for position, s in enumerate(manifest.segments):
        where = f"segments[{position}]"
        if s.index != position:
            raise ManifestError(f"{where}.index is {s.index}, expected {position} (a missing or extra segment)")
        if not 0 <= s.index <= MAX_INDEX:
            raise ManifestError(f"{where}.index is out of bounds")
        if not previous_last < s.first_sequence <= s.last_sequence <= MAX_SEQUENCE:
            raise ManifestError(f"{where} range {s.first_sequence}..{s.last_sequence} does not follow "
                                f"the previous segment's last sequence {previous_last}")
        if not 1 <= s.event_count <= s.last_sequence - s.first_sequence + 1:
            raise ManifestError(f"{where}.event_count {s.event_count} does not fit its range")
        if s.size < _MIN_SEGMENT_SIZE:
            raise ManifestError(f"{where}.size {s.size} is smaller than any segment")
        if not _HEX_HASH.fullmatch(s.hash):
            raise ManifestError(f"{where}.hash is not 64 lowercase hex digits")
        previous_last = s.last_sequence


def encode_manifest(manifest: Manifest) -> bytes:
    """Deterministic JSON bytes of a valid manifest."""
    validate_manifest(manifest)
    return orjson.dumps(manifest.to_json(), option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate manifest bytes; ManifestError naming the first problem."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise ManifestError("manifest is not valid JSON") from None
    top = _object(raw, "manifest", _TOP_KEYS)
    segments_raw = top["segments"]
    if not isinstance(segments_raw, list):
        raise ManifestError("segments is not a list")
    segments = tuple(_segment(s, f"segments[{i}]") for i, s in enumerate(segments_raw))
    parent = top["parent_lineage"]
    manifest = Manifest(
        lineage=_uuid(top["lineage"], "lineage"),
        parent_lineage=None if parent is None else _uuid(parent, "parent_lineage"),
        segments=segments,
        format_version=_int(top["format_version"], "format_version"),
    )
    validate_manifest(manifest)
    return manifest


def manifest_of(lineage: uuid.UUID, parent_lineage: uuid.UUID | None,
                segments: Iterable[DecodedSegment]) -> Manifest:
    """The manifest listing ``segments`` (already decoded, in order)."""
    manifest = Manifest(lineage, parent_lineage, tuple(ManifestSegment.of(s) for s in segments))
    validate_manifest(manifest)
    return manifest


def _object(value: Any, where: str, keys: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{where} is not an object")
    if set(value) != keys:
        missing, extra = sorted(keys - set(value)), sorted(set(value) - keys)
        raise ManifestError(f"{where} has missing keys {missing} or unknown keys {extra}")
    return value


def _int(value: Any, where: str) -> int:
    # bool is an int subclass in Python; JSON true is not a number.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"{where} is not an integer")
    return value


def _uuid(value: Any, where: str) -> uuid.UUID:
    if not isinstance(value, str):
        raise ManifestError(f"{where} is not a UUID string")
    try:
        parsed = uuid.UUID(value)
    except ValueError:
        raise ManifestError(f"{where} is not a UUID string") from None
    if str(parsed) != value:
        raise ManifestError(f"{where} is not in canonical lowercase UUID form")
    return parsed


def _segment(value: Any, where: str) -> ManifestSegment:
    s = _object(value, where, _SEGMENT_KEYS)
    if not isinstance(s["hash"], str):
        raise ManifestError(f"{where}.hash is not a string")
    return ManifestSegment(
        index=_int(s["index"], f"{where}.index"),
        first_sequence=_int(s["first_sequence"], f"{where}.first_sequence"),
        last_sequence=_int(s["last_sequence"], f"{where}.last_sequence"),
        event_count=_int(s["event_count"], f"{where}.event_count"),
        size=_int(s["size"], f"{where}.size"),
        hash=s["hash"],
    )
