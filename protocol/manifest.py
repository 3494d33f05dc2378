"""``manifest.json`` and its pages: the list of a lineage's published segments.

The manifest names every published segment with its index, sequence range, event count, size and
hash, in order, so a verifier can tell a missing object from an orphan without trusting listings.
It is derived data: every field can be recomputed from the segments themselves, and the checkpoint
(not the manifest) is what is signed. Encoding is deterministic (sorted keys, two-space indent,
final newline); decoding is strict: unknown keys, wrong types, gaps or overlaps are refused with a
:class:`ManifestError` saying where.

So that the one object rewritten as segments are published stays small however long the history
grows, the list is paged: each run of :data:`PAGE_SEGMENTS` segments, once complete, goes to a
write-once page object (``<lineage>/manifest-pages/<first>-<last>``) that ``manifest.json`` names
with its range, event count, size and SHA-256; ``manifest.json`` itself lists the pages and the
segments after the last page. A reader fetches the pages (:meth:`ManifestDocument.page_keys`) and
:meth:`ManifestDocument.assemble` checks each against its entry and gives the whole
:class:`Manifest`. A manifest written before pages existed has no ``pages`` key and lists every
segment itself; it reads the same way.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
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
    manifest_page_key,
)
from protocol.errors import ToastMachineError

#: A manifest (or a page) larger than this is refused before parsing (about 300,000 entries).
MAX_MANIFEST_BYTES = 64 << 20
#: Segments per manifest page as the archiver writes them (a reader takes pages of any length):
#: about 190 KB a page; manifest.json then holds one 190-byte entry per 1,000 segments.
PAGE_SEGMENTS = 1000
_HEX_HASH = re.compile(r"[0-9a-f]{64}")
_TOP_KEYS = {"format_version", "lineage", "parent_lineage", "segments"}
_PAGED_TOP_KEYS = _TOP_KEYS | {"pages"}
_SEGMENT_KEYS = {"index", "first_sequence", "last_sequence", "event_count", "size", "hash"}
_PAGE_KEYS = {"first_index", "last_index", "first_sequence", "last_sequence", "event_count", "size", "hash"}
_PAGE_DOCUMENT_KEYS = {"format_version", "lineage", "segments"}
_ENCODING = orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2
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
    validate_run(manifest.segments, 0, -1)


def validate_run(segments: Sequence[ManifestSegment], first_index: int, previous_last: int) -> None:
    """Raise ManifestError unless ``segments`` are indexes ``first_index``, ``first_index + 1``...
    whose ranges strictly follow each other and ``previous_last`` (the last sequence before them;
    -1 before the first segment), each well formed."""
    for position, s in enumerate(segments, start=first_index):
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
    """Deterministic JSON bytes of a valid manifest listing every segment itself (no pages: the
    form of a small archive, and of manifests written before pages)."""
    validate_manifest(manifest)
    return orjson.dumps(manifest.to_json(), option=_ENCODING) + b"\n"


@dataclass(frozen=True, slots=True)
class ManifestPage:
    """A page of the segment list as ``manifest.json`` names it: the segments ``first_index`` to
    ``last_index``, their sequence range and events in all, and the page object's size and hash."""

    first_index: int
    last_index: int
    first_sequence: int
    last_sequence: int
    event_count: int
    size: int
    #: Lowercase hex SHA-256 of the page object's bytes.
    hash: str

    def key(self, lineage: uuid.UUID) -> str:
        """The page object's key."""
        return manifest_page_key(lineage, self.first_index, self.last_index)

    def to_json(self) -> dict[str, Any]:
        return {"first_index": self.first_index, "last_index": self.last_index,
                "first_sequence": self.first_sequence, "last_sequence": self.last_sequence,
                "event_count": self.event_count, "size": self.size, "hash": self.hash}


def encode_page(lineage: uuid.UUID, segments: Sequence[ManifestSegment],
                format_version: int = FORMAT_VERSION) -> tuple[ManifestPage, bytes]:
    """A page of consecutive ``segments`` (already validated as a manifest's): its entry and bytes."""
    if not segments:
        raise ManifestError("a manifest page holds at least one segment")
    data = orjson.dumps({"format_version": format_version, "lineage": str(lineage),
                         "segments": [s.to_json() for s in segments]}, option=_ENCODING) + b"\n"
    page = ManifestPage(segments[0].index, segments[-1].index, segments[0].first_sequence,
                        segments[-1].last_sequence, sum(s.event_count for s in segments), len(data),
                        hashlib.sha256(data).hexdigest())
    return page, data


def encode_paged(lineage: uuid.UUID, parent_lineage: uuid.UUID | None, pages: Sequence[ManifestPage],
                 tail: Sequence[ManifestSegment], format_version: int = FORMAT_VERSION) -> bytes:
    """``manifest.json`` naming ``pages`` (their objects written first) and listing ``tail``, the
    segments after the last page."""
    return orjson.dumps({"format_version": format_version, "lineage": str(lineage),
                         "parent_lineage": None if parent_lineage is None else str(parent_lineage),
                         "pages": [p.to_json() for p in pages], "segments": [s.to_json() for s in tail]},
                        option=_ENCODING) + b"\n"


@dataclass(frozen=True, slots=True)
class ManifestDocument:
    """``manifest.json`` as decoded: its pages (not fetched yet) and the segments after them."""

    lineage: uuid.UUID
    parent_lineage: uuid.UUID | None
    format_version: int
    pages: tuple[ManifestPage, ...]
    tail: tuple[ManifestSegment, ...]

    def page_keys(self) -> list[str]:
        """The keys of the page objects :meth:`assemble` needs, in order."""
        return [p.key(self.lineage) for p in self.pages]

    def assemble(self, pages: Sequence[bytes | Sequence[ManifestSegment]]) -> Manifest:
        """The whole manifest, from each page's bytes (or its segments, already checked by
        :meth:`page_segments`) in :meth:`page_keys` order; ManifestError naming the first page
        that is not the one listed."""
        if len(pages) != len(self.pages):
            raise ManifestError(f"{len(self.pages)} manifest pages are listed, {len(pages)} were given")
        segments: list[ManifestSegment] = []
        for page, given in zip(self.pages, pages, strict=True):
            segments.extend(given if not isinstance(given, bytes) else self.page_segments(page, given))
        manifest = Manifest(self.lineage, self.parent_lineage, (*segments, *self.tail), self.format_version)
        validate_manifest(manifest)
        return manifest

    def page_segments(self, page: ManifestPage, data: bytes) -> tuple[ManifestSegment, ...]:
        """The segments of ``page``'s object ``data``, checked against its entry."""
        where = f"manifest page {page.first_index}-{page.last_index}"
        if len(data) != page.size or hashlib.sha256(data).hexdigest() != page.hash:
            raise ManifestError(f"{where} is not the page the manifest lists (its size or SHA-256 differs)")
        top = _object(_json(data, where), where, _PAGE_DOCUMENT_KEYS)
        if _uuid(top["lineage"], f"{where}.lineage") != self.lineage or \
                _int(top["format_version"], f"{where}.format_version") != self.format_version:
            raise ManifestError(f"{where} names another lineage or format version than the manifest")
        segments = _segments(top["segments"], f"{where}.segments")
        if (not segments or (segments[0].index, segments[-1].index) != (page.first_index, page.last_index)
                or (segments[0].first_sequence, segments[-1].last_sequence) != (page.first_sequence, page.last_sequence)
                or sum(s.event_count for s in segments) != page.event_count):
            raise ManifestError(f"{where} does not hold the segments, range and events its entry names")
        return segments


def parse_manifest(data: bytes) -> ManifestDocument:
    """Parse ``manifest.json``; ManifestError naming the first problem. The page entries must run
    on from each other and the tail follow the last page; every other rule is checked when the
    pages are assembled."""
    top = _object(_json(data, "manifest"), "manifest", _PAGED_TOP_KEYS, optional=frozenset({"pages"}))
    parent = top["parent_lineage"]
    pages_raw = top.get("pages", [])
    if not isinstance(pages_raw, list):
        raise ManifestError("pages is not a list")
    pages = tuple(_page(p, f"pages[{i}]") for i, p in enumerate(pages_raw))
    next_index = 0
    for i, p in enumerate(pages):
        if p.first_index != next_index or p.last_index < p.first_index:
            raise ManifestError(f"pages[{i}] covers segments {p.first_index}-{p.last_index}, expected a run "
                                f"starting at {next_index}")
        next_index = p.last_index + 1
    tail = _segments(top["segments"], "segments")
    if tail and tail[0].index != next_index:
        raise ManifestError(f"segments[0].index is {tail[0].index}, expected {next_index} (after the last page)")
    return ManifestDocument(_uuid(top["lineage"], "lineage"), None if parent is None else _uuid(parent, "parent_lineage"),
                            _int(top["format_version"], "format_version"), pages, tail)


def decode_manifest(data: bytes) -> Manifest:
    """Parse and validate manifest bytes that name no pages; ManifestError naming the first problem
    (one that names pages is read with :func:`parse_manifest` and :meth:`ManifestDocument.assemble`)."""
    document = parse_manifest(data)
    if document.pages:
        raise ManifestError(f"the manifest names {len(document.pages)} pages; fetch them to read it whole")
    return document.assemble([])


def manifest_of(lineage: uuid.UUID, parent_lineage: uuid.UUID | None,
                segments: Iterable[DecodedSegment]) -> Manifest:
    """The manifest listing ``segments`` (already decoded, in order)."""
    manifest = Manifest(lineage, parent_lineage, tuple(ManifestSegment.of(s) for s in segments))
    validate_manifest(manifest)
    return manifest


def _json(data: bytes, where: str) -> Any:
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        raise ManifestError(f"{where} is not valid JSON") from None


def _object(value: Any, where: str, keys: set[str], optional: frozenset[str] = frozenset()) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{where} is not an object")
    if not keys - optional <= set(value) <= keys:
        missing, extra = sorted(keys - optional - set(value)), sorted(set(value) - keys)
        raise ManifestError(f"{where} has missing keys {missing} or unknown keys {extra}")
    return value


def _segments(value: Any, where: str) -> tuple[ManifestSegment, ...]:
    if not isinstance(value, list):
        raise ManifestError(f"{where} is not a list")
    return tuple(_segment(s, f"{where}[{i}]") for i, s in enumerate(value))


def _page(value: Any, where: str) -> ManifestPage:
    p = _object(value, where, _PAGE_KEYS)
    if not isinstance(p["hash"], str) or not _HEX_HASH.fullmatch(p["hash"]):
        raise ManifestError(f"{where}.hash is not 64 lowercase hex digits")
    first_index, last_index, first_sequence, last_sequence, event_count, size = (
        _int(p[k], f"{where}.{k}")
        for k in ("first_index", "last_index", "first_sequence", "last_sequence", "event_count", "size"))
    page = ManifestPage(first_index, last_index, first_sequence, last_sequence, event_count, size, p["hash"])
    if not (0 <= page.first_index <= page.last_index <= MAX_INDEX
            and 0 < page.first_sequence <= page.last_sequence <= MAX_SEQUENCE and page.event_count > 0
            and 0 < page.size <= MAX_MANIFEST_BYTES):
        raise ManifestError(f"{where} has an index, range, count or size out of bounds")
    return page


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
