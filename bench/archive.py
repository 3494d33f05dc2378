"""The archiver against the raw cost of the same work, on the same database in the same run.

Seeds a fresh database with ``--messages`` messages (``toastmachine dev seed``'s generator, about
1.3 changes per message) and vacuums it, then runs ``--warmup`` rounds (default 1; printed, not counted) and
measures ``--rounds`` times (default 5; the median is reported). On this machine kind, rounds that
start within a minute or so of the seed archive slower (measured 0.34-0.43x against 0.47-0.54x
later, the same code), so the rounds counted start after a warm-up round that does the same work.
Each round runs on its own copy of that database, whose history is first read once untimed (the
same warm cache for both sides), and measures, in events per second:

- **raw**: ``COPY (select sequence, event from changes order by sequence) TO STDOUT`` and one
  ``hashlib.sha256`` per row: reading and hashing the history with nothing else; the median of
  :data:`RAW_READS` reads (one read takes under half a second and varies by about a fifth from one
  read to the next on the same copy here);
- **archive**: the archiver actor (default sealing rules: 500 events or 4 MiB) on a directory store,
  from start until every full segment is published (sealed, written, read back, verified,
  checkpointed, in the manifest);
- **verify**: every published segment read back from the store and decoded (CRCs, Merkle subtree
  root, hash, link to the previous one), all leaves appended to one tree, the root compared with the
  signed checkpoint's. The leaves are appended as the decoder's ``Subtree`` (``seg.tree``), as
  ``archive verify``, restore and the mirror do: the history's tree reuses the node hashes the
  subtree root check made where they coincide, and every leaf still goes into the tree.

- **lag**: the Procfile's processes (``web``, ``writer``, ``publisher``, ``archiver``; default
  sealing rules) on a fresh database, RabbitMQ virtual host and data directory (its archive
  directory included); ``--lag-agents`` agents post messages over HTTP on a fixed schedule of
  ``--lag-rate`` writes/s for ``--lag-seconds`` seconds, a fresh Operation-Token each. Every second
  the archiver's lag is sampled from the database: the head change sequence minus the public
  stream's ``published_through`` (archived as the issue counts it: in the manifest, under a signed
  checkpoint), in segments of 500 events. At 200 writes/s a segment fills in 2.5 s, so the open
  segment alone accounts for up to one segment of lag.

- **restore**: each round archives its own copy of the seeded history (all of it, the private
  stream too), then restores that archive into an empty migrated database with
  ``restore_archive`` (as ``toastmachine archive restore``: verified and
  loaded in one transaction), against the **raw load**: the same tables copied from the copy into
  another empty migrated database with binary COPY, in one transaction (the database's own cost
  of holding those rows: search vectors, indexes, foreign keys, the read models' trigger). No
  target; ``--restore-rounds`` rounds (default 3), the median reported.

Targets (issue #11): archive >= 0.5x raw, verify >= 0.5x raw, lag under 200 writes/s < 2 segments.

The rate rounds run with the collector settings every node process takes once its actors have
started (``infra.runtime.tune_gc``), since the archiver measured runs in this process.

With the median round, the CPU time of each side is printed: this process's (the archiver's worker
threads included) and the whole machine's (``/proc/stat``: PostgreSQL's backends and the kernel's
writeback too). The archive's machine-wide CPU seconds over every CPU is the shortest any schedule
of the same work could take here, so the raw time over it bounds the ratio this work can reach on
this machine (on a 2-CPU machine here, the raw side alone kept both busy: its client and its backend).

Run: ``python bench/archive.py [--dsn postgresql://postgres@127.0.0.1:5432/postgres] [--messages N]
[--rounds N] [--warmup N] [--amqp-url amqp://...] [--lag-rate R] [--lag-seconds S] [--lag-agents A] [--skip-rate] [--skip-lag]
[--skip-restore] [--restore-rounds N]``
(the DSN is a server's maintenance database: databases of its own are created and dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import aiohttp
import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.archiver import Archiver, SealPolicy
from actors.recovery.restore import restore_archive
from actors.recovery.walk import StoreSource
from bench.write import (
    Agent,
    CpuMeter,
    HttpSide,
    private_vhost,
    quiet_product_logs,
    scratch_database,
    stop_process,
)
from infra.archive_keys import archive_origin
from infra.archive_store import ArchiveStore
from infra.bus import make_bus
from infra.db import Database, apply_migrations, ensure_identity
from infra.runtime import tune_gc
from protocol.archive import Stream, checkpoint_key, decode_segment, manifest_key, public_key_key, segment_key
from protocol.checkpoint import generate_signer_key, parse_verifier_key, verify_checkpoint
from protocol.manifest import decode_manifest
from protocol.merkle import CompactTree
from tests.procs import NodeProcess, clean_env, start
from toastmachine.seed import seed_corpus

#: Events per segment under the default sealing rules, the unit the lag is counted in.
SEGMENT_EVENTS = SealPolicy().events
#: Target of issue #11: the archiver's lag under the sustained write rate stays below this.
TARGET_LAG_SEGMENTS = 2.0
#: Timed raw reads per round (after the untimed warm-up read); their median is the round's raw rate.
RAW_READS = 3
#: Writes in flight at most; a write the node has not answered by then counts as a miss.
MAX_IN_FLIGHT = 1000


@dataclass(frozen=True, slots=True)
class Busy:
    """CPUs busy on average over one measurement: this process (the archiver and its worker threads
    run in it) and the whole machine (PostgreSQL's backends and the kernel's writeback included);
    None where /proc is not there to read."""

    process: float | None
    machine: float | None


class Timed(NamedTuple):
    """One measurement: events, the seconds they took, and the CPUs busy over those seconds."""

    events: int
    seconds: float
    busy: Busy

    @property
    def rate(self) -> float:
        """Events per second."""
        return self.events / self.seconds


class Stopwatch:
    """Times one measurement and meters the CPUs over exactly the same interval."""

    def __init__(self) -> None:
        self._meter = CpuMeter.start({"bench": os.getpid()})
        self._started = time.perf_counter()

    def stop(self, events: int) -> Timed:
        seconds = time.perf_counter() - self._started
        busy = self._meter.busy()
        return Timed(events, seconds, Busy(busy.get("bench"), busy.get("machine")))


async def raw_rate(dsn: str) -> Timed:
    """Rows read with COPY and hashed, and the seconds it took."""
    conn = await asyncpg.connect(dsn)
    rows = 0
    buffer = bytearray()
    watch = Stopwatch()

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
    return watch.stop(rows)


#: True once every private record is captured and published (a restore needs the private stream).
_PRIVATE_CAUGHT_UP = (
    "select not exists (select 1 from archive_private_pending) and (select count(*) from archive_private_records) = "
    "(select coalesce(max(tree_size), 0) from archive_segments where stream = 1 and state = 'published')")


async def archive_rate(db: Database, dsn: str, store: ArchiveStore, *, whole: bool = False) -> Timed:
    """Events the archiver published from a cold start, and the seconds it took: every full
    segment's; ``whole``: the whole history's, the private stream's too (each open segment sealed
    at once), as a restore needs it."""
    identity = await ensure_identity(db, None, None)
    signer = generate_signer_key(archive_origin(identity.corpus_id))
    head = int(await db.pool.fetchval("select count(*) from changes"))
    full = head if whole else head - head % SealPolicy().events
    bus = make_bus(None)
    await bus.connect()
    archiver = Archiver(bus, db, identity=identity, store=store, signer=signer, node_id="bench", dsn=dsn,
                        policy=SealPolicy(seconds=0.0 if whole else 3600), sweep_interval=0.05)
    watch = Stopwatch()
    await archiver.start()
    try:
        # The archiver's own progress signal, not a polling query: a poll would take the event loop
        # and the database from the work it measures, and see the end up to a poll interval late.
        while archiver.published_size.get(Stream.PUBLIC, 0) < full:
            # (Not wait_for: on Python 3.11 it runs the wait in a new task, which would take the
            # progress event a loop turn late and could miss the last one.)
            async with asyncio.timeout(120):
                await archiver.wait_progress()
        timed = watch.stop(full)
        while whole and not await db.pool.fetchval(_PRIVATE_CAUGHT_UP):
            async with asyncio.timeout(120):
                await archiver.wait_progress()
        published = int(await db.pool.fetchval(
            "select coalesce(max(tree_size), 0) from archive_segments where stream = 0 and state = 'published'"))
        assert published >= full, f"the archiver reported {full} events published, the database {published}"
    finally:
        await archiver.stop(grace=5)
        await bus.close()
    return timed


async def verify_rate(store: ArchiveStore, lineage: uuid.UUID, verifier_text: str) -> Timed:
    """Events verified from the store alone, and the seconds it took."""
    watch = Stopwatch()
    manifest = decode_manifest(await store.get(manifest_key(lineage)))
    tree = CompactTree()
    previous = None
    for entry in manifest.segments:
        seg = decode_segment(await store.get(segment_key(lineage, entry.index, entry.first_sequence,
                                                         entry.last_sequence)),
                             expected_previous_hash=previous, expected_lineage=lineage,
                             expected_index=entry.index, expected_stream=Stream.PUBLIC)
        previous = seg.hash
        tree.extend(seg.tree or seg.leaf_hashes)
    checkpoint = verify_checkpoint(await store.get(checkpoint_key(lineage, tree.size)),
                                   parse_verifier_key(verifier_text))
    assert checkpoint.root == tree.root(), "the recomputed root differs from the checkpoint's"
    return watch.stop(tree.size)


@dataclass(slots=True)
class LagRun:
    """What the lag phase saw."""

    seconds: float = 0.0
    scheduled: int = 0
    accepted: int = 0
    failed: int = 0
    samples: list[float] = field(default_factory=list)  # lag in segments, one a second
    published_segments: int = 0


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 1) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def lag_under_load(server_dsn: str, amqp_url: str, rate: float, seconds: float, agents: int) -> LagRun:
    """The archiver's lag behind the head while the Procfile's node takes ``rate`` writes/s."""
    tag = uuid.uuid4().hex[:8]
    run = LagRun()
    with tempfile.TemporaryDirectory(prefix="tm-bench-archive-") as data_dir:
        async with private_vhost(amqp_url, "private", f"tm_bench_archive_{tag}") as vhost_url, \
                scratch_database(server_dsn, f"tm_bench_archive_lag_{tag}") as dsn:
            env = clean_env(TOASTMACHINE_AMQP_URL=vhost_url, TOASTMACHINE_DATABASE_URL=dsn,
                            TOASTMACHINE_DATA_DIR=data_dir, TOASTMACHINE_PORT="0",
                            # Admission out of the way: the schedule sets the rate.
                            TOASTMACHINE_WRITES_PER_SECOND="1000000", TOASTMACHINE_REGISTER_PER_MINUTE="1000000")
            started: list[NodeProcess] = []
            try:
                for name in (("web",), ("run", "writer"), ("run", "publisher"), ("run", "archiver")):
                    started.append(await start(*name, env=env))
                web = started[0]
                await asyncio.gather(web.wait_listening(60), *(
                    p.wait_for_line(rf"ToastMachine running {n}", 60)
                    for p, n in zip(started[1:], ("writer", "publisher", "archiver"), strict=True)))
                await started[3].wait_for_line(r"archiver\.active", 60)
                assert web.url is not None
                connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT)
                async with aiohttp.ClientSession(connector=connector,
                                                 timeout=aiohttp.ClientTimeout(total=60)) as session:
                    http = HttpSide(session, web.url, [Agent(f"lag{tag[:6]}_{i}") for i in range(agents)], 600)
                    await http.set_up()
                    db = await asyncpg.connect(dsn)
                    try:
                        await _drive_and_sample(http, db, rate, seconds, run)
                    finally:
                        await db.close()
            finally:
                await asyncio.gather(*(stop_process(p) for p in started))
    return run


async def _drive_and_sample(http: HttpSide, db: asyncpg.Connection, rate: float, seconds: float,
                            run: LagRun) -> None:
    """Post on a fixed schedule (write k at start + k/rate, whatever the answers' latency) and sample
    the lag once a second, until the schedule ends."""
    loop = asyncio.get_running_loop()
    begin = loop.time()
    total = int(rate * seconds)
    in_flight: set[asyncio.Task[str | None]] = set()

    def done(task: asyncio.Task[str | None]) -> None:
        in_flight.discard(task)
        if task.cancelled() or task.exception() is not None or task.result() is not None:
            run.failed += 1
        else:
            run.accepted += 1

    async def sample() -> None:
        tick = 1
        while True:
            await asyncio.sleep(max(0.0, begin + tick - loop.time()))
            head, published = await db.fetchrow(
                "select (select coalesce(max(sequence), 0) from changes), "
                "(select published_through from archive_watermarks where stream = 0)")
            run.samples.append((head - published) / SEGMENT_EVENTS)
            tick += 1

    sampler = asyncio.create_task(sample())
    try:
        for k in range(total):
            await asyncio.sleep(max(0.0, begin + k / rate - loop.time()))
            run.scheduled += 1
            if len(in_flight) >= MAX_IN_FLIGHT:
                run.failed += 1  # the node is this far behind: a miss, not a queue in the client
                continue
            task = asyncio.create_task(http.write(k % len(http.agents), k + 1))
            in_flight.add(task)
            task.add_done_callback(done)
        run.seconds = loop.time() - begin
        if in_flight:
            await asyncio.wait(set(in_flight), timeout=30)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    run.published_segments = int(await db.fetchval(
        "select count(*) from archive_segments where stream = 0 and state = 'published'"))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5, help="rate rounds (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and printed, not counted")
    parser.add_argument("--amqp-url", default=os.environ.get("TOASTMACHINE_TEST_AMQP_URL",
                                                             "amqp://guest:guest@127.0.0.1:5672/"))
    parser.add_argument("--lag-rate", type=float, default=200.0, help="writes/s during the lag phase")
    parser.add_argument("--lag-seconds", type=float, default=60.0, help="length of the lag phase")
    parser.add_argument("--lag-agents", type=int, default=16, help="agents sharing the lag phase's writes")
    parser.add_argument("--skip-rate", action="store_true", help="skip the archive and verify rates")
    parser.add_argument("--skip-lag", action="store_true", help="skip the lag phase")
    parser.add_argument("--skip-restore", action="store_true", help="skip the restore phase")
    parser.add_argument("--restore-rounds", type=int, default=3, help="restore rounds (the median is reported)")
    args = parser.parse_args()
    for flag in ("rounds", "restore_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    quiet_product_logs()
    if not (args.skip_rate and args.skip_restore):
        async with seeded_history(args) as name:
            if not args.skip_rate:
                await rates(args, name)
            if not args.skip_restore:
                await restores(args, name)
    if not args.skip_lag:
        print(f"lag phase: {args.lag_rate:g} writes/s for {args.lag_seconds:g} s through the Procfile's processes ...",
              flush=True)
        lag = await lag_under_load(args.dsn, args.amqp_url, args.lag_rate, args.lag_seconds, args.lag_agents)
        achieved = lag.accepted / lag.seconds if lag.seconds else 0.0
        print(f"lag load:          {lag.accepted:,} writes accepted of {lag.scheduled:,} scheduled ({lag.failed:,} "
              f"failed) in {lag.seconds:.1f} s = {achieved:,.0f} writes/s; {lag.published_segments} segments "
              "published")
        if lag.samples:
            print(f"lag:               max {max(lag.samples):.2f} segments, p99 {percentile(lag.samples, 0.99):.2f} "
                  f"segments over {len(lag.samples)} one-second samples (head - published_through, "
                  f"/{SEGMENT_EVENTS}; target < {TARGET_LAG_SEGMENTS:g})")


@dataclass(frozen=True, slots=True)
class Round:
    """One round of the rate phase: the raw, archive and verify figures on one copy of the history."""

    raw: Timed
    archive: Timed
    verify: Timed

    def rate(self, which: str) -> float:
        timed: Timed = getattr(self, which)
        return timed.rate

    def ratio(self, which: str) -> float:
        return self.rate(which) / self.rate("raw")


async def settle(server_dsn: str) -> None:
    """Flush what setting a round up left to write, before either side is timed: the copy of the
    template (PostgreSQL 15 copies a database through its WAL and shared buffers, hundreds of MB
    here) and the last round's archive files. Otherwise the checkpointer and the kernel's writeback
    take the CPUs and the disk from whichever side runs while they catch up (measured: the
    machine-wide CPU of the same archive round varied from 1.4 to 2.5 CPU-s with it)."""
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute("checkpoint")  # a superuser's or pg_checkpoint's; the bench's DSN is one
    finally:
        await admin.close()
    await asyncio.to_thread(os.sync)


async def one_round(server_dsn: str, template: str) -> Round:
    """Raw, archive and verify on a fresh copy of the seeded database ``template``.

    Each side first reads the copy's history once, untimed, so that both start from the same warm
    cache (a new copy's pages are in the operating system's cache, not yet in PostgreSQL's)."""
    async with scratch_database(server_dsn, f"{template}_r{uuid.uuid4().hex[:6]}", template=template) as dsn:
        await settle(server_dsn)
        await raw_rate(dsn)  # the warm-up read
        # The raw side is a read of well under a second, and here it varies by a fifth read after
        # read on one copy: its median of RAW_READS reads is the round's raw rate.
        reads = [await raw_rate(dsn) for _ in range(RAW_READS)]
        raw = sorted(reads, key=lambda r: r.rate)[len(reads) // 2]
        db = await Database.connect(dsn, min_size=1, max_size=4)
        try:
            identity = await ensure_identity(db, None, None)
            with tempfile.TemporaryDirectory() as tmp:
                store = ArchiveStore.local(Path(tmp))
                archive = await archive_rate(db, dsn, store)
                verifier = (await store.get(public_key_key(identity.lineage))).decode().strip()
                verify = await verify_rate(store, identity.lineage, verifier)
        finally:
            await db.close()
    return Round(raw, archive, verify)


@contextlib.asynccontextmanager
async def seeded_history(args: argparse.Namespace) -> AsyncIterator[str]:
    """A database seeded with ``args.messages`` messages and vacuumed, to copy rounds from (its name)."""
    name = f"tm_bench_archive_{uuid.uuid4().hex[:8]}"
    async with scratch_database(args.dsn, name) as dsn:
        db = await Database.connect(dsn, min_size=1, max_size=4)
        try:
            await apply_migrations(db)
            await ensure_identity(db, None, None)
            print(f"seeding {args.messages:,} messages ...", flush=True)
            await seed_corpus(db, messages=args.messages)
            await db.pool.execute("vacuum analyze")  # as a corpus at rest: hint bits set, statistics known
        finally:
            await db.close()  # a template has no session open
        yield name


async def rates(args: argparse.Namespace, name: str) -> None:
    """The archive and verify rates against the raw one, median of ``args.rounds`` rounds, each on
    its own copy of one seeded history ``name`` (see the module docstring)."""
    rounds: list[Round] = []
    # As every node process does once its actors have started (toastmachine.node.run_node): the
    # archiver measured here runs in this process, so it gets the same collector settings.
    tune_gc()
    for n in range(args.warmup + args.rounds):
        r = await one_round(args.dsn, name)
        counted = n >= args.warmup
        if counted:
            rounds.append(r)
        label = f"round {n + 1 - args.warmup}" if counted else f"warm-up round {n + 1} (not counted)"
        print(f"{label}: raw {r.rate('raw'):,.0f}  archive {r.rate('archive'):,.0f} "
              f"({r.ratio('archive'):.2f}x)  verify {r.rate('verify'):,.0f} ({r.ratio('verify'):.2f}x) events/s",
              flush=True)
    median = sorted(rounds, key=lambda r: r.ratio("archive"))[len(rounds) // 2]
    verify = sorted(rounds, key=lambda r: r.ratio("verify"))[len(rounds) // 2]
    (rows, raw_s, _), (events, archive_s, _), (verified, verify_s, _) = median.raw, median.archive, verify.verify
    print(f"median of {len(rounds)} rounds (each ratio against the raw rate of its own round):")
    print(f"raw COPY + sha256: {rows:,} rows in {raw_s:.2f} s = {rows / raw_s:,.0f} events/s")
    print(f"archive:           {events:,} events in {archive_s:.2f} s = {events / archive_s:,.0f} events/s "
          f"({median.ratio('archive'):.2f}x raw; target 0.5x)")
    print(f"verify:            {verified:,} events in {verify_s:.2f} s = {verified / verify_s:,.0f} events/s "
          f"({verify.ratio('verify'):.2f}x raw; target 0.5x)")
    print(cpu_lines(median))


def cpu_lines(median: Round) -> str:
    """The median round's CPU use, and what it implies: the archive's machine-wide CPU seconds spread
    over every CPU is the shortest the same work could take here, whatever its schedule."""
    cpus = os.cpu_count() or 1
    parts = []
    for which in ("raw", "archive"):
        timed: Timed = getattr(median, which)
        process, machine = timed.busy.process, timed.busy.machine
        if process is None or machine is None:
            return "cpu:               not measured (no /proc here)"
        parts.append(f"{which} {process * timed.seconds:.2f} CPU-s in this process, {machine * timed.seconds:.2f} "
                     f"on the machine ({machine:.2f} of {cpus} CPUs busy)")
    floor = (median.archive.busy.machine or 0.0) * median.archive.seconds / cpus
    bound = f"at most {median.raw.seconds / floor:.2f}x raw on this machine with this work" if floor else "no bound"
    return (f"cpu (median round): {parts[0]}\n                    {parts[1]}\n"
            f"                    the archive's CPU work over {cpus} CPUs takes at least {floor:.2f} s: {bound}")


#: The tables a restore writes, in the order the raw load copies them (what a row refers to first).
RESTORED_TABLES = ("agents", "conversations", "messages", "relationships", "retractions", "active_relationships",
                   "changes", "operations")


async def raw_load(source_dsn: str, target_dsn: str) -> Timed:
    """The restore's baseline: the same rows copied table by table (binary COPY out of the source,
    COPY into ``target_dsn``, an empty migrated database) in one transaction, so the database does
    what loading them costs (search vectors, indexes, foreign keys, the read models' trigger) and
    nothing else: no archive read, no check, no event decoding."""
    source, target = await asyncpg.connect(source_dsn), await asyncpg.connect(target_dsn)
    try:
        # Read out first, untimed: the timed part is the load alone.
        tables: list[tuple[str, list[str], io.BytesIO]] = []
        for table in RESTORED_TABLES:
            columns = [r[0] for r in await source.fetch(
                "select column_name from information_schema.columns where table_schema = 'public' and "
                "table_name = $1 and is_generated = 'NEVER' order by ordinal_position", table)]
            rows = io.BytesIO()
            await source.copy_from_table(table, columns=columns, output=rows, format="binary")
            rows.seek(0)
            tables.append((table, columns, rows))
        watch = Stopwatch()
        async with target.transaction():
            for table, columns, rows in tables:
                await target.copy_to_table(table, source=rows, columns=columns, format="binary")
        return watch.stop(int(await target.fetchval("select count(*) from changes")))
    finally:
        await asyncio.gather(source.close(), target.close())


@contextlib.asynccontextmanager
async def empty_corpus(server_dsn: str, tag: str) -> AsyncIterator[str]:
    """A fresh database with the schema migrated and nothing else (what a restore writes into)."""
    async with scratch_database(server_dsn, f"tm_bench_restore_{tag}_{uuid.uuid4().hex[:6]}") as dsn:
        db = await Database.connect(dsn, min_size=1, max_size=2)
        try:
            await apply_migrations(db)
        finally:
            await db.close()
        yield dsn


async def restore_round(server_dsn: str, template: str) -> tuple[Timed, Timed]:
    """(raw load, restore) of one copy of ``template``: the copy is archived (all of it, the
    private stream too), then loaded raw into one empty database and restored into another."""
    async with scratch_database(server_dsn, f"{template}_s{uuid.uuid4().hex[:6]}", template=template) as dsn:
        db = await Database.connect(dsn, min_size=1, max_size=4)
        try:
            identity = await ensure_identity(db, None, None)
            with tempfile.TemporaryDirectory() as tmp:
                store = ArchiveStore.local(Path(tmp))
                await archive_rate(db, dsn, store, whole=True)
                async with empty_corpus(server_dsn, "raw") as target:
                    raw = await raw_load(dsn, target)
                async with empty_corpus(server_dsn, "archive") as target:
                    into = await Database.connect(target, min_size=1, max_size=2)
                    try:
                        watch = Stopwatch()
                        report = await restore_archive(StoreSource(store), identity.lineage, into)
                        restored = watch.stop(int(report.counts["changes"]))
                    finally:
                        await into.close()
        finally:
            await db.close()
    return raw, restored


async def restores(args: argparse.Namespace, name: str) -> None:
    """The restore rate against the raw load's, median of ``args.restore_rounds`` rounds."""

    def ratio(r: tuple[Timed, Timed]) -> float:
        return r[1].rate / r[0].rate

    rounds: list[tuple[Timed, Timed]] = []
    for n in range(args.restore_rounds):
        raw, restored = await restore_round(args.dsn, name)
        rounds.append((raw, restored))
        print(f"restore round {n + 1}: raw load {raw.rate:,.0f}  restore {restored.rate:,.0f} events/s "
              f"({ratio((raw, restored)):.2f}x)", flush=True)

    raw, restored = sorted(rounds, key=ratio)[len(rounds) // 2]
    print(f"median of {len(rounds)} restore rounds:")
    print(f"raw load (COPY of the restored tables into an empty migrated database, one transaction): "
          f"{raw.events:,} changes in {raw.seconds:.2f} s = {raw.rate:,.0f} events/s")
    print(f"restore (verify and load the archive, one transaction): {restored.events:,} changes in "
          f"{restored.seconds:.2f} s = {restored.rate:,.0f} events/s "
          f"({ratio((raw, restored)):.2f}x the raw load; no target)")


if __name__ == "__main__":
    asyncio.run(main())
