"""Archives for the recovery tests, written with the format's own encoders from real database rows.

:func:`archive_database` does by hand what the archiver does for the public stream: it reads the
change history of a database, cuts it into segments of ``per_segment`` events, puts each
create-only, then the public key, one signed checkpoint per segment boundary (so there are older
checkpoints to extend) and the manifest. :func:`raw_store` is the obstore handle below an
:class:`ArchiveStore`, for tampering that the create-only contract refuses (overwrite, delete).
The ``store`` fixture gives each test a fresh store on each backend (directory, SeaweedFS, moto) (import :func:`store_fixture`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from obstore.store import LocalStore, S3Store

from actors.archiver import PRIVATE_EXTENSION, Archiver, SealPolicy
from infra.archive_keys import archive_origin
from infra.archive_store import ArchiveStore
from infra.db import Target, connection
from protocol.archive import (
    GENESIS_HASH,
    ArchivedEvent,
    DecodedSegment,
    Stream,
    change_body,
    checkpoint_key,
    decode_segment,
    encode_segment,
    manifest_key,
    private_checkpoint_key,
    public_key_key,
    segment_key,
)
from protocol.archive_private import AgentRecord, OperationRecord, PrivateRecord, encode_private_record
from protocol.checkpoint import Checkpoint, SignerKey, generate_signer_key, sign_checkpoint
from protocol.manifest import encode_page, encode_paged, manifest_of
from protocol.merkle import CompactTree
from tests.corpus_fixtures import Stack
from tests.s3_server import S3Server


@dataclass
class Archived:
    """What :func:`archive_database` wrote."""

    lineage: uuid.UUID
    corpus_id: uuid.UUID
    key: SignerKey
    segments: list[DecodedSegment]
    root: bytes
    size: int

    def segment_key(self, index: int) -> str:
        s = self.segments[index]
        return segment_key(self.lineage, s.index, s.first_sequence, s.last_sequence)


#: Segments per manifest page in these fixtures: small, so that every archive the tests read has pages.
MANIFEST_PAGE = 3

async def archive_database(db: Target, store: ArchiveStore, *, per_segment: int = 5,
                           key: SignerKey | None = None, private: bool = True) -> Archived:
    """Archive the whole change history of ``db`` into ``store`` (public stream) and, with
    ``private``, its agent register and answered operation records (private stream)."""
    async with connection(db) as conn:
        witness = await conn.fetchrow("select corpus_id, lineage from corpus_witness")
        rows = await conn.fetch("select sequence, event from changes order by sequence")
        agents = await conn.fetch("select * from agents order by created_at, agent_id")
        operations = await conn.fetch("select * from operations where status is not null order by created_at")
    lineage, corpus_id = witness["lineage"], witness["corpus_id"]
    key = key or generate_signer_key(archive_origin(corpus_id))
    events = [ArchivedEvent(r["sequence"], change_body(r["event"])) for r in rows]
    previous, segments, tree = GENESIS_HASH, [], CompactTree()
    await store.put(public_key_key(lineage), (key.verifier().text() + "\n").encode())
    for index, start in enumerate(range(0, len(events), per_segment)):
        chunk = events[start:start + per_segment]
        data = encode_segment(Stream.PUBLIC, lineage, index, previous, chunk)
        segment = decode_segment(data)
        await store.put(segment_key(lineage, index, segment.first_sequence, segment.last_sequence), data)
        for event in chunk:
            tree.append_hash(event.leaf_hash)
        await store.put(checkpoint_key(lineage, tree.size),
                        sign_checkpoint(Checkpoint(key.name, tree.size, tree.root()), key).encode())
        segments.append(segment)
        previous = segment.hash
    # Paged as the archiver pages it (pages of MANIFEST_PAGE segments, then the rest in manifest.json).
    listed = manifest_of(lineage, None, segments).segments
    pages = []
    for first in range(0, len(listed) - len(listed) % MANIFEST_PAGE, MANIFEST_PAGE):
        page, page_data = encode_page(lineage, listed[first:first + MANIFEST_PAGE])
        await store.put(page.key(lineage), page_data)
        pages.append(page)
    await store.replace(manifest_key(lineage),
                        encode_paged(lineage, None, pages, listed[len(pages) * MANIFEST_PAGE:]))
    if private:
        records: list[PrivateRecord] = [
            AgentRecord(a["agent_id"], a["name"], a["description"], bytes(a["credential_hash"]), a["onboarded_at"],
                        a["created_at"]) for a in agents]
        # Operations after the agents they belong to, as the archiver captures them.
        records += [OperationRecord(o["author_id"], o["operation"], o["token"], bytes(o["request_hash"]),
                                    o["status"], o["response"], o["sequence"], o["created_at"]) for o in operations]
        frames = [ArchivedEvent(n, encode_private_record(r)) for n, r in enumerate(records, start=1)]
        previous, private_tree = GENESIS_HASH, CompactTree()
        for index, start in enumerate(range(0, len(frames), per_segment)):
            chunk = frames[start:start + per_segment]
            data = encode_segment(Stream.PRIVATE, lineage, index, previous, chunk)
            await store.put(segment_key(lineage, index, chunk[0].sequence, chunk[-1].sequence, Stream.PRIVATE), data)
            previous = decode_segment(data).hash
            for frame in chunk:
                private_tree.append_hash(frame.leaf_hash)
        if frames:
            note = sign_checkpoint(Checkpoint(key.name, private_tree.size, private_tree.root(), (PRIVATE_EXTENSION,)), key)
            await store.put(private_checkpoint_key(lineage, private_tree.size), note.encode())
    return Archived(lineage, corpus_id, key, segments, tree.root(), tree.size)


@contextlib.asynccontextmanager
async def archiving(stack: Stack, store: ArchiveStore, signer: SignerKey | None = None) -> AsyncIterator[Archiver]:
    """The real archiver actor on the stack's bus and database, sealing small segments, for the block."""
    signer = signer or generate_signer_key(archive_origin(stack.identity.corpus_id))
    archiver = Archiver(stack.bus, stack.db, identity=stack.identity, store=store, signer=signer,
                        node_id="recovery-test", policy=SealPolicy(events=4, seconds=0.1), sweep_interval=0.1,
                        manifest_page=MANIFEST_PAGE)
    await archiver.start()
    try:
        yield archiver
    finally:
        await archiver.stop(grace=5)


async def archiver_caught_up(stack: Stack, timeout: float = 60) -> None:
    """Poll (with a deadline) until both streams are published through their heads."""
    deadline = time.monotonic() + timeout
    while True:
        row = await stack.db.pool.fetchrow(
            "select (select published_through from archive_watermarks where stream = 0) = "
            "(select max(sequence) from changes) as public, "
            "(select published_through from archive_watermarks where stream = 1) = "
            "(select coalesce(max(sequence), 0) from archive_private_records) "
            "and not exists (select 1 from archive_private_pending) as private")
        if row["public"] and row["private"]:
            return
        assert time.monotonic() < deadline, "the archiver did not catch up"
        await asyncio.sleep(0.05)


def raw_store(store: ArchiveStore) -> LocalStore | S3Store:
    """The obstore store under ``store``: tests tamper through it, as an attacker with write access
    to the bucket would, bypassing the create-only contract."""
    return store._store


#: The S3 servers the store fixtures run on, by parameter name: the session fixture of each.
S3_BACKENDS = {"seaweedfs": "s3_server", "moto": "moto_s3"}


@pytest.fixture(name="store", params=["directory", *S3_BACKENDS])
def store_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> ArchiveStore:
    """A fresh archive store: on a local directory, on SeaweedFS and on moto's S3 server (the S3 API)."""
    if request.param == "directory":
        return ArchiveStore.local(tmp_path / "archive")
    server: S3Server = request.getfixturevalue(S3_BACKENDS[request.param])
    return server.store()
