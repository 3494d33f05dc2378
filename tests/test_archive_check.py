"""The pieces together: a chain of segments, its manifest, checkpoint and public key written to a real
store (directory and SeaweedFS), read back and checked clean; then real tampering of the objects
(a flipped byte, a missing segment, an extra object, a swapped pair, a truncated segment, a forged
checkpoint) each reported with its own kind."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.archive_store import ArchiveStore, ObjectNotFound, PutOutcome
from protocol.archive import (
    GENESIS_HASH,
    ArchivedEvent,
    Stream,
    checkpoint_key,
    decode_segment,
    encode_segment,
    event_body,
    manifest_key,
    public_key_key,
    segment_key,
)
from protocol.archive_check import ChainChecker, Finding, check_listing
from protocol.checkpoint import (
    BadSignature,
    Checkpoint,
    generate_signer_key,
    parse_verifier_key,
    sign_checkpoint,
    verify_checkpoint,
)
from protocol.manifest import decode_manifest, encode_manifest, manifest_of
from protocol.merkle import tree_root
from tests.archive_fixtures import store_fixture  # noqa: F401 - the ``store`` fixture, on each backend


@dataclass
class Written:
    lineage: uuid.UUID
    keys: list[str]
    origin: str
    root: bytes
    size: int


async def write_archive(store: ArchiveStore, segments: int = 4, per_segment: int = 5) -> Written:
    """What the archiver will do, by hand: segments, then public key, checkpoint and manifest."""
    lineage = uuid.uuid4()
    origin = f"toastmachine.archive/{uuid.uuid4()}"
    key = generate_signer_key(origin)
    previous, decoded, keys, leaves = GENESIS_HASH, [], [], []
    sequence = 0
    for index in range(segments):
        events = []
        for _ in range(per_segment):
            sequence += 1 + sequence % 3  # gaps, as the change history has
            events.append(ArchivedEvent(sequence, event_body({"sequence": sequence, "type": "message.appended",
                                                              "lineage": str(lineage), "data": {"n": sequence}})))
        data = encode_segment(Stream.PUBLIC, lineage, index, previous, events)
        seg = decode_segment(data)
        k = segment_key(lineage, index, seg.first_sequence, seg.last_sequence)
        await store.put(k, data)
        keys.append(k)
        decoded.append(seg)
        leaves += [e.leaf_hash for e in seg.events]
        previous = seg.hash
    root = tree_root(leaves)
    await store.put(public_key_key(lineage), (key.verifier().text() + "\n").encode())
    await store.put(checkpoint_key(lineage, len(leaves)), sign_checkpoint(Checkpoint(origin, len(leaves), root), key).encode())
    await store.replace(manifest_key(lineage), encode_manifest(manifest_of(lineage, None, decoded)))
    return Written(lineage, keys, origin, root, len(leaves))


async def check_archive(store: ArchiveStore, lineage: uuid.UUID) -> list[Finding]:
    """What ``archive verify`` will do against the store alone."""
    manifest = decode_manifest(await store.get(manifest_key(lineage)))
    listed = [o.key async for o in store.list(str(lineage))]
    findings = check_listing(manifest, listed)
    checker = ChainChecker(manifest)
    for entry in manifest.segments:
        try:
            data = await store.get(segment_key(lineage, entry.index, entry.first_sequence, entry.last_sequence))
        except ObjectNotFound:
            data = None
        checker.feed(entry, data)
    verifier = parse_verifier_key((await store.get(public_key_key(lineage))).decode())
    checkpoint = verify_checkpoint(await store.get(checkpoint_key(lineage, manifest.tree_size)), verifier)
    checker.check_checkpoint(checkpoint)
    return findings + checker.findings


async def test_a_written_archive_checks_clean(store: ArchiveStore) -> None:
    written = await write_archive(store)
    assert await check_archive(store, written.lineage) == []
    manifest = decode_manifest(await store.get(manifest_key(written.lineage)))
    assert manifest.tree_size == written.size == 20
    # Uploading a segment again (an archiver retrying after a crash) is a no-op, not a fork.
    for key in written.keys:
        assert await store.put(key, await store.get(key)) is PutOutcome.ALREADY_PRESENT
    assert await check_archive(store, written.lineage) == []


# --- tampering, through the directory's files (the store's own contract cannot overwrite) ----------


@pytest.fixture
def local(tmp_path: Path) -> tuple[ArchiveStore, Path]:
    return ArchiveStore.local(tmp_path / "archive"), tmp_path / "archive"


def _kinds(findings: list[Finding]) -> list[tuple[str, int | None]]:
    return [(f.kind, f.index) for f in findings]


async def _tamper(local: tuple[ArchiveStore, Path], change: Callable[[Path, Written], None]) -> list[Finding]:
    store, root = local
    written = await write_archive(store)
    change(root, written)
    return await check_archive(store, written.lineage)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x20
    path.write_bytes(bytes(data))


async def test_flipped_byte(local: tuple[ArchiveStore, Path]) -> None:
    findings = await _tamper(local, lambda root, w: _flip(root / w.keys[1], 120))
    assert _kinds(findings) == [("crc_mismatch", 1), ("root_unverified", None)]
    assert findings[0].sequence is not None and findings[0].offset == 88


async def test_missing_segment(local: tuple[ArchiveStore, Path]) -> None:
    findings = await _tamper(local, lambda root, w: (root / w.keys[2]).unlink())
    assert _kinds(findings) == [("missing_segment", 2), ("root_unverified", None)]


async def test_extra_object(local: tuple[ArchiveStore, Path]) -> None:
    def add(root: Path, w: Written) -> None:
        (root / str(w.lineage) / "segments" / "stray.bin").write_bytes(b"x")
    findings = await _tamper(local, add)
    assert _kinds(findings) == [("orphan_object", None)]
    assert findings[0].key is not None and findings[0].key.endswith("stray.bin")


async def test_swapped_pair(local: tuple[ArchiveStore, Path]) -> None:
    def swap(root: Path, w: Written) -> None:
        a, b = root / w.keys[1], root / w.keys[2]
        da, db = a.read_bytes(), b.read_bytes()
        a.write_bytes(db)
        b.write_bytes(da)
    findings = await _tamper(local, swap)
    assert [k for k, _ in _kinds(findings)] == ["broken_link", "broken_link", "root_unverified"]


async def test_truncated_segment(local: tuple[ArchiveStore, Path]) -> None:
    def cut(root: Path, w: Written) -> None:
        path = root / w.keys[3]
        path.write_bytes(path.read_bytes()[:-40])
    findings = await _tamper(local, cut)
    assert findings[0].index == 3 and findings[0].kind in {"truncated", "merkle_mismatch", "hash_mismatch"}


async def test_segment_replaced_by_a_valid_forgery(local: tuple[ArchiveStore, Path]) -> None:
    """A well-formed segment with other events (re-encoded: CRCs, Merkle root and hash all correct) is
    still caught: its hash is not the one the manifest lists (and segment 2 links to)."""
    def forge(root: Path, w: Written) -> None:
        original = decode_segment((root / w.keys[1]).read_bytes())
        events = [ArchivedEvent(e.sequence, e.body.replace(b'"n"', b'"N"')) for e in original.events]
        (root / w.keys[1]).write_bytes(encode_segment(Stream.PUBLIC, w.lineage, 1, original.previous_hash, events))
    findings = await _tamper(local, forge)
    assert _kinds(findings) == [("manifest_mismatch", 1), ("root_unverified", None)]


async def test_forged_checkpoint(local: tuple[ArchiveStore, Path]) -> None:
    store, root = local
    written = await write_archive(store)
    path = root / checkpoint_key(written.lineage, written.size)
    path.write_text(path.read_text().replace(f"\n{written.size}\n", f"\n{written.size + 1}\n"))
    with pytest.raises(BadSignature):
        await check_archive(store, written.lineage)
