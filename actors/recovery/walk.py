"""One checked pass over a lineage's public archive: the part ``verify``, ``restore`` and ``mirror`` share.

:class:`ArchiveWalk` reads, from an :class:`ArchiveSource` (an object store, or a node's public
archive routes), in this order:

1. the verifier key: the one the caller pins, else the archive's own ``public-key.txt`` (the report
   then says the key was not pinned); a pinned key that differs from the published one is a finding;
2. ``manifest.json`` and its pages (strictly decoded, each page against its entry: :func:`read_manifest`)
   and, where the source can list, every key under the lineage: missing and orphan objects
   (:func:`protocol.archive_check.check_listing`);
3. every checkpoint under ``checkpoints/``: each note's signature and origin;
4. every segment in index order through :class:`~protocol.archive_check.ChainChecker` (frames, CRCs,
   hashes, previous-hash links, identity against the manifest), yielding the ones that pass, so the
   caller compares or restores events as they stream by (one segment in memory at a time);
5. at :meth:`finish`, the Merkle root: the newest checkpoint must cover exactly the manifest's
   segments with the recomputed root, and every older checkpoint's root must be the root of the
   first *size* leaves, i.e. each checkpoint extends the one before it (the recomputation a
   consistency proof stands in for when every leaf is at hand).

Nothing stops at the first problem: every finding is collected (one bad segment does not hide the
next), and the caller decides what a finding means (verify: exit 1; restore: write nothing).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.archiver import PRIVATE_EXTENSION
from infra.archive_store import ArchiveStore, ArchiveStoreError, ObjectNotFound
from protocol.archive import (
    GENESIS_HASH,
    MAX_SEGMENT_BYTES,
    ArchiveFormatError,
    DecodedSegment,
    Stream,
    checkpoint_key,
    decode_segment,
    manifest_key,
    parse_segment_key,
    private_checkpoint_key,
    public_key_key,
    segment_key,
)
from protocol.archive_check import ChainChecker, Finding, check_listing
from protocol.archive_private import decode_private_record
from protocol.checkpoint import (
    MAX_NOTE_BYTES,
    Checkpoint,
    CheckpointError,
    VerifierKey,
    parse_verifier_key,
    verify_checkpoint,
)
from protocol.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, ManifestSegment, parse_manifest
from protocol.merkle import CompactTree

#: Checkpoints read per walk at most: the newest ones (one GET each; an archiver publishes one per
#: sealed segment, about 1,440 a day on a steady trickle of writes). Older ones are not read, which
#: is no fault of the archive: the report counts them (``checkpoints_skipped``), and the newest
#: checkpoint still has to cover every segment.
MAX_CHECKPOINTS = 10_000


class ArchiveSource(Protocol):
    """Where an archive is read from: a get by key, and a listing where the source has one."""

    description: str

    async def get(self, key: str, *, max_bytes: int) -> bytes:
        """The object's bytes; :class:`~infra.archive_store.ObjectNotFound` when absent."""
        ...

    async def keys(self, prefix: str) -> list[str] | None:
        """Every key under ``prefix`` + "/", or None when this source cannot list."""
        ...


class ManifestPageError(ManifestError):
    """A page the manifest names is not the one it names (``key``: the page's object key)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


#: Pages already checked, by their SHA-256 (a page is write-once, so the same hash is the same page).
PageCache = dict[str, tuple[ManifestSegment, ...]]


async def read_manifest(source: ArchiveSource, data: bytes,
                        cache: PageCache | None = None) -> tuple[Manifest, list[str]]:
    """The whole manifest from ``manifest.json``'s bytes ``data`` and the pages it names (fetched from ``source``, each checked against its entry; those in ``cache`` are not
    fetched again), and the pages' keys. ManifestError for a ``manifest.json`` that does not
    decode, :class:`ManifestPageError` for a page that is not the one named, ObjectNotFound (naming
    its key) for one that is gone."""
    document = parse_manifest(data)
    keys = document.page_keys()
    pages: list[tuple[ManifestSegment, ...]] = []
    for page, key in zip(document.pages, keys, strict=True):
        known = cache.get(page.hash) if cache is not None else None
        if known is None:
            try:
                fetched = await source.get(key, max_bytes=MAX_MANIFEST_BYTES)
            except ObjectNotFound:
                raise ObjectNotFound(key) from None
            try:
                known = document.page_segments(page, fetched)
            except ManifestError as e:
                raise ManifestPageError(key, str(e)) from None
            if cache is not None:
                cache[page.hash] = known
        pages.append(known)
    return document.assemble(pages), keys


class StoreSource:
    """An :class:`~infra.archive_store.ArchiveStore` (directory or S3) as an archive source."""

    def __init__(self, store: ArchiveStore) -> None:
        self.store = store
        self.description = store.description

    async def get(self, key: str, *, max_bytes: int) -> bytes:
        return await self.store.get(key, max_bytes=max_bytes)

    async def keys(self, prefix: str) -> list[str]:
        return [o.key async for o in self.store.list(prefix)]


async def archived_lineages(store: ArchiveStore) -> list[uuid.UUID]:
    """The lineages with a ``manifest.json`` in ``store``, in key order."""
    found: list[uuid.UUID] = []
    async for info in store.list():
        head, _, tail = info.key.partition("/")
        if tail == "manifest.json":
            try:
                found.append(uuid.UUID(head))
            except ValueError:
                continue
    return sorted(found, key=str)


@dataclass(slots=True)
class WalkSummary:
    """What a walk checked, for the JSON report."""

    lineage: uuid.UUID
    source: str
    key_source: str = "pinned"
    public_key: str | None = None
    parent_lineage: uuid.UUID | None = None
    segments_listed: int = 0
    segments_checked: int = 0
    events_checked: int = 0
    tree_size: int = 0
    root: str | None = None
    checkpoints_checked: int = 0
    #: Older checkpoints not read (past MAX_CHECKPOINTS).
    checkpoints_skipped: int = 0
    latest_checkpoint: dict[str, Any] | None = None
    archived_through: int | None = None
    findings: list[Finding] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "lineage": str(self.lineage), "source": self.source, "key_source": self.key_source,
            "public_key": self.public_key,
            "parent_lineage": None if self.parent_lineage is None else str(self.parent_lineage),
            "segments_listed": self.segments_listed, "segments_checked": self.segments_checked,
            "events_checked": self.events_checked, "tree_size": self.tree_size, "root": self.root,
            "checkpoints_checked": self.checkpoints_checked, "checkpoints_skipped": self.checkpoints_skipped,
            "latest_checkpoint": self.latest_checkpoint,
            "archived_through": self.archived_through,
        }


class ArchiveWalk:
    """A checked pass over one lineage's public archive; see the module docstring for the order."""

    def __init__(self, source: ArchiveSource, lineage: uuid.UUID, *, trusted: VerifierKey | None = None) -> None:
        """``trusted``: the pinned verifier key; None trusts the archive's own public key (reported)."""
        self.source = source
        self.lineage = lineage
        self.trusted = trusted
        self.summary = WalkSummary(lineage, source.description)
        self.manifest: Manifest | None = None
        #: The key checkpoints are checked with, once :meth:`open` chose it.
        self.verifier: VerifierKey | None = None
        self._checker: ChainChecker | None = None
        self._checkpoints: list[tuple[str, Checkpoint]] = []
        self._tree = CompactTree()
        #: Root of the first n leaves, for every checkpoint size n that the walk reached.
        self._prefix_roots: dict[int, bytes] = {}

    @property
    def findings(self) -> list[Finding]:
        return self.summary.findings

    def _find(self, kind: str, message: str, **where: Any) -> None:
        self.summary.findings.append(Finding(kind, message, **where))

    async def _get(self, key: str, max_bytes: int, *, missing: tuple[str, str] | None = None) -> bytes | None:
        """The object under ``key``, or None: absent (the ``missing`` finding, kind and message, is
        recorded when given) or unreadable (``unreadable_object``, with the store's cause: never
        reported as absent, which would send an operator looking for an object that is there)."""
        try:
            return await self.source.get(key, max_bytes=max_bytes)
        except ObjectNotFound:
            if missing is not None:
                self._find(missing[0], missing[1], key=key)
            return None
        except ArchiveStoreError as e:
            self._find("unreadable_object", str(e), key=key)
            return None

    async def open(self) -> bool:
        """Key, manifest, listing and checkpoints. False when there is no usable manifest (nothing
        more can be checked; the finding says why)."""
        verifier = self.verifier = await self._verifier()
        key = manifest_key(self.lineage)
        data = await self._get(key, MAX_MANIFEST_BYTES, missing=("missing_manifest", f"{key} is absent: nothing to verify"))
        if data is None:
            return False
        try:
            manifest, page_keys = await read_manifest(self.source, data)
        except ManifestPageError as e:
            self._find("invalid_manifest", str(e), key=e.key)
            return False
        except ManifestError as e:
            self._find("invalid_manifest", str(e), key=key)
            return False
        except ObjectNotFound as e:
            self._find("missing_manifest_page", f"{e} is named by the manifest but absent", key=str(e))
            return False
        except ArchiveStoreError as e:
            self._find("unreadable_object", str(e), key=key)
            return False
        if manifest.lineage != self.lineage:
            self._find("identity_mismatch", f"the manifest is of lineage {manifest.lineage}", key=key)
            return False
        self.manifest = manifest
        self._checker = ChainChecker(manifest)
        self.summary.parent_lineage = manifest.parent_lineage
        self.summary.segments_listed = len(manifest.segments)
        self.summary.archived_through = manifest.archived_through
        listed = await self._keys(str(self.lineage))
        if listed is not None:
            self.summary.findings.extend(check_listing(manifest, listed, pages=page_keys))
            checkpoint_keys = sorted(k for k in listed if k.startswith(f"{self.lineage}/checkpoints/"))
        else:
            checkpoint_keys = []
        if verifier is not None:
            await self._read_checkpoints(checkpoint_keys, verifier)
        return True

    async def _keys(self, prefix: str) -> list[str] | None:
        try:
            return await self.source.keys(prefix)
        except ArchiveStoreError as e:
            self._find("unlistable_store", str(e))
            return None

    async def _verifier(self) -> VerifierKey | None:
        key = public_key_key(self.lineage)
        data = await self._get(key, 4096, missing=("missing_public_key", f"{key} is absent"))
        published: VerifierKey | None = None
        if data is not None:
            try:
                published = parse_verifier_key(data.decode("utf-8", "replace"))
            except CheckpointError as e:
                self._find(e.kind, f"{key}: {e}", key=key)
        if self.trusted is None:
            self.summary.key_source = "archive (not pinned)"
            self.summary.public_key = published.text() if published else None
            return published
        self.summary.public_key = self.trusted.text()
        if published is not None and published != self.trusted:
            self._find("public_key_mismatch", f"{key} is not the pinned key {self.trusted.text()}", key=key)
        return self.trusted

    async def _read_checkpoints(self, keys: list[str], verifier: VerifierKey) -> None:
        if len(keys) > MAX_CHECKPOINTS:
            self.summary.checkpoints_skipped = len(keys) - MAX_CHECKPOINTS
            keys = keys[-MAX_CHECKPOINTS:]
        for key in keys:
            tail = key.rsplit("/", 1)[1]
            if not tail.isdigit():
                continue  # an orphan, already reported by the listing
            note = await self._get(key, MAX_NOTE_BYTES)
            if note is None:
                continue
            try:
                checkpoint = verify_checkpoint(note, verifier)
            except CheckpointError as e:
                self._find(e.kind, f"{key}: {e}", key=key)
                continue
            if key != checkpoint_key(self.lineage, checkpoint.size):
                self._find("identity_mismatch", f"{key} holds the checkpoint of size {checkpoint.size}", key=key)
                continue
            self._checkpoints.append((key, checkpoint))
        self._checkpoints.sort(key=lambda kc: kc[1].size)
        self.summary.checkpoints_checked = len(self._checkpoints)
        if not self._checkpoints and not any(f.key in keys for f in self.findings):
            self._find("missing_checkpoint", f"no signed checkpoint under {self.lineage}/checkpoints/")

    async def segments(self) -> AsyncIterator[DecodedSegment]:
        """Every segment of the manifest that passes its checks, in index order."""
        if self.manifest is None or self._checker is None:
            return
        wanted = {c.size for _, c in self._checkpoints}
        if 0 in wanted:
            self._prefix_roots[0] = self._tree.root()
        for entry in self.manifest.segments:
            key = segment_key(self.lineage, entry.index, entry.first_sequence, entry.last_sequence)
            data = await self._get(key, MAX_SEGMENT_BYTES)
            segment = self._checker.feed(entry, data)
            if segment is None:
                continue
            self.summary.segments_checked += 1
            self.summary.events_checked += segment.event_count
            if self._checker.tree_complete:
                for leaf in segment.leaf_hashes:
                    self._tree.append_hash(leaf)
                    if self._tree.size in wanted:
                        self._prefix_roots[self._tree.size] = self._tree.root()
            yield segment

    def finish(self) -> None:
        """The root and checkpoint checks, once :meth:`segments` has been consumed."""
        if self.manifest is None or self._checker is None:
            return
        self.summary.findings.extend(self._checker.findings)
        self._checker.findings.clear()
        self.summary.tree_size = self.manifest.tree_size
        if self._checker.tree_complete:
            self.summary.root = self._tree.root().hex()
        if not self._checkpoints:
            return
        newest_key, newest = self._checkpoints[-1]
        self.summary.latest_checkpoint = {"size": newest.size, "root": newest.root.hex(), "key": newest_key}
        self._checker.check_checkpoint(newest)
        self.summary.findings.extend(self._checker.findings)
        for key, older in self._checkpoints[:-1]:
            if older.size > self.manifest.tree_size:
                self._find("checkpoint_size_mismatch", f"the checkpoint of size {older.size} is beyond the "
                           f"{self.manifest.tree_size} archived events", key=key)
            elif older.size in self._prefix_roots and self._prefix_roots[older.size] != older.root:
                self._find("does_not_extend", f"the checkpoint of size {older.size} is not a prefix of the "
                           f"archived history: the checkpoint of size {newest.size} does not extend it", key=key)

    @property
    def ok(self) -> bool:
        """No finding so far."""
        return not self.summary.findings

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The newest signature-checked checkpoint."""
        return self._checkpoints[-1][1] if self._checkpoints else None


class PrivateWalk:
    """A checked pass over a lineage's private stream (operation records and the agent register).

    The manifest lists only the public stream, so the private segments are found by listing
    ``<lineage>/private/segments/``: their indexes must run 0, 1, 2... without a gap, each segment
    must pass every check of :func:`~protocol.archive.decode_segment` and link to the one before, and
    every frame must be a valid private record. A source that cannot list has no private stream to
    offer (a node never serves it publicly).
    """

    def __init__(self, source: ArchiveSource, lineage: uuid.UUID, verifier: VerifierKey | None) -> None:
        """``verifier``: the key the public walk checked checkpoints with (None: none usable)."""
        self.source = source
        self.lineage = lineage
        self.verifier = verifier
        self.findings: list[Finding] = []
        self.segments_checked = 0
        self.records_checked = 0
        self._entries: list[tuple[int, str]] = []
        #: Segment hashes seen by the first pass: a later pass (restore reads the stream twice)
        #: must read the very same bytes.
        self._hashes: dict[int, bytes] = {}
        self._checkpoint: tuple[str, Checkpoint] | None = None
        self._root: bytes | None = None

    async def open(self) -> bool:
        """List the private segments; False (with a finding) when there are none or they have a gap."""
        prefix = f"{self.lineage}/private/segments"
        try:
            keys = await self.source.keys(prefix)
        except ArchiveStoreError as e:
            self.findings.append(Finding("unlistable_store", str(e)))
            return False
        await self._read_checkpoint()
        if not keys:
            self.findings.append(Finding("missing_private_stream", f"no segment under {prefix}/: the agent "
                                         "register and the operation records cannot be restored", key=prefix))
            return False
        parsed = []
        for key in keys:
            info = parse_segment_key(key)
            if info is None or info.lineage != self.lineage or info.stream is not Stream.PRIVATE:
                self.findings.append(Finding("orphan_object", f"{key} is not a private segment key", key=key))
                continue
            parsed.append((info.index, key))
        parsed.sort()
        for expected, (index, key) in enumerate(parsed):
            if index != expected:
                self.findings.append(Finding("missing_segment", f"private segment {expected} is absent "
                                             f"(the next present is {index})", index=expected))
                return False
        self._entries = parsed
        return bool(parsed)

    async def _read_checkpoint(self) -> None:
        """The newest private checkpoint (``private/checkpoints/<size>``, extension line ``private``)."""
        prefix = f"{self.lineage}/private/checkpoints"
        try:
            listed = await self.source.keys(prefix) or []
        except ArchiveStoreError as e:
            self.findings.append(Finding("unlistable_store", str(e)))
            return
        keys = sorted(k for k in listed if k.rsplit("/", 1)[1].isdigit())
        if not keys or self.verifier is None:
            self.findings.append(Finding("missing_checkpoint", f"no signed checkpoint under {prefix}/", key=prefix))
            return
        key = keys[-1]
        try:
            checkpoint = verify_checkpoint(await self.source.get(key, max_bytes=MAX_NOTE_BYTES), self.verifier)
        except CheckpointError as e:
            self.findings.append(Finding(e.kind, f"{key}: {e}", key=key))
            return
        except ArchiveStoreError as e:
            self.findings.append(Finding("unreadable_object", str(e), key=key))
            return
        if checkpoint.extensions != (PRIVATE_EXTENSION,) or key != private_checkpoint_key(self.lineage, checkpoint.size):
            self.findings.append(Finding("identity_mismatch", f"{key} is not a private checkpoint of its size", key=key))
            return
        self._checkpoint = (key, checkpoint)

    def finish(self) -> None:
        """After a complete pass: the newest private checkpoint must cover every record, with the root."""
        if self._checkpoint is None or self._root is None:
            return
        key, checkpoint = self._checkpoint
        if checkpoint.size != self.records_checked:
            self.findings.append(Finding("checkpoint_size_mismatch", f"the private checkpoint covers {checkpoint.size} "
                                         f"records, the private segments hold {self.records_checked}", key=key))
        elif checkpoint.root != self._root:
            self.findings.append(Finding("root_mismatch", "the private checkpoint's root is not the root of the "
                                         "archived records", key=key))

    def to_json(self) -> dict[str, Any]:
        checkpoint = self._checkpoint[1] if self._checkpoint else None
        return {"segments_checked": self.segments_checked, "records_checked": self.records_checked,
                "root": self._root.hex() if self._root else None,
                "checkpoint_size": checkpoint.size if checkpoint else None}

    async def segments(self) -> AsyncIterator[DecodedSegment]:
        """Every private segment in index order, each checked and linked; stops at the first bad one
        (a restore cannot skip part of the register). Can be iterated again; counts are per pass."""
        previous = GENESIS_HASH
        self.segments_checked = self.records_checked = 0
        tree = CompactTree()
        self._root = None
        for index, key in self._entries:
            try:
                data = await self.source.get(key, max_bytes=MAX_SEGMENT_BYTES)
                segment = decode_segment(data, expected_previous_hash=previous, expected_lineage=self.lineage,
                                         expected_index=index, expected_stream=Stream.PRIVATE)
                for event in segment.events:
                    decode_private_record(event.body)
            except ObjectNotFound:
                self.findings.append(Finding("missing_segment", f"{key} vanished while being read", key=key,
                                             index=index))
                return
            except ArchiveStoreError as e:
                self.findings.append(Finding("unreadable_object", str(e), key=key, index=index))
                return
            except ArchiveFormatError as e:
                self.findings.append(Finding(e.kind, str(e), key=key, index=index, offset=e.offset,
                                             sequence=e.sequence))
                return
            if self._hashes.setdefault(index, segment.hash) != segment.hash:
                self.findings.append(Finding("changed_during_read", f"{key} changed between two reads", key=key,
                                             index=index))
                return
            previous = segment.hash
            self.segments_checked += 1
            self.records_checked += segment.event_count
            tree.extend(segment.tree or segment.leaf_hashes)
            yield segment
        self._root = tree.root()
