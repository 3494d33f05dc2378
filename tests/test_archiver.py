"""The archiver actor in the test process, on the write path's two backend pairs and a directory store
(and SeaweedFS where the store matters): sealing by each rule, deterministic bytes, the safe
watermark under concurrent writers, single-active standby and take-over, the private stream, a
store that goes away and comes back, and a store that ignores create-only writes."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.archiver import (
    BATCH_GROWTH,
    BATCH_SEGMENTS,
    FIRST_BATCH_SEGMENTS,
    PUBLISH_INTERVAL,
    STORE_BACKOFF,
    Archiver,
    SealPolicy,
    StoreLacksArchive,
    active_archiver,
    application_name,
    seal_cuts,
)
from infra.archive_keys import archive_origin
from infra.archive_store import STAGING_MAX_AGE, ArchiveStore, CreateOnlyIgnored
from protocol import archive as fmt
from protocol.archive import (
    GENESIS_HASH,
    ArchivedEvent,
    Stream,
    change_body,
    checkpoint_key,
    decode_segment,
    encode_segment,
    manifest_key,
    parse_segment_key,
    public_key_key,
)
from protocol.archive_private import AgentRecord, OperationRecord, decode_private_record
from protocol.checkpoint import SignerKey, generate_signer_key, parse_verifier_key, verify_checkpoint
from protocol.errors import ConfigError
from protocol.manifest import PAGE_SEGMENTS, decode_manifest
from protocol.merkle import CompactTree
from tests.corpus_fixtures import Stack
from tests.s3_server import S3Server, seaweedfs, sloppy_s3

WAIT = 60.0


def signer_for(stack: Stack) -> SignerKey:
    return generate_signer_key(archive_origin(stack.identity.corpus_id))


@contextlib.asynccontextmanager
async def archiving(stack: Stack, store: ArchiveStore, policy: SealPolicy, *, node_id: str = "arch-a",
                    signer: SignerKey | None = None,
                    store_backoff: tuple[float, float] = STORE_BACKOFF,
                    batch_segments: int = BATCH_SEGMENTS, manifest_page: int = PAGE_SEGMENTS,
                    publish_interval: float = PUBLISH_INTERVAL) -> AsyncIterator[Archiver]:
    """An archiver on the stack's bus and database, running for the block."""
    archiver = Archiver(stack.bus, stack.db, identity=stack.identity, store=store,
                        signer=signer or signer_for(stack), node_id=node_id, policy=policy,
                        sweep_interval=0.2, standby_interval=0.2, store_backoff=store_backoff,
                        batch_segments=batch_segments, manifest_page=manifest_page,
                        publish_interval=publish_interval)
    await archiver.start()
    try:
        yield archiver
    finally:
        await archiver.stop(grace=2)


async def until(condition: Callable[[], Awaitable[Any]], timeout: float = WAIT, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last: {value!r})")
        await asyncio.sleep(0.05)


async def segments(stack: Stack, stream: Stream = Stream.PUBLIC) -> list[dict[str, Any]]:
    rows = await stack.db.pool.fetch(
        "select segment_index, first_sequence, last_sequence, event_count, state, hash from archive_segments "
        "where stream = $1 order by segment_index", int(stream))
    return [dict(r) for r in rows]


async def published(stack: Stack, count: int, stream: Stream = Stream.PUBLIC) -> list[dict[str, Any]]:
    """Wait until ``count`` segments of ``stream`` are published; return all its segments."""
    async def check() -> list[dict[str, Any]] | None:
        segs = await segments(stack, stream)
        done = [s for s in segs if s["state"] == "published"]
        return segs if len(done) >= count else None
    return await until(check, what=f"{count} published {stream.name.lower()} segments")  # type: ignore[no-any-return]


async def write_messages(stack: Stack, n: int, content: str = "hello") -> list[int]:
    agent = await stack.register()
    first = await stack.conversation(agent)
    sequences = [first["sequence"]]
    for _ in range(n - 1):
        sequences.append((await stack.message(agent, first["conversation"]["id"], content=content))["sequence"])
    return sequences


async def read_archive(store: ArchiveStore, lineage: uuid.UUID, stream: Stream = Stream.PUBLIC) -> list[Any]:
    """Every segment of ``stream`` in the store, decoded and checked link by link, in index order."""
    keys = sorted([o.key async for o in store.list(str(lineage))])
    parsed = [(k, parse_segment_key(k)) for k in keys]
    mine = [(k, p) for k, p in parsed if p is not None and p.stream is stream]
    out = []
    previous = None
    for i, (key, _p) in enumerate(mine):
        seg = decode_segment(await store.get(key), expected_previous_hash=previous, expected_lineage=lineage,
                             expected_index=i, expected_stream=stream)
        previous = seg.hash
        out.append(seg)
    return out


def local(tmp_path: Path) -> ArchiveStore:
    return ArchiveStore.local(tmp_path / "archive")


# --- sealing rules ---------------------------------------------------------------------------------


async def test_segments_seal_at_the_event_count_and_publish_manifest_and_checkpoint(
        stack: Stack, tmp_path: Path) -> None:
    store = local(tmp_path)
    signer = signer_for(stack)
    sequences = await write_messages(stack, 7)
    lineage = stack.identity.lineage
    async with archiving(stack, store, SealPolicy(events=3, seconds=3600), signer=signer) as archiver:
        segs = await published(stack, 2)
        # The 7th event waits for two more (or an hour): the archiver went idle without sealing it.
        await until(lambda: asyncio.sleep(0, archiver.lag_events == 1), what="the lag to be measured")
        assert len(await segments(stack)) == 2
        assert [(s["first_sequence"], s["last_sequence"], s["event_count"]) for s in segs] == [
            (sequences[0], sequences[2], 3), (sequences[3], sequences[5], 3)]
        # Two more events fill the third segment, which brings its own checkpoint.
        sequences += await write_messages(stack, 2)
        segs = await published(stack, 3)
    decoded = await read_archive(store, lineage)
    assert [e.sequence for s in decoded for e in s.events] == sequences[:9]
    manifest = decode_manifest(await store.get(manifest_key(lineage)))
    assert [s.hash for s in manifest.segments] == [bytes(s["hash"]).hex() for s in segs]
    verifier = parse_verifier_key((await store.get(public_key_key(lineage))).decode())
    checkpoint = verify_checkpoint(await store.get(checkpoint_key(lineage, 9)), verifier)
    tree = CompactTree()
    roots = {}
    for s in decoded:
        for e in s.events:
            tree.append(e.body)
        roots[tree.size] = tree.root()
    assert (checkpoint.size, checkpoint.root) == (9, roots[9])
    # The two segments found waiting at the start were one catch-up batch: one checkpoint for both
    # (none of size 3). It is kept beside the newer one, which extends it.
    assert verify_checkpoint(await store.get(checkpoint_key(lineage, 6)), verifier).root == roots[6]
    assert await store.head(checkpoint_key(lineage, 3)) is None


async def test_a_backlog_is_caught_up_in_batches_that_grow_from_the_first_size(stack: Stack, tmp_path: Path) -> None:
    """A cold start behind: the first batch is FIRST_BATCH_SEGMENTS segments, each one after it
    BATCH_GROWTH times the one before, up to the batch limit, and each batch is published under its
    own checkpoint when publishes are not spaced out."""
    store = local(tmp_path)
    sequences = await write_messages(stack, 123)  # 41 segments of 3 events
    async with archiving(stack, store, SealPolicy(events=3, seconds=3600), batch_segments=20, publish_interval=0):
        segs = await published(stack, 41)
    assert [s["event_count"] for s in segs] == [3] * 41
    assert [s["last_sequence"] for s in segs] == sequences[2::3]
    sizes = [r["tree_size"] for r in await stack.db.pool.fetch(
        "select tree_size from archive_checkpoints where stream = 0 order by tree_size")]
    # Batches of 4, 16 and 20 (the limit, not 64) segments, then the one segment left.
    assert (FIRST_BATCH_SEGMENTS, BATCH_GROWTH) == (4, 4)
    assert sizes == [12, 60, 120, 123]
    for size in sizes:
        assert await store.head(checkpoint_key(stack.identity.lineage, size)) is not None


async def test_behind_the_checkpoints_are_spaced_out_and_the_last_covers_everything(
        stack: Stack, tmp_path: Path) -> None:
    """While batches follow one another at once, a verified batch is published only when the last
    checkpoint is older than the publish interval: the first batch is published, the ones after it
    wait for the round that finds nothing more to seal, whose checkpoint covers them all."""
    store = local(tmp_path)
    sequences = await write_messages(stack, 123)  # batches of 4, 16 and 20 segments, then 1
    async with archiving(stack, store, SealPolicy(events=3, seconds=3600), batch_segments=20,
                         publish_interval=3600):
        await _caught_up_intact(stack, store, sequences, 41)
    sizes = [r["tree_size"] for r in await stack.db.pool.fetch(
        "select tree_size from archive_checkpoints where stream = 0 order by tree_size")]
    assert sizes == [12, 123]


class _Hooked(ArchiveStore):
    """A directory store that runs ``before_get`` / ``before_put`` (given the key) before the real call:
    a test's way to pick the moment a real fault happens to the files."""

    before_get: Callable[[str], None] = staticmethod(lambda key: None)
    before_put: Callable[[str], None] = staticmethod(lambda key: None)

    async def get(self, key: str, **kwargs: Any) -> bytes:
        self.before_get(key)
        return await super().get(key, **kwargs)

    async def put(self, key: str, data: bytes) -> Any:
        self.before_put(key)
        return await super().put(key, data)


async def _caught_up_intact(stack: Stack, store: ArchiveStore, sequences: list[int], count: int) -> None:
    """Every event in ``count`` published segments, read back whole, under checkpoints that each
    extend the one before."""
    segs = await published(stack, count)
    assert [s["state"] for s in segs] == ["published"] * count
    decoded = await read_archive(store, stack.identity.lineage)
    assert [e.sequence for seg in decoded for e in seg.events] == sequences
    leaves = fmt.leaf_hashes(decoded)
    checkpoints = await stack.db.pool.fetch(
        "select tree_size, root from archive_checkpoints where stream = 0 order by tree_size")
    assert checkpoints[-1]["tree_size"] == len(sequences)
    for row in checkpoints:  # each the root of the archived history up to its size
        tree = CompactTree()
        tree.extend(leaves[:row["tree_size"]])
        assert tree.root() == bytes(row["root"]), row["tree_size"]


async def test_a_segment_gone_before_its_read_back_is_written_again_while_the_next_batch_goes_on(
        stack: Stack, tmp_path: Path) -> None:
    """Behind, a batch is read back while the next one is sealed and put. A segment of it removed
    from the directory just before its read-back (a real unlink) is written again from the history,
    and everything is published."""
    store = _Hooked.local(tmp_path / "archive")
    sequences = await write_messages(stack, 60)  # 20 segments of 3: batches of 4 and 16
    removed: list[str] = []

    def unlink_first_of_second_batch(key: str) -> None:
        parsed = parse_segment_key(key)
        if parsed is not None and parsed.stream is Stream.PUBLIC and parsed.index == FIRST_BATCH_SEGMENTS \
                and not removed:
            (tmp_path / "archive" / key).unlink()
            removed.append(key)

    store.before_get = unlink_first_of_second_batch
    async with archiving(stack, store, SealPolicy(events=3, seconds=3600), batch_segments=16):
        await _caught_up_intact(stack, store, sequences, 20)
    assert len(removed) == 1 and await store.head(removed[0]) is not None


async def test_a_stop_while_a_batch_is_read_back_records_it_first(stack: Stack, tmp_path: Path) -> None:
    """Stopped while its last batch is being read back, the archiver records it verified and
    publishes it before it ends (a successor would otherwise read it back again frame by frame)."""
    store = _Hooked.local(tmp_path / "archive")
    await write_messages(stack, 6)
    stopping: list[asyncio.Task[None]] = []
    archiver = Archiver(stack.bus, stack.db, identity=stack.identity, store=store, signer=signer_for(stack),
                        node_id="arch-stop", policy=SealPolicy(events=2, seconds=3600), sweep_interval=0.2)

    def stop_at_read_back(key: str) -> None:
        parsed = parse_segment_key(key)
        if parsed is not None and parsed.stream is Stream.PUBLIC and not stopping:
            stopping.append(asyncio.get_running_loop().create_task(archiver.stop(grace=10)))

    store.before_get = stop_at_read_back
    await archiver.start()
    try:
        await until(lambda: asyncio.sleep(0, stopping), what="the read-back")
        await asyncio.wait_for(stopping[0], WAIT)
    finally:
        await archiver.stop(grace=2)
    assert [s["state"] for s in await segments(stack)] == ["published"] * 3


async def test_a_put_failing_while_the_batch_before_is_read_back_loses_nothing(stack: Stack, tmp_path: Path) -> None:
    """The put of the next batch fails (a directory stands at its key: the store reports it present,
    then unreadable) while the batch before is being read back: that read-back is dropped, the
    archiver backs off, and the next round verifies both from the recorded states."""
    store = _Hooked.local(tmp_path / "archive")
    sequences = await write_messages(stack, 60)
    blocked: list[Path] = []
    failed_at: list[datetime.datetime] = []

    def occupy_once(key: str) -> None:
        parsed = parse_segment_key(key)
        path = tmp_path / "archive" / key
        if blocked and path == blocked[0]:
            path.rmdir()  # the second attempt finds the key free
        elif parsed is not None and parsed.stream is Stream.PUBLIC and parsed.index == FIRST_BATCH_SEGMENTS + 4 \
                and not blocked:
            path.mkdir(parents=True)
            blocked.append(path)
            failed_at.append(datetime.datetime.now(datetime.UTC))

    store.before_put = occupy_once
    async with archiving(stack, store, SealPolicy(events=3, seconds=3600), batch_segments=8,
                         store_backoff=(0.05, 0.2)) as archiver:
        await _caught_up_intact(stack, store, sequences, 20)
        assert archiver.store_error is None
    assert blocked and not blocked[0].is_dir()
    # The batch before was being read back when the put failed: it was recorded verified after.
    first_verified = await stack.db.pool.fetchval(
        "select max(verified_at) from archive_segments where stream = 0 and segment_index < $1", FIRST_BATCH_SEGMENTS)
    assert first_verified > failed_at[0]


async def test_a_segment_seals_when_the_next_event_would_pass_the_byte_limit(stack: Stack, tmp_path: Path) -> None:
    store = local(tmp_path)
    await write_messages(stack, 8, content="x" * 700)
    async with archiving(stack, store, SealPolicy(events=500, bytes=4096, seconds=3600)):
        segs = await published(stack, 2)
    decoded = await read_archive(store, stack.identity.lineage)
    assert all(s.size <= 4096 for s in decoded)
    assert len(decoded) == len([s for s in segs if s["state"] == "published"]) >= 2
    # Sealed by size: each one is full, i.e. its successor's first event would not have fitted.
    for seg, nxt in itertools.pairwise(decoded):
        assert seg.size + 16 + len(nxt.events[0].body) > 4096


async def test_events_each_past_the_byte_limit_are_a_segment_each_and_none_waits(stack: Stack, tmp_path: Path) -> None:
    """Every batch of a cold start here holds one such event (its byte budget is one segment); each
    is sealed at once, the last one too, with no event after it and the age rule an hour away."""
    store = local(tmp_path)
    sequences = await write_messages(stack, 4, content="x" * 3000)
    async with archiving(stack, store, SealPolicy(events=500, bytes=2048, seconds=3600)):
        segs = await published(stack, 4)
    assert [(s["first_sequence"], s["last_sequence"]) for s in segs] == [(n, n) for n in sequences]
    decoded = await read_archive(store, stack.identity.lineage)
    assert [e.sequence for s in decoded for e in s.events] == sequences


async def test_a_partial_segment_seals_after_its_first_event_is_old_enough(stack: Stack, tmp_path: Path) -> None:
    store = local(tmp_path)
    sequences = await write_messages(stack, 2)
    async with archiving(stack, store, SealPolicy(events=500, seconds=1.0)) as archiver:
        segs = await published(stack, 1)
        assert archiver.verified_through.get(Stream.PUBLIC) == sequences[-1]
    assert [(s["first_sequence"], s["last_sequence"]) for s in segs] == [(sequences[0], sequences[1])]


async def test_encoding_a_sealed_range_again_gives_the_same_bytes(stack: Stack, tmp_path: Path) -> None:
    """The bytes are a function of the events and the previous hash only: re-encoding the sealed
    range from the database gives the stored object exactly (also for content whose JSON holds
    backslashes, which the archiver's COPY reads escape once more)."""
    store = local(tmp_path)
    await write_messages(stack, 5, content='back\\slash, tab\t, "quotes", new\nline, \u00e9\u4e2d')
    async with archiving(stack, store, SealPolicy(events=2, seconds=3600)):
        await published(stack, 2)
    lineage = stack.identity.lineage
    previous = None
    for seg in await read_archive(store, lineage):
        rows = await stack.db.pool.fetch("select sequence, event from changes where sequence between $1 and $2 "
                                         "order by sequence", seg.first_sequence, seg.last_sequence)
        again = encode_segment(Stream.PUBLIC, lineage, seg.index, previous or GENESIS_HASH,
                               [ArchivedEvent(r["sequence"], change_body(r["event"])) for r in rows])
        assert again[-32:] == seg.hash
        previous = seg.hash


async def test_no_segment_skips_a_sequence_under_concurrent_writers(stack: Stack, tmp_path: Path) -> None:
    """Many writers commit concurrently while the archiver seals tiny segments as fast as it can:
    the archived sequences are exactly the history's, in order, with no sequence skipped by a
    segment and committed later below its end."""
    store = local(tmp_path)
    agents = [await stack.register() for _ in range(4)]
    convs = [await stack.conversation(a) for a in agents]
    async with archiving(stack, store, SealPolicy(events=3, seconds=0.05)):
        async def writer(i: int) -> None:
            for _ in range(15):
                await stack.message(agents[i], convs[i]["conversation"]["id"], content="c")
        await asyncio.gather(*(writer(i) for i in range(4)))
        head = int(await stack.db.pool.fetchval("select max(sequence) from changes"))

        async def archived_to_head() -> bool:
            row = await stack.db.pool.fetchval("select published_through from archive_watermarks where stream = 0")
            return int(row) >= head
        await until(archived_to_head, what="the archive to reach the head")
    history = [r["sequence"] for r in await stack.db.pool.fetch("select sequence from changes order by sequence")]
    decoded = await read_archive(store, stack.identity.lineage)
    assert [e.sequence for s in decoded for e in s.events] == history


# --- single-active --------------------------------------------------------------------------------


async def test_a_second_archiver_stays_standby_and_takes_over_when_the_first_stops(
        stack: Stack, tmp_path: Path) -> None:
    store = local(tmp_path)
    signer = signer_for(stack)
    await write_messages(stack, 3)
    async with archiving(stack, store, SealPolicy(events=2, seconds=3600), node_id="first", signer=signer) as first:
        await published(stack, 1)
        async with archiving(stack, store, SealPolicy(events=2, seconds=3600), node_id="second",
                             signer=signer) as second:
            await asyncio.sleep(0.6)  # three of the standby's lock attempts
            assert first.active and not second.active
            assert await active_archiver(stack.db) == application_name("first")
            await first.stop(grace=2)
            await until(lambda: asyncio.sleep(0, second.active), what="take-over")
            assert await active_archiver(stack.db) == application_name("second")
            await write_messages(stack, 2)
            await published(stack, 2)
    decoded = await read_archive(store, stack.identity.lineage)
    assert [s.index for s in decoded] == [0, 1]


# --- private stream --------------------------------------------------------------------------------


async def test_the_private_stream_archives_agents_and_stored_answers(stack: Stack, tmp_path: Path) -> None:
    store = local(tmp_path)
    agent = await stack.register(onboard=False)
    await stack.client.get("/guide", headers=agent.headers())
    reply = await stack.post(agent, "/conversations", {"subject": "s", "content": "c"}, token="tok-private")
    assert reply.status == 201
    async with archiving(stack, store, SealPolicy(events=500, seconds=0.2)):
        async def captured() -> bool:
            rows = await stack.db.pool.fetch("select kind from archive_private_records")
            return {r["kind"] for r in rows} == {"agent", "operation"}
        await until(captured, what="capture")

        async def all_verified() -> bool:
            pending = await stack.db.pool.fetchval("select count(*) from archive_private_pending")
            through = await stack.db.pool.fetchval("select published_through from archive_watermarks where stream = 1")
            head = await stack.db.pool.fetchval("select max(sequence) from archive_private_records")
            return pending == 0 and through == head
        await until(all_verified, what="the private stream to be published")
    records = [decode_private_record(e.body) for s in await read_archive(store, stack.identity.lineage, Stream.PRIVATE)
               for e in s.events]
    agents = [r for r in records if isinstance(r, AgentRecord) and str(r.agent_id) == agent.agent_id]
    assert agents[-1].onboarded_at is not None  # the latest snapshot has the onboarding mark
    stored = await stack.db.pool.fetchrow("select credential_hash from agents where agent_id = $1",
                                          uuid.UUID(agent.agent_id))
    assert agents[-1].credential_hash == bytes(stored["credential_hash"])
    ops = [r for r in records if isinstance(r, OperationRecord)]
    assert [(o.token, o.status, o.sequence) for o in ops] == [("tok-private", 201, reply.body["sequence"])]
    assert orjson.loads(ops[0].response or "null")["sequence"] == reply.body["sequence"]
    # The private stream is never in the public manifest.
    manifest = decode_manifest(await store.get(manifest_key(stack.identity.lineage)))
    private_hashes = {bytes(s["hash"]).hex() for s in await segments(stack, Stream.PRIVATE)}
    assert private_hashes and not private_hashes & {s.hash for s in manifest.segments}


# --- the store -------------------------------------------------------------------------------------


async def test_an_activation_sweeps_the_staging_files_a_crash_left(stack: Stack, tmp_path: Path) -> None:
    """A staging file left by a crash between write and link (old enough) is removed when an archiver
    becomes active; one that may still be in use by a put (young) is not."""
    store = local(tmp_path)
    segments_dir = tmp_path / "archive" / str(stack.identity.lineage) / "segments"
    segments_dir.mkdir(parents=True)
    stale, young = segments_dir / "00000000000000000000#42", segments_dir / "00000000000000000001#43"
    for path in (stale, young):
        path.write_bytes(b"half a segment")
    os.utime(stale, (time.time() - STAGING_MAX_AGE - 1,) * 2)
    await write_messages(stack, 2)
    async with archiving(stack, store, SealPolicy(events=2, seconds=3600)) as archiver:
        await published(stack, 1)
        await asyncio.wait_for(archiver.staging_swept.wait(), WAIT)  # it runs beside the rounds
    assert not stale.exists() and young.exists()


async def test_an_archiver_on_another_store_is_refused_before_it_writes_a_segment_there(
        stack: Stack, tmp_path: Path) -> None:
    """An archiver started with another store than the corpus's (another machine's DATA_DIR
    default) finds the last published checkpoints absent there and stops (exit 2 in a process)
    before sealing anything into it: it used to write the next segment into the empty store and
    publish a manifest naming objects that store never held, leaving a gap in the real one. (It
    looks twice, a store back-off apart, before it stops.) The corpus's own store then carries on
    as before."""
    home, elsewhere = local(tmp_path / "home"), local(tmp_path / "elsewhere")
    signer = signer_for(stack)  # the corpus's one key (the case of another key is refused earlier)
    await write_messages(stack, 4)
    async with archiving(stack, home, SealPolicy(events=2, seconds=3600), signer=signer):
        await published(stack, 2)
    await write_messages(stack, 2)
    async with archiving(stack, elsewhere, SealPolicy(events=2, seconds=3600), node_id="arch-b",
                         signer=signer) as archiver:
        error = await asyncio.wait_for(archiver.crashed(), WAIT)
    assert isinstance(error, StoreLacksArchive) and isinstance(error, ConfigError)
    assert "lacks" in str(error) and "TOASTMACHINE_ARCHIVE_URL" in str(error)
    written = [p for p in (tmp_path / "elsewhere").rglob("*") if p.is_file()]
    assert written == [], "nothing put into the other store, not even the create-only probe"
    assert [s["state"] for s in await segments(stack)] == ["published", "published"]
    async with archiving(stack, home, SealPolicy(events=2, seconds=3600), signer=signer):
        await published(stack, 3)
    decoded = await read_archive(home, stack.identity.lineage)
    assert len(decoded) == 3


async def test_a_store_ignoring_create_only_writes_is_refused_at_start(stack: Stack) -> None:
    async with sloppy_s3() as sloppy, archiving(stack, sloppy, SealPolicy()) as archiver:
        error = await asyncio.wait_for(archiver.crashed(), WAIT)
    assert isinstance(error, CreateOnlyIgnored)
    assert await segments(stack) == []


@pytest.mark.parametrize("stack_backends", ["local"], indirect=True)
async def test_an_unreachable_store_holds_verification_back_and_the_archiver_catches_up(
        stack: Stack, tmp_path: Path) -> None:
    """SeaweedFS is stopped for a while (its process killed) and started again on the same ports and
    data: the archiver backs off meanwhile, marks nothing verified, then catches up."""
    workdir = tmp_path / "weed"
    with contextlib.ExitStack() as exits:
        server: S3Server = await asyncio.to_thread(exits.enter_context, seaweedfs(workdir))
        store = server.store("unreachable")
        sequences = await write_messages(stack, 2)
        # A short back-off cap: the default (10 s) would be waited out once the store is back.
        async with archiving(stack, store, SealPolicy(events=2, seconds=3600), store_backoff=(0.2, 1.0)) as archiver:
            await published(stack, 1)
            await asyncio.to_thread(exits.close)  # the store goes away
            await write_messages(stack, 4)
            await until(lambda: asyncio.sleep(0, archiver.store_error), what="the archiver to notice")
            await asyncio.sleep(1.0)
            states = [s["state"] for s in await segments(stack)]
            assert states[0] == "published" and all(s in ("sealed", "written") for s in states[1:]), states
            exits2 = contextlib.ExitStack()
            with exits2:
                await asyncio.to_thread(exits2.enter_context, seaweedfs(workdir, ports=server.ports))
                segs = await published(stack, 3)
                # Cleared once a whole round (both streams) goes through the store again.
                await until(lambda: asyncio.sleep(0, archiver.store_error is None), what="the store error to clear")
                decoded = await read_archive(store, stack.identity.lineage)
        assert [e.sequence for s in decoded for e in s.events][:2] == sequences
        assert len(decoded) == len(segs) == 3


@pytest.mark.parametrize("stack_backends", ["local"], indirect=True)
async def test_a_store_refusing_the_archivers_credentials_shows_on_readyz_until_fixed(
        stack: Stack, s3_server: S3Server) -> None:
    """A wrong secret: the archiver retries, and every node's /readyz says why in its archive detail
    (without the secret; readiness itself unaffected); an archiver with the right one clears it."""
    prefix = f"creds-{uuid.uuid4().hex[:8]}"

    async def store_detail() -> dict[str, Any]:
        resp = await stack.client.get("/readyz")
        assert resp.status == 200  # an archive problem is detail, never readiness
        detail: dict[str, Any] = (await resp.json())["checks"]["archive"]["store"]
        return detail

    assert await store_detail() == {"status": "ok"}  # nothing recorded yet
    await write_messages(stack, 2)
    async with archiving(stack, s3_server.store(prefix, secret="definitely-wrong-secret"),
                         SealPolicy(events=2, seconds=3600), node_id="arch-creds", store_backoff=(0.1, 0.5)):
        failing = await until(lambda: _failing(store_detail), what="/readyz to report the failing store")
    assert failing["node"] == "arch-creds" and failing["failing_since"].endswith("Z")
    assert "SignatureDoesNotMatch" in failing["error"] or "InvalidAccessKeyId" in failing["error"], failing
    assert "definitely-wrong-secret" not in failing["error"] and "<" not in failing["error"]
    async with archiving(stack, s3_server.store(prefix), SealPolicy(events=2, seconds=3600), node_id="arch-fixed"):
        await published(stack, 1)
        await until(lambda: _ok(store_detail), what="/readyz to report the store answering")


async def _failing(read: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any] | None:
    detail = await read()
    return detail if detail["status"] == "failing" else None


async def _ok(read: Callable[[], Awaitable[dict[str, Any]]]) -> bool:
    return (await read())["status"] == "ok"


async def test_a_fork_alarm_stops_the_archiver_loudly(stack: Stack, tmp_path: Path) -> None:
    """Another history's bytes already under the name of segment 0: the archiver crashes with the
    fork alarm instead of marking anything written, and the object is left as it was."""
    from infra.archive_store import ForkAlarm
    from protocol.archive import segment_key

    store = local(tmp_path)
    sequences = await write_messages(stack, 2)
    key = segment_key(stack.identity.lineage, 0, sequences[0], sequences[1])
    await store.put(key, b"another history's segment")
    async with archiving(stack, store, SealPolicy(events=2, seconds=3600)) as archiver:
        error = await asyncio.wait_for(archiver.crashed(), WAIT)
    assert isinstance(error, ForkAlarm)
    assert [s["state"] for s in await segments(stack)] == ["sealed"]
    assert await store.get(key) == b"another history's segment"


def _cuts_event_by_event(lengths: list[int], policy: SealPolicy) -> tuple[list[tuple[int, int, str]], int]:
    """The sealing rules applied one event at a time: the reference seal_cuts must agree with."""
    empty = fmt.HEADER_SIZE + fmt.TRAILER_SIZE
    cuts: list[tuple[int, int, str]] = []
    start, size = 0, empty
    for i, length in enumerate(lengths):
        grown = size + fmt.FRAME_OVERHEAD + length
        if i > start and grown > policy.bytes:
            cuts.append((start, i, "bytes"))
            start, grown = i, empty + fmt.FRAME_OVERHEAD + length
        size = grown
        if i + 1 - start == policy.events:
            cuts.append((start, i + 1, "events"))
            start, size = i + 1, empty
        elif i == start and grown > policy.bytes:
            # Alone past the limit: no event can join it, whether or not one follows.
            cuts.append((start, i + 1, "bytes"))
            start, size = i + 1, empty
    return cuts, start


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 10, 50, 100, 400, 2000]), max_size=60), st.sampled_from([1, 2, 3, 5, 500]),
       st.sampled_from([200, 300, 1000, 5000, 4 << 20]))
def test_seal_cuts_are_the_rules_applied_event_by_event(lengths: list[int], events: int, size: int) -> None:
    policy = SealPolicy(events=events, bytes=size)
    assert seal_cuts(lengths, policy) == _cuts_event_by_event(lengths, policy)


def test_an_event_alone_past_the_byte_limit_is_a_segment_at_once() -> None:
    """Even as the last event read (a batch at its byte budget may hold only it): waiting for the
    next one would change nothing, and a batch of only that event must still move on."""
    policy = SealPolicy(events=500, bytes=4096)
    assert seal_cuts([5000], policy) == ([(0, 1, "bytes")], 1)
    assert seal_cuts([10, 5000], policy) == ([(0, 1, "bytes"), (1, 2, "bytes")], 2)
    assert seal_cuts([5000, 10], policy) == ([(0, 1, "bytes")], 1)
