"""Checking an archive against its own manifest and checkpoint: the pure core of ``archive verify``.

Given the manifest, the store's key listing and each segment's bytes (fetched by the caller, in
index order), these functions report every discrepancy as a :class:`Finding` with a stable
``kind``: missing and orphan objects, any segment that fails :func:`decode_segment` (with its own
kind: ``crc_mismatch``, ``broken_link``...), a segment that is not what the manifest says, and a
checkpoint whose size or root differs from the tree the segments make.

One broken segment does not hide the others: the chain goes on from the hash the manifest lists, so
a verifier reports every bad segment in one pass (the tree root is then unknowable, and said so).

Not here yet: comparing events with the database, and the private stream (issue #11, items 5, 7).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from protocol.archive import (
    GENESIS_HASH,
    ArchiveFormatError,
    DecodedSegment,
    Stream,
    checkpoint_key,
    decode_segment,
    manifest_key,
    parse_segment_key,
    public_key_key,
    segment_key,
)
from protocol.checkpoint import Checkpoint
from protocol.manifest import Manifest, ManifestSegment
from protocol.merkle import CompactTree


@dataclass(frozen=True, slots=True)
class Finding:
    """One discrepancy, for the JSON report."""

    kind: str
    message: str
    key: str | None = None
    index: int | None = None
    offset: int | None = None
    sequence: int | None = None

    def report(self) -> dict[str, Any]:
        return {k: v for k, v in (("kind", self.kind), ("message", self.message), ("key", self.key),
                                  ("index", self.index), ("offset", self.offset), ("sequence", self.sequence))
                if v is not None}


def check_listing(manifest: Manifest, keys: Iterable[str], *, pages: Iterable[str] = ()) -> list[Finding]:
    """Missing segments (listed in the manifest, absent from the store) and orphans (objects under
    the lineage that the manifest does not account for), in key order. ``pages``: the keys of the
    manifest's pages (read already, so present)."""
    lineage = manifest.lineage
    expected = {segment_key(lineage, s.index, s.first_sequence, s.last_sequence): s for s in manifest.segments}
    fixed = {manifest_key(lineage), public_key_key(lineage), *pages}
    checkpoints = f"{lineage}/checkpoints/"
    private_checkpoints = f"{lineage}/private/checkpoints/"
    present: set[str] = set()
    findings: list[Finding] = []
    for key in sorted(set(keys)):
        if not key.startswith(f"{lineage}/"):
            continue  # another lineage's objects, or the store's probes
        present.add(key)
        parsed = parse_segment_key(key)
        if key in expected or key in fixed:
            continue
        if (key.startswith(checkpoints) and key[len(checkpoints):].isdigit()) or (
                key.startswith(private_checkpoints) and key[len(private_checkpoints):].isdigit()):
            continue
        if parsed is not None and parsed.stream is Stream.PRIVATE:
            continue  # the private stream has its own list (not built yet)
        findings.append(Finding("orphan_object", f"{key} is not in the manifest", key=key,
                                index=parsed.index if parsed else None))
    for key, s in sorted(expected.items()):
        if key not in present:
            findings.append(Finding("missing_segment", f"segment {s.index} ({key}) is listed but absent",
                                    key=key, index=s.index))
    findings.sort(key=lambda f: f.key or "")
    return findings


class ChainChecker:
    """Feeds the manifest's segments in index order; collects findings and the history's tree."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.findings: list[Finding] = []
        self.tree = CompactTree()
        #: False once a segment could not be read or checked: the root is then unknown.
        self.tree_complete = True
        self._previous = GENESIS_HASH
        self._next = 0

    def feed(self, entry: ManifestSegment, data: bytes | None) -> DecodedSegment | None:
        """Check the segment the manifest lists as ``entry`` (None: it could not be fetched)."""
        if entry.index != self._next:
            raise ValueError("feed the manifest's segments in order")
        self._next += 1
        key = segment_key(self.manifest.lineage, entry.index, entry.first_sequence, entry.last_sequence)
        previous, self._previous = self._previous, bytes.fromhex(entry.hash)
        if data is None:
            self.tree_complete = False
            return None
        try:
            segment = decode_segment(data, expected_previous_hash=previous, expected_lineage=self.manifest.lineage,
                                     expected_index=entry.index, expected_stream=Stream.PUBLIC)
        except ArchiveFormatError as e:
            self.tree_complete = False
            self.findings.append(Finding(e.kind, str(e), key=key, index=entry.index, offset=e.offset,
                                         sequence=e.sequence))
            return None
        if ManifestSegment.of(segment) != entry:
            self.tree_complete = False
            self.findings.append(Finding("manifest_mismatch", f"segment {entry.index} is not the one the "
                                         "manifest lists (hash, size, count or range differ)", key=key,
                                         index=entry.index))
            return None
        if self.tree_complete:
            self.tree.extend(segment.tree or segment.leaf_hashes)
        return segment

    def check_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Compare a (signature-checked) checkpoint with the tree fed so far."""
        key = checkpoint_key(self.manifest.lineage, checkpoint.size)
        if checkpoint.size != self.manifest.tree_size:
            self.findings.append(Finding("checkpoint_size_mismatch", f"the checkpoint covers {checkpoint.size} "
                                         f"events, the manifest's segments {self.manifest.tree_size}", key=key))
        elif not self.tree_complete:
            self.findings.append(Finding("root_unverified", "a segment could not be checked, so the tree's "
                                         "root cannot be recomputed", key=key))
        elif checkpoint.root != self.tree.root():
            self.findings.append(Finding("root_mismatch", "the checkpoint's root is not the root of the "
                                         "archived events", key=key))
