"""The public archive as the fronts and the CLI read it (SPEC §5): status, segments, checkpoints and
inclusion proofs. Front-neutral: queries and plain values, no HTTP.

Only the public stream (0) is ever read here: nothing in this module can answer with a private
segment, a private checkpoint or a private record.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from typing import Any

from actors.reads.corpus import ARCHIVE_PATH
from infra.archive_store import ArchiveStore, ObjectNotFound
from infra.db.pool import Target, connection
from protocol.archive import Stream, change_body, public_key_key, segment_key
from protocol.merkle import inclusion_ranges, leaf_hash, node_hash, split_point, tree_root
from protocol.representations import format_time

#: Where the web front serves the public archive's parts.
SEGMENTS_PATH = ARCHIVE_PATH + "/segments"
CHECKPOINTS_PATH = ARCHIVE_PATH + "/checkpoints"
PROOF_PATH = ARCHIVE_PATH + "/proof"
MANIFEST_PATH = ARCHIVE_PATH + "/manifest.json"
#: Segments listed by the status, most recent last (older ones are in the manifest).
STATUS_SEGMENTS = 1000
#: Leaves read per query while computing a proof.
_PROOF_PAGE = 1000
#: Leaves per cached chunk of the public tree, as a power of two (``archive_proof_chunks``): a proof
#: reads at most two chunks of leaves and one cached root per chunk of the tree.
PROOF_CHUNK_HEIGHT = 9
#: Chunks computed (and inserted) per round while filling the cache.
_FILL_CHUNKS = 8
#: Key of the transaction-level advisory lock that serialises filling the chunk cache: the first
#: 8 bytes of sha256(b"toastmachine:proof-chunks") as a signed big-endian integer.
PROOF_CHUNK_LOCK = int.from_bytes(hashlib.sha256(b"toastmachine:proof-chunks").digest()[:8], "big", signed=True)
#: ``<index>-<first>-<last>``, as in the store's keys.
SEGMENT_NAME = re.compile(r"(?P<index>[0-9]{10})-(?P<first>[0-9]{19})-(?P<last>[0-9]{19})")

_PUBLIC = int(Stream.PUBLIC)


@dataclass(frozen=True, slots=True)
class Watermarks:
    """The highest sequence in a written (archived), a verified and a published segment (0: none)."""

    archived_through: int
    verified_through: int
    published_through: int


async def watermarks(target: Target, stream: Stream = Stream.PUBLIC) -> Watermarks:
    """The stream's watermarks."""
    async with connection(target) as conn:
        row = await conn.fetchrow("select archived_through, verified_through, published_through "
                                  "from archive_watermarks where stream = $1", int(stream))
    if row is None:
        return Watermarks(0, 0, 0)
    return Watermarks(row["archived_through"], row["verified_through"], row["published_through"])


def segment_json(row: Any) -> dict[str, Any]:
    """One segment as the archive status lists it."""
    out: dict[str, Any] = {"index": row["segment_index"], "first_sequence": row["first_sequence"],
                           "last_sequence": row["last_sequence"], "event_count": row["event_count"],
                           "state": row["state"]}
    if row["hash"] is not None:
        out["size"] = row["size"]
        out["hash"] = bytes(row["hash"]).hex()
        out["name"] = f"{row['segment_index']:010d}-{row['first_sequence']:019d}-{row['last_sequence']:019d}"
    return out


async def archive_status(target: Target, store: ArchiveStore | None, lineage: str) -> dict[str, Any]:
    """``GET /corpus/archive``'s body: segments, latest checkpoint, public key and watermarks."""
    async with connection(target) as conn:
        rows = await conn.fetch(
            "select * from (select segment_index, first_sequence, last_sequence, event_count, state, size, hash "
            "from archive_segments where stream = $1 order by segment_index desc limit $2) as recent "
            "order by segment_index", _PUBLIC, STATUS_SEGMENTS)
        count = await conn.fetchval("select count(*) from archive_segments where stream = $1", _PUBLIC)
        checkpoint = await conn.fetchrow(NEWEST_CHECKPOINT, _PUBLIC)
        head = await conn.fetchval("select coalesce(max(sequence), 0) from changes")
    marks = await watermarks(target)
    lag = await archive_lag(target, marks.verified_through)
    return {
        "lineage": lineage,
        "segments": [segment_json(r) for r in rows],
        "segment_count": count,
        "checkpoint": checkpoint["note"] if checkpoint is not None else None,
        "tree_size": checkpoint["tree_size"] if checkpoint is not None else 0,
        "public_key": await public_key(store, lineage),
        "archived_through": marks.archived_through,
        "verified_through": marks.verified_through,
        "published_through": marks.published_through,
        "head_sequence": head,
        "lag_events": lag,
        "links": {"manifest": MANIFEST_PATH, "segments": f"{SEGMENTS_PATH}/", "checkpoints": f"{CHECKPOINTS_PATH}/",
                  "proof": PROOF_PATH},
    }


#: The newest checkpoint the archiver published of a stream ($1): its tree size, signed note and root.
NEWEST_CHECKPOINT = ("select tree_size, note, root from archive_checkpoints where stream = $1 "
                     "order by tree_size desc limit 1")
#: Changes counted exactly at most by :func:`changes_after` (a count costs a scan of that many rows).
LAG_CAP = 100_000


async def changes_after(target: Target, after: int, cap: int = LAG_CAP) -> int:
    """Committed changes with a sequence above ``after``, counted up to ``cap``: how far a
    consumer of the history (the archiver, the publisher) is behind."""
    async with connection(target) as conn:
        return int(await conn.fetchval(
            "select count(*) from (select 1 from changes where sequence > $1 limit $2) as behind", after, cap))


async def archive_lag(target: Target, verified_through: int | None = None, cap: int = LAG_CAP) -> int:
    """Committed changes above the verified watermark (counted up to ``cap``)."""
    if verified_through is None:
        async with connection(target) as conn:
            verified_through = int(await conn.fetchval(
                "select coalesce((select verified_through from archive_watermarks where stream = 0), 0)"))
    return await changes_after(target, verified_through, cap)


async def store_state(target: Target) -> dict[str, Any]:
    """Whether the active archiver's store answers, as the archiver last recorded it:
    ``{"status": "ok"}`` (also before any archiver ran), or ``{"status": "failing", "error",
    "failing_since", "node"}``."""
    async with connection(target) as conn:
        row = await conn.fetchrow("select error, failing_since, node_id from archiver_store_state")
    if row is None or row["error"] is None:
        return {"status": "ok"}
    return {"status": "failing", "error": row["error"], "node": row["node_id"],
            "failing_since": format_time(row["failing_since"])}


async def public_key(store: ArchiveStore | None, lineage: str) -> str | None:
    """The checkpoint signer's verifier key as published in the store, or None before the archiver
    published it (or without a store)."""
    if store is None:
        return None
    try:
        return (await store.get(public_key_key(uuid.UUID(lineage)), max_bytes=4096)).decode().strip()
    except ObjectNotFound:
        return None


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """A verified public segment: where it is and what it must hash to."""

    key: str
    hash: bytes
    size: int


async def find_segment(target: Target, lineage: str, name: str) -> SegmentRef | None:
    """The verified (or published) public segment named ``name``, or None (unknown, malformed, not
    verified yet)."""
    m = SEGMENT_NAME.fullmatch(name)
    if m is None:
        return None
    index, first, last = int(m["index"]), int(m["first"]), int(m["last"])
    async with connection(target) as conn:
        row = await conn.fetchrow(
            "select hash, size from archive_segments where stream = $1 and segment_index = $2 "
            "and first_sequence = $3 and last_sequence = $4 and state in ('verified', 'published')",
            _PUBLIC, index, first, last)
    if row is None:
        return None
    return SegmentRef(segment_key(uuid.UUID(lineage), index, first, last, Stream.PUBLIC), bytes(row["hash"]),
                      row["size"])


async def checkpoint_note(target: Target, size: int) -> str | None:
    """The signed public checkpoint of tree size ``size``, or None."""
    async with connection(target) as conn:
        return await conn.fetchval("select note from archive_checkpoints where stream = $1 and tree_size = $2",
                                   _PUBLIC, size)


@dataclass(frozen=True, slots=True)
class InclusionProof:
    """Leaf ``leaf_index`` (the change ``sequence``) of the public tree of size ``tree_size``."""

    sequence: int
    leaf_index: int
    tree_size: int
    leaf_hash: bytes
    path: list[bytes]
    checkpoint: str

    def to_json(self) -> dict[str, Any]:
        return {"sequence": self.sequence, "leaf_index": self.leaf_index, "tree_size": self.tree_size,
                "leaf_hash": self.leaf_hash.hex(), "proof": [p.hex() for p in self.path],
                "checkpoint": self.checkpoint}


class ProofUnavailable(Exception):
    """No proof: ``reason`` says which of sequence and size is not in the published archive."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field


async def inclusion_proof(target: Target, sequence: int, size: int | None, *,
                          chunk_height: int = PROOF_CHUNK_HEIGHT) -> InclusionProof:
    """The audit path of change ``sequence`` in the published tree of ``size`` events (None: the
    latest checkpoint).

    The cost is bounded whatever the history's length: the path's subtrees are built from the cached
    roots of aligned chunks of ``2 ** chunk_height`` leaves (``archive_proof_chunks``, filled from the
    change history by the first proof that needs them) and from the leaves of at most two chunks
    (the leaf's own and the tree's incomplete last one).
    """
    chunk = 1 << chunk_height
    async with connection(target) as conn:
        if size is None:
            cp = await conn.fetchrow(NEWEST_CHECKPOINT, _PUBLIC)
        else:
            cp = await conn.fetchrow("select tree_size, note from archive_checkpoints where stream = $1 "
                                     "and tree_size = $2", _PUBLIC, size)
        if cp is None:
            raise ProofUnavailable("size", "no published checkpoint has this tree size")
        size = int(cp["tree_size"])
        seg = await conn.fetchrow(
            "select first_sequence, tree_size - event_count as offset_ from archive_segments where stream = $1 "
            "and first_sequence <= $2 and last_sequence >= $2 and tree_size <= $3", _PUBLIC, sequence, size)
        if seg is None:
            raise ProofUnavailable("sequence", "this sequence is not in the archived tree of that size")
        before = await conn.fetchval("select count(*) from changes where sequence >= $1 and sequence < $2",
                                     seg["first_sequence"], sequence)
        present = await conn.fetchval("select 1 from changes where sequence = $1", sequence)
        if present is None:
            raise ProofUnavailable("sequence", "no change has this sequence")
        index = int(seg["offset_"]) + int(before)
        complete = size // chunk
        roots = await _chunk_roots(conn, chunk_height, complete)
        # The leaves of the leaf's own chunk and of the incomplete last one: every subtree of the path
        # that is not a whole chunk lies inside one of these two (RFC 6962 subtrees are aligned).
        leaves: dict[int, list[bytes]] = {}
        for c in sorted({index // chunk, complete}):
            start = c * chunk
            if start < size:
                leaves[c] = [h for _, h in await _leaves(conn, start, min(chunk, size - start))]
    if any(len(hs) != min(chunk, size - c * chunk) for c, hs in leaves.items()):
        raise ProofUnavailable("size", "the change history no longer holds this tree")

    def subtree(lo: int, hi: int) -> bytes:
        c = lo // chunk
        if hi - lo == chunk and c < complete:
            return roots[c]
        if hi - lo <= chunk:
            return tree_root(leaves[c][lo - c * chunk:hi - c * chunk])
        k = split_point(hi - lo)
        return node_hash(subtree(lo, lo + k), subtree(lo + k, hi))

    path = [subtree(lo, hi) for lo, hi in inclusion_ranges(index, size)]
    leaf = leaves[index // chunk][index % chunk]
    return InclusionProof(sequence, index, size, leaf, path, cp["note"])


async def _leaves(conn: Any, position: int, count: int) -> list[tuple[int, bytes]]:
    """``(sequence, leaf hash)`` of up to ``count`` archived public leaves from leaf ``position`` on
    (fewer when the archived history ends first), read in pages.

    Each leaf is hashed by the format version of the segment that holds it: a lineage begun under
    version 1 keeps its version-1 leaves after the archiver moved on to version 2.
    """
    segs = await conn.fetch(
        "select first_sequence, last_sequence, format_version, tree_size - event_count as start "
        "from archive_segments where stream = $1 and tree_size > $2 and tree_size - event_count < $3 "
        "order by segment_index", _PUBLIC, position, position + count)
    if not segs:
        return []
    # The change at ``position``: at most a segment's length into the segment that holds it.
    after = await conn.fetchval("select sequence - 1 from changes where sequence >= $1 order by sequence "
                                "offset $2 limit 1", segs[0]["first_sequence"], position - int(segs[0]["start"]))
    last = segs[-1]["last_sequence"]
    out: list[tuple[int, bytes]] = []
    at = 0
    while after is not None and len(out) < count:
        rows = await conn.fetch("select sequence, event from changes where sequence > $1 and sequence <= $2 "
                                "order by sequence limit $3", after, last, min(_PROOF_PAGE, count - len(out)))
        if not rows:
            break
        for r in rows:
            while segs[at]["last_sequence"] < r["sequence"]:
                at += 1
            out.append((r["sequence"], leaf_hash(change_body(r["event"], segs[at]["format_version"]))))
        after = rows[-1]["sequence"]
    return out


async def _chunk_roots(conn: Any, height: int, count: int) -> list[bytes]:
    """The roots of chunks ``0 .. count - 1`` of the given height, computing the missing ones.

    Filling runs under a transaction-level advisory lock, so concurrent proofs on any node compute
    each chunk once: the waiters find it cached. Only whole chunks below a published tree size are
    asked for, so a cached root never changes.
    """
    roots = await _cached_roots(conn, height, count)
    if len(roots) == count:
        return roots
    async with conn.transaction():
        await conn.execute("select pg_advisory_xact_lock($1)", PROOF_CHUNK_LOCK)
        roots = await _cached_roots(conn, height, count)
        chunk = 1 << height
        while len(roots) < count:
            first = len(roots)
            batch = min(count - first, _FILL_CHUNKS)
            hashes = [h for _, h in await _leaves(conn, first * chunk, batch * chunk)]
            if len(hashes) != batch * chunk:
                raise ProofUnavailable("size", "the change history no longer holds this tree")
            fresh = [tree_root(hashes[i * chunk:(i + 1) * chunk]) for i in range(batch)]
            await conn.executemany("insert into archive_proof_chunks (height, chunk, root) values ($1, $2, $3) "
                                   "on conflict do nothing", [(height, first + i, r) for i, r in enumerate(fresh)])
            roots.extend(fresh)
    return roots


async def _cached_roots(conn: Any, height: int, count: int) -> list[bytes]:
    """The cached roots from chunk 0 up to the first missing one (at most ``count``)."""
    rows = await conn.fetch("select chunk, root from archive_proof_chunks where height = $1 and chunk < $2 "
                            "order by chunk", height, count)
    roots: list[bytes] = []
    for row in rows:
        if row["chunk"] != len(roots):
            break
        roots.append(bytes(row["root"]))
    return roots
