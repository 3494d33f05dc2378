"""The archiver against the raw cost of the same work, on the same database in the same run.

Seeds a fresh database with ``--messages`` messages (``toastmachine dev seed``'s generator, about
1.3 changes per message), then measures, in events per second:

- **raw**: ``COPY (select sequence, event from changes order by sequence) TO STDOUT`` and one
  ``hashlib.sha256`` per row: reading and hashing the history with nothing else;
- **archive**: the archiver actor (default sealing rules: 500 events or 4 MiB) on a directory store,
  from start until every full segment is published (sealed, written, read back, verified,
  checkpointed, in the manifest);
- **verify**: every published segment read back from the store and decoded (CRCs, Merkle subtree
  root, hash, link to the previous one), all leaves appended to one tree, the root compared with the
  signed checkpoint's.

Targets (issue #11): archive >= 0.5x raw, verify >= 0.5x raw. Not measured here yet: the archiver's
lag under a sustained 200 writes/s (it needs the write path running beside it).

Run: ``python bench/archive.py [--dsn postgresql://postgres@127.0.0.1:5432/postgres] [--messages N]``
(the DSN is a server's maintenance database: a database of its own is created and dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.archiver import Archiver, SealPolicy
from infra.archive_keys import archive_origin
from infra.archive_store import ArchiveStore
from infra.bus import make_bus
from infra.db import Database, apply_migrations, ensure_identity
from protocol.archive import Stream, checkpoint_key, decode_segment, manifest_key, public_key_key, segment_key
from protocol.checkpoint import generate_signer_key, parse_verifier_key, verify_checkpoint
from protocol.manifest import decode_manifest
from protocol.merkle import CompactTree
from toastmachine.seed import seed_corpus


async def raw_rate(dsn: str) -> tuple[int, float]:
    """Rows read with COPY and hashed, and the seconds it took."""
    conn = await asyncpg.connect(dsn)
    rows = 0
    buffer = bytearray()
    started = time.perf_counter()

    async def sink(chunk: bytes) -> None:  # asyncpg awaits a callable output
        nonlocal rows
        buffer.extend(chunk)
        *lines, rest = buffer.split(b"\n")
        for line in lines:
            hashlib.sha256(line).digest()
            rows += 1
        buffer[:] = rest

    try:
        await conn.copy_from_query("select sequence, event from changes order by sequence", output=sink)
    finally:
        await conn.close()
    return rows, time.perf_counter() - started


async def archive_rate(db: Database, dsn: str, store: ArchiveStore) -> tuple[int, float]:
    """Events the archiver published from a cold start, and the seconds it took."""
    identity = await ensure_identity(db, None, None)
    signer = generate_signer_key(archive_origin(identity.corpus_id))
    head = int(await db.pool.fetchval("select count(*) from changes"))
    full = head - head % SealPolicy().events
    bus = make_bus(None)
    await bus.connect()
    archiver = Archiver(bus, db, identity=identity, store=store, signer=signer, node_id="bench", dsn=dsn,
                        policy=SealPolicy(seconds=3600), sweep_interval=0.05)
    started = time.perf_counter()
    await archiver.start()
    try:
        while int(await db.pool.fetchval(
                "select coalesce(max(tree_size), 0) from archive_segments where stream = 0 and state = 'published'")) < full:
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - started
    finally:
        await archiver.stop(grace=5)
        await bus.close()
    return full, elapsed


async def verify_rate(store: ArchiveStore, lineage: uuid.UUID, verifier_text: str) -> tuple[int, float]:
    """Events verified from the store alone, and the seconds it took."""
    started = time.perf_counter()
    manifest = decode_manifest(await store.get(manifest_key(lineage)))
    tree = CompactTree()
    previous = None
    for entry in manifest.segments:
        seg = decode_segment(await store.get(segment_key(lineage, entry.index, entry.first_sequence,
                                                         entry.last_sequence)),
                             expected_previous_hash=previous, expected_lineage=lineage,
                             expected_index=entry.index, expected_stream=Stream.PUBLIC)
        previous = seg.hash
        tree.extend(seg.leaf_hashes)
    checkpoint = verify_checkpoint(await store.get(checkpoint_key(lineage, tree.size)),
                                   parse_verifier_key(verifier_text))
    assert checkpoint.root == tree.root(), "the recomputed root differs from the checkpoint's"
    return tree.size, time.perf_counter() - started


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--messages", type=int, default=100_000)
    args = parser.parse_args()
    name = f"tm_bench_archive_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.dsn)
    await admin.execute(f'create database "{name}"')
    await admin.close()
    dsn = args.dsn.rsplit("/", 1)[0] + "/" + name
    try:
        db = await Database.connect(dsn, min_size=1, max_size=4)
        try:
            await apply_migrations(db)
            identity = await ensure_identity(db, None, None)
            print(f"seeding {args.messages:,} messages ...", flush=True)
            await seed_corpus(db, messages=args.messages)
            rows, raw_s = await raw_rate(dsn)
            with tempfile.TemporaryDirectory() as tmp:
                store = ArchiveStore.local(Path(tmp))
                events, archive_s = await archive_rate(db, dsn, store)
                verifier = (await store.get(public_key_key(identity.lineage))).decode().strip()
                verified, verify_s = await verify_rate(store, identity.lineage, verifier)
        finally:
            await db.close()
    finally:
        admin = await asyncpg.connect(args.dsn)
        await admin.execute(f'drop database if exists "{name}" with (force)')
        await admin.close()
    raw = rows / raw_s
    print(f"raw COPY + sha256: {rows:,} rows in {raw_s:.2f} s = {raw:,.0f} events/s")
    print(f"archive:           {events:,} events in {archive_s:.2f} s = {events / archive_s:,.0f} events/s "
          f"({events / archive_s / raw:.2f}x raw; target 0.5x)")
    print(f"verify:            {verified:,} events in {verify_s:.2f} s = {verified / verify_s:,.0f} events/s "
          f"({verified / verify_s / raw:.2f}x raw; target 0.5x)")


if __name__ == "__main__":
    asyncio.run(main())
