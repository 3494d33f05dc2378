"""Archiver: cuts the history into verified, hash-linked segments in object storage (SPEC §5).

Consumes: wake-ups from its own durable queue ``tm.archiver.<corpus_id>`` bound to the corpus's
internal hub exchange ``tm.hub.<corpus_id>``, one change batch per publisher window (a bounded WAKE
queue: the bodies are ignored, the change history is the truth), and
a periodic sweep in case a wake-up is lost or the bus is down. Every instance consumes and acks
wake-ups; only the active one acts on them.

Does, for each stream (the public change history, and the private stream of operation records and
agent register entries, :mod:`protocol.archive_private`):

1. **Capture** (private stream only): agents and answered operation records that changed are marked
   pending by triggers (migration 0007); the active archiver turns them into immutable
   ``archive_private_records`` rows with the next private sequence.
2. **Seal**: the events after the last segment are sealed into a new segment at
   ``policy.events`` events, when the next event would take it past ``policy.bytes`` bytes, or
   ``policy.seconds`` after its first event. Only committed events are ever read, and the writer
   assigns sequences in commit order under its sequence lock (:mod:`actors.writer.store`), so every
   sequence below a visible one is already visible: the visible history is the safe watermark, the
   same rule the publisher and every ``after=`` reader rely on (private sequences are assigned by
   the archiver alone, under its lock). The decision (index, range, count, previous hash) is
   recorded in ``archive_segments`` *before* encoding, so an archiver restarted at any point
   encodes the same bytes again.
3. **Write**: encode (:func:`protocol.archive.encode_segment`) and put create-only; an existing
   identical object counts as written, a different one is a :class:`~infra.archive_store.ForkAlarm`
   that stops the archiver loudly: it crashes, and every restart the supervisor makes (with its
   growing back-off) meets the same object and reports it again, until an operator acts. The row moves to ``written`` with size, hash, root and the Merkle
   frontier after it.
4. **Verify**: read the object back, decode it completely against the expected link, lineage, index
   and stream, and compare its hash with the row's: only then ``verified``.
5. **Publish**: sign a checkpoint of the stream's tree (``checkpoints/<size>``, kept for ever;
   private: ``private/checkpoints/<size>``, with the extension line ``private``), put the public key
   once, replace ``manifest.json`` (public stream), and mark the segments ``published``.

Single-active on the PostgreSQL advisory lock :data:`ARCHIVER_LOCK` with take-over (see
:mod:`infra.db.lock_session`); all lock-protected work runs on the lock's session. At its first
activation it probes the store and refuses (crashes with :class:`~infra.archive_store.CreateOnlyIgnored`)
one that ignores create-only writes. A store that is unreachable is retried with a back-off; nothing
is marked verified without a successful read-back, and sealing stops until the backlog drains.

Memory: one segment's events at a time (at most ``policy.bytes`` plus one event), plus the manifest.

Emits: archive objects and the manifest; the watermarks in ``archive_watermarks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from infra.archive_store import ArchiveStore, ArchiveStoreError, CreateOnlyIgnored, ForkAlarm, ObjectNotFound
from infra.bus.base import Bus, Consumer, Delivery, QueueKind, QueueSpec
from infra.db import CorpusIdentity, Database
from infra.db.lock_session import (
    LockLost,
    LockSession,
    guarded,
    lock_holder,
    open_lock_session,
    pause,
    serve_while_locked,
)
from infra.db.pool import Target
from infra.metrics import Family, SingleActiveCollector, register_once
from infra.runtime import Actor
from protocol.archive import (
    FRAME_OVERHEAD,
    GENESIS_HASH,
    HASH_SIZE,
    HEADER_SIZE,
    TRAILER_SIZE,
    ArchivedEvent,
    ArchiveFormatError,
    Stream,
    checkpoint_key,
    decode_segment,
    encode_segment,
    event_body,
    manifest_key,
    private_checkpoint_key,
    public_key_key,
    segment_key,
)
from protocol.archive_private import AgentRecord, OperationRecord, PrivateRecord, encode_private_record
from protocol.checkpoint import Checkpoint, SignerKey, sign_checkpoint
from protocol.errors import ToastMachineError
from protocol.manifest import Manifest, ManifestSegment, encode_manifest, validate_manifest
from protocol.merkle import CompactTree

#: Key of the session-level advisory lock held by the active archiver: the first 8 bytes of
#: sha256(b"toastmachine:archiver") as a signed big-endian integer.
ARCHIVER_LOCK = 6408730472154004958
#: Wake-ups kept at most in the archiver's queue (one is as good as many).
WAKE_QUEUE_LENGTH = 100
#: Seconds between a standby's attempts to take the lock.
DEFAULT_STANDBY_INTERVAL = 1.0
#: Back-off after a store failure: doubles from the first value up to the second.
STORE_BACKOFF = (0.5, 10.0)
#: Pending private records captured per transaction.
CAPTURE_BATCH = 500
#: Seconds between two counts of the archive's lag.
MEASURE_INTERVAL = 1.0
#: Extension line of a private stream checkpoint (never a valid public one).
PRIVATE_EXTENSION = "private"


class ArchiverError(ToastMachineError):
    """The history or the archive's bookkeeping is not what the archiver recorded: it stops."""


def wake_queue(corpus_id: str) -> str:
    """The archiver's durable wake-up queue of a corpus."""
    return f"tm.archiver.{corpus_id}"


def application_name(node_id: str) -> str:
    """The ``application_name`` of an archiver's lock connection."""
    return f"toastmachine-archiver:{node_id}"[:63]


async def active_archiver(target: Target) -> str | None:
    """The ``application_name`` of the session holding the archiver lock, or None."""
    return await lock_holder(target, ARCHIVER_LOCK)


@dataclass(frozen=True, slots=True)
class SealPolicy:
    """When a segment is sealed (SPEC §5: 500 events, 4 MiB, 60 s after its first event)."""

    events: int = 500
    bytes: int = 4 << 20
    seconds: float = 60.0


@dataclass(frozen=True, slots=True)
class _Row:
    """One ``archive_segments`` row."""

    stream: Stream
    index: int
    first: int
    last: int
    count: int
    tree_size: int
    previous_hash: bytes
    state: str
    size: int | None
    hash: bytes | None
    frontier: bytes | None

    def tree(self) -> CompactTree:
        assert self.frontier is not None
        return CompactTree.from_state(self.tree_size, [self.frontier[i:i + HASH_SIZE]
                                                       for i in range(0, len(self.frontier), HASH_SIZE)])


_SEGMENT_COLUMNS = ("stream, segment_index, first_sequence, last_sequence, event_count, tree_size, previous_hash, "
                    "state, size, hash, frontier")


def _row(r: Any) -> _Row:
    return _Row(Stream(r["stream"]), r["segment_index"], r["first_sequence"], r["last_sequence"], r["event_count"],
                r["tree_size"], bytes(r["previous_hash"]), r["state"], r["size"],
                None if r["hash"] is None else bytes(r["hash"]),
                None if r["frontier"] is None else bytes(r["frontier"]))


# Candidates for the next segment: at most $2 rows after $1, no more than fit in $3 bytes of text
# plus the one that crosses the line (so the caller knows whether the size rule sealed it).
_PUBLIC_CANDIDATES = (
    "select sequence, event as body, extract(epoch from now() - occurred_at)::float8 as age from ("
    "  select sequence, event, occurred_at, sum(octet_length(event)) over (order by sequence) - octet_length(event)"
    "  as before from (select sequence, event, occurred_at from changes where sequence > $1 order by sequence"
    "  limit $2) as page) as sized where before < $3 order by sequence")
_PRIVATE_CANDIDATES = (
    "select sequence, body, extract(epoch from now() - captured_at)::float8 as age from ("
    "  select sequence, body, captured_at, sum(octet_length(body)) over (order by sequence) - octet_length(body)"
    "  as before from (select sequence, body, captured_at from archive_private_records where sequence > $1"
    "  order by sequence limit $2) as page) as sized where before < $3 order by sequence")
_PUBLIC_RANGE = "select sequence, event as body from changes where sequence between $1 and $2 order by sequence"
_PRIVATE_RANGE = ("select sequence, body from archive_private_records where sequence between $1 and $2 "
                  "order by sequence")

_TAKE_PENDING = (
    "delete from archive_private_pending where (kind, agent_id, operation, token) in ("
    "  select kind, agent_id, operation, token from archive_private_pending order by touched_at limit $1"
    "  for update skip locked) returning kind, agent_id, operation, token")
_READ_AGENTS = ("select agent_id, name, description, credential_hash, onboarded_at, created_at from agents "
                "where agent_id = any($1::uuid[])")
_READ_OPERATIONS = (
    "select o.author_id, o.operation, o.token, o.request_hash, o.status, o.response, o.sequence, o.created_at "
    "from operations o join unnest($1::uuid[], $2::text[], $3::text[]) as k(author_id, operation, token) "
    "on o.author_id = k.author_id and o.operation = k.operation and o.token = k.token where o.status is not null")


def _body(stream: Stream, raw: Any) -> bytes:
    """The archived bytes of one candidate row: the canonical envelope, or the stored record."""
    if stream is Stream.PUBLIC:
        return event_body(orjson.loads(raw))
    return bytes(raw)


def segment_size(bodies: Iterable[bytes]) -> int:
    """The encoded size of a segment holding ``bodies``."""
    return HEADER_SIZE + TRAILER_SIZE + sum(FRAME_OVERHEAD + len(b) for b in bodies)


class Archiver(Actor):
    """The archiver actor (see the module docstring).

    Args:
        bus: where the wake-up queue lives.
        db: the database; its pool is only used for the lock session when ``dsn`` is None.
        identity: the database's corpus identity (None when the check failed: it archives nothing).
        store: the archive's object store.
        signer: the checkpoint signing key, named after the archive's origin (None only without an
            identity).
        node_id: this process's name; the lock connection's ``application_name`` carries it.
        dsn: PostgreSQL DSN for the dedicated lock connection (None: borrow one from ``db``'s pool).
        policy: when segments are sealed.
        sweep_interval: seconds between sweeps when no wake-up arrives.
        standby_interval: seconds between a standby's attempts to take the lock.
        parent_lineage: the lineage a restore started from, listed in the manifest (None: original).
    """

    name = "archiver"

    def __init__(self, bus: Bus, db: Database, *, identity: CorpusIdentity | None, store: ArchiveStore,
                 signer: SignerKey | None, node_id: str, dsn: str | None = None, policy: SealPolicy | None = None,
                 sweep_interval: float = 5.0, standby_interval: float = DEFAULT_STANDBY_INTERVAL,
                 parent_lineage: uuid.UUID | None = None) -> None:
        super().__init__()
        self.bus = bus
        self.db = db
        self.identity = identity
        self.store = store
        self.signer = signer
        self.node_id = node_id
        self.dsn = dsn
        self.policy = policy or SealPolicy()
        self.sweep_interval = sweep_interval
        self.standby_interval = standby_interval
        self.parent_lineage = parent_lineage
        self.lineage = uuid.UUID(str(identity.lineage)) if identity is not None else None
        #: True while this instance holds the lock and archives.
        self.active = False
        #: Times this instance became active.
        self.activations = 0
        #: The last store failure while active (None once the store answers again).
        self.store_error: str | None = None
        #: Per stream: the highest sequence in a verified segment, as this instance last saw it.
        self.verified_through: dict[Stream, int] = {}
        #: Public events committed but not yet in a verified segment (as of the last round).
        self.lag_events: int | None = None
        #: Objects this instance put (created or found identical), by outcome name.
        self.puts: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._consumer: Consumer | None = None
        self._probed = False
        self._progress = asyncio.Event()

    # --- observing ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``{"active", "verified_through", "lag_events", "store_error"}`` for health pages and logs."""
        return {"active": self.active, "verified_through": self.verified_through.get(Stream.PUBLIC),
                "lag_events": self.lag_events, "store_error": self.store_error}

    async def wait_progress(self) -> None:
        """Wait until this instance next records progress (a segment changing state)."""
        progress = self._progress
        await progress.wait()

    def _progressed(self) -> None:
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()

    # --- lifecycle ---------------------------------------------------------------------------

    async def setup(self) -> None:
        if self.identity is None:
            return
        scope = self.identity.scope
        queue = await self.bus.declare_queue(QueueSpec(wake_queue(scope.corpus_id), QueueKind.WAKE,
                                                       max_length=WAKE_QUEUE_LENGTH))
        # Fed by the hubs' exchange: one wake-up per publisher window, not one per change (each a
        # quorum-queue message). A queue of an older version is also bound on the event exchange:
        # that binding goes (idempotent; False when there is none to remove).
        await self.bus.declare_exchange(scope.hub_exchange)
        await self.bus.bind(queue, scope.hub_exchange, "#")
        await self.bus.unbind(queue, scope.events_exchange, "#")
        self._consumer = await self.bus.consume(queue, self._on_wake, prefetch=16)

    async def _on_wake(self, _delivery: Delivery) -> None:
        # A hint only: returning acks it; the next round reads the history itself.
        self._wake.set()

    async def stop_intake(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.cancel()

    async def close(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.drain(1.0)
            self._consumer = None

    # --- main loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        if self.identity is None or self.lineage is None or self.signer is None:
            self.log.error("archiver.identity_unavailable", detail="the corpus identity check failed; "
                           "archiving nothing until the operator fixes it")
            await self._stop_requested.wait()
            return
        await serve_while_locked(
            "archiver", self.log, self._stop_requested,
            lambda: open_lock_session(self.db, self.dsn, ARCHIVER_LOCK, application_name(self.node_id)),
            self._archive_while_active, self._inactive, self.standby_interval)

    def _inactive(self) -> None:
        self.active = False

    async def _archive_while_active(self, session: LockSession) -> None:
        self.active = True
        self.activations += 1
        self.log.info("archiver.active", store=self.store.description)
        backoff = STORE_BACKOFF[0]
        loop = asyncio.get_running_loop()
        next_measure = loop.time()
        while not self._stop_requested.is_set():
            self._wake.clear()
            try:
                if not self._probed:
                    await self.store.probe_create_only()  # CreateOnlyIgnored propagates: refused
                    self._probed = True
                    await self.store.put(public_key_key(self._lineage), (self._signer.verifier().text() + "\n").encode())
                    if self.parent_lineage is None:
                        # A restored history names its parent in the manifest (migration 0008's row).
                        self.parent_lineage = await session.conn.fetchval(
                            "select parent_lineage from corpus_provenance")
                busy = False
                for stream in (Stream.PUBLIC, Stream.PRIVATE):
                    busy |= await guarded(session, self._round(session, stream))
                if loop.time() >= next_measure:
                    # Counting the lag costs a scan of up to 100,000 index entries: once a second is plenty.
                    await guarded(session, self._measure(session))
                    next_measure = loop.time() + MEASURE_INTERVAL
            except (ForkAlarm, CreateOnlyIgnored):
                raise
            except ArchiveStoreError as e:
                self.store_error = str(e)
                self.log.warning("archiver.store_unavailable", error=str(e), retry_in=round(backoff, 2),
                                 detail="nothing is marked verified until the store answers again")
                await self._pause(backoff, session.lost)
                if session.lost.is_set():
                    raise LockLost("the archiver's database session closed") from None
                backoff = min(backoff * 2, STORE_BACKOFF[1])
                continue
            if self.store_error is not None:
                self.log.info("archiver.store_available")
                self.store_error = None
            backoff = STORE_BACKOFF[0]
            if busy:
                continue
            wait = await guarded(session, self._next_deadline(session))
            await self._pause(min(self.sweep_interval, wait), session.lost, self._wake)
            if session.lost.is_set():
                raise LockLost("the archiver's database session closed")

    @property
    def _lineage(self) -> uuid.UUID:
        assert self.lineage is not None
        return self.lineage

    @property
    def _signer(self) -> SignerKey:
        assert self.signer is not None
        return self.signer

    async def _round(self, session: LockSession, stream: Stream) -> bool:
        """Move ``stream`` one step on; True when there may be more to do at once."""
        conn = session.conn
        if stream is Stream.PRIVATE:
            await self._capture(conn)
        unfinished = await conn.fetch(
            f"select {_SEGMENT_COLUMNS} from archive_segments where stream = $1 and state <> 'published' "
            "order by segment_index", int(stream))
        if unfinished:
            rows = [_row(r) for r in unfinished]
            for row in rows:
                if row.state == "sealed":
                    row = await self._write(conn, row)
                if row.state == "written":
                    row = await self._verify(conn, row)
            await self._publish(conn, stream)
            return True
        return await self._seal(conn, stream)

    # --- private capture ---------------------------------------------------------------------

    async def _capture(self, conn: Any) -> int:
        """Turn pending agents and operation records into private records; the number captured."""
        async with conn.transaction():
            keys = await conn.fetch(_TAKE_PENDING, CAPTURE_BATCH)
            if not keys:
                return 0
            # A new statement, so a new snapshot: it sees every change that marked the rows just
            # taken (their markers held the rows' locks until they committed).
            agents = [k["agent_id"] for k in keys if k["kind"] == "agent"]
            ops = [k for k in keys if k["kind"] == "operation"]
            records: list[tuple[tuple[str, str, str, str], PrivateRecord]] = []
            for r in await conn.fetch(_READ_AGENTS, agents) if agents else []:
                records.append((("agent", str(r["agent_id"]), "", ""), AgentRecord(
                    r["agent_id"], r["name"], r["description"], bytes(r["credential_hash"]),
                    r["onboarded_at"], r["created_at"])))
            if ops:
                for r in await conn.fetch(_READ_OPERATIONS, [k["agent_id"] for k in ops],
                                          [k["operation"] for k in ops], [k["token"] for k in ops]):
                    records.append((("operation", str(r["author_id"]), r["operation"], r["token"]), OperationRecord(
                        r["author_id"], r["operation"], r["token"], bytes(r["request_hash"]), r["status"],
                        r["response"], r["sequence"], r["created_at"])))
            if not records:
                return 0
            records.sort(key=lambda item: item[0])
            start = int(await conn.fetchval("select coalesce(max(sequence), 0) from archive_private_records"))
            await conn.execute(
                "insert into archive_private_records (sequence, kind, agent_id, operation, token, body) "
                "select * from unnest($1::bigint[], $2::text[], $3::uuid[], $4::text[], $5::text[], $6::bytea[])",
                list(range(start + 1, start + 1 + len(records))), [k[0] for k, _ in records],
                [k[1] for k, _ in records], [k[2] for k, _ in records], [k[3] for k, _ in records],
                [encode_private_record(rec) for _, rec in records])
        return len(records)

    # --- seal --------------------------------------------------------------------------------

    async def _seal(self, conn: Any, stream: Stream) -> bool:
        """Record the next segment of ``stream`` if a rule says so; True when one was sealed."""
        last = await conn.fetchrow(
            f"select {_SEGMENT_COLUMNS} from archive_segments where stream = $1 order by segment_index desc limit 1",
            int(stream))
        previous = _row(last) if last is not None else None
        after = previous.last if previous is not None else 0
        query = _PUBLIC_CANDIDATES if stream is Stream.PUBLIC else _PRIVATE_CANDIDATES
        rows = await conn.fetch(query, after, self.policy.events, self.policy.bytes)
        if not rows:
            return False
        bodies = [_body(stream, r["body"]) for r in rows]
        take, size = 0, HEADER_SIZE + TRAILER_SIZE
        for body in bodies:
            grown = size + FRAME_OVERHEAD + len(body)
            if take and grown > self.policy.bytes:
                break
            take, size = take + 1, grown
        rule = ("bytes" if take < len(bodies) else "events" if take == self.policy.events
                else "age" if rows[0]["age"] >= self.policy.seconds else None)
        if rule is None:
            return False
        index = previous.index + 1 if previous is not None else 0
        previous_hash = previous.hash if previous is not None else GENESIS_HASH
        assert previous_hash is not None  # the previous segment is published, hence encoded
        tree_size = (previous.tree_size if previous is not None else 0) + take
        await conn.execute(
            "insert into archive_segments (stream, segment_index, first_sequence, last_sequence, event_count, "
            "tree_size, previous_hash) values ($1, $2, $3, $4, $5, $6, $7)",
            int(stream), index, rows[0]["sequence"], rows[take - 1]["sequence"], take, tree_size, previous_hash)
        self.log.info("archiver.sealed", stream=stream.name.lower(), index=index, first=rows[0]["sequence"],
                      last=rows[take - 1]["sequence"], events=take, rule=rule)
        return True

    async def _next_deadline(self, session: LockSession) -> float:
        """Seconds until the oldest unarchived event of either stream turns ``policy.seconds`` old."""
        wait = self.sweep_interval
        for stream, query in ((Stream.PUBLIC, _PUBLIC_CANDIDATES), (Stream.PRIVATE, _PRIVATE_CANDIDATES)):
            after = await session.conn.fetchval(
                "select coalesce(max(last_sequence), 0) from archive_segments where stream = $1", int(stream))
            row = await session.conn.fetchrow(query, after, 1, 1)
            if row is not None:
                wait = min(wait, max(0.0, self.policy.seconds - row["age"]) + 0.01)
        return wait

    # --- write, verify -----------------------------------------------------------------------

    async def _encode(self, conn: Any, row: _Row) -> tuple[bytes, CompactTree]:
        """The bytes of ``row``'s segment and the stream's tree after it."""
        query = _PUBLIC_RANGE if row.stream is Stream.PUBLIC else _PRIVATE_RANGE
        records = await conn.fetch(query, row.first, row.last)
        events = [ArchivedEvent(r["sequence"], _body(row.stream, r["body"])) for r in records]
        if len(events) != row.count:
            raise ArchiverError(f"{row.stream.name.lower()} segment {row.index} was sealed with {row.count} events "
                                f"in {row.first}..{row.last}, the history now holds {len(events)} there")
        if row.index == 0:
            tree = CompactTree()
        else:
            prior = await conn.fetchrow(f"select {_SEGMENT_COLUMNS} from archive_segments "
                                        "where stream = $1 and segment_index = $2", int(row.stream), row.index - 1)
            tree = _row(prior).tree()
        for e in events:
            tree.append_hash(e.leaf_hash)
        if tree.size != row.tree_size:
            raise ArchiverError(f"{row.stream.name.lower()} segment {row.index}: tree size {tree.size}, "
                                f"recorded {row.tree_size}")
        return encode_segment(row.stream, self._lineage, row.index, row.previous_hash, events), tree

    def _key(self, row: _Row) -> str:
        return segment_key(self._lineage, row.index, row.first, row.last, row.stream)

    async def _write(self, conn: Any, row: _Row) -> _Row:
        data, tree = await self._encode(conn, row)
        outcome = await self.store.put(self._key(row), data)
        self.puts[outcome.name.lower()] = self.puts.get(outcome.name.lower(), 0) + 1
        assert tree.frontier is not None
        digest, root = data[-HASH_SIZE:], data[-2 * HASH_SIZE:-HASH_SIZE]
        async with conn.transaction():
            await conn.execute(
                "update archive_segments set state = 'written', size = $3, hash = $4, merkle_root = $5, "
                "frontier = $6, written_at = now() where stream = $1 and segment_index = $2 and state = 'sealed'",
                int(row.stream), row.index, len(data), digest, root, b"".join(tree.frontier))
            await conn.execute("update archive_watermarks set archived_through = greatest(archived_through, $2), "
                               "updated_at = now() where stream = $1", int(row.stream), row.last)
        self.log.info("archiver.written", stream=row.stream.name.lower(), index=row.index, size=len(data),
                      outcome=outcome.name.lower())
        self._progressed()
        return _row(await conn.fetchrow(f"select {_SEGMENT_COLUMNS} from archive_segments "
                                        "where stream = $1 and segment_index = $2", int(row.stream), row.index))

    async def _verify(self, conn: Any, row: _Row) -> _Row:
        key = self._key(row)
        try:
            data = await self.store.get(key)
        except ObjectNotFound:
            # Written once, gone now (an operator's mistake, a store that lost it): write it again.
            self.log.error("archiver.segment_missing", key=key, detail="writing it again")
            data, _tree = await self._encode(conn, row)
            await self.store.put(key, data)
            data = await self.store.get(key)
        try:
            decoded = decode_segment(data, expected_previous_hash=row.previous_hash, expected_lineage=self._lineage,
                                     expected_index=row.index, expected_stream=row.stream)
        except ArchiveFormatError as e:
            raise ArchiverError(f"segment {key} read back from the store fails its check: {e.kind}: {e}") from e
        if decoded.hash != row.hash or decoded.size != row.size:
            raise ArchiverError(f"segment {key} read back from the store is not the one written")
        async with conn.transaction():
            await conn.execute("update archive_segments set state = 'verified', verified_at = now() "
                               "where stream = $1 and segment_index = $2 and state = 'written'",
                               int(row.stream), row.index)
            await conn.execute("update archive_watermarks set verified_through = greatest(verified_through, $2), "
                               "updated_at = now() where stream = $1", int(row.stream), row.last)
        self.verified_through[row.stream] = row.last
        self.log.info("archiver.verified", stream=row.stream.name.lower(), index=row.index)
        self._progressed()
        return dataclasses.replace(row, state="verified")

    # --- publish -----------------------------------------------------------------------------

    async def _publish(self, conn: Any, stream: Stream) -> None:
        """Checkpoint (and, public, the manifest) up to the last verified segment; mark them published."""
        top = await conn.fetchrow(
            f"select {_SEGMENT_COLUMNS} from archive_segments where stream = $1 and state = 'verified' "
            "order by segment_index desc limit 1", int(stream))
        if top is None:
            return
        last = _row(top)
        checkpoint = Checkpoint(self._signer.name, last.tree_size, last.tree().root(),
                                (PRIVATE_EXTENSION,) if stream is Stream.PRIVATE else ())
        note = sign_checkpoint(checkpoint, self._signer)  # Ed25519 is deterministic: a retry puts the same bytes
        key = (checkpoint_key if stream is Stream.PUBLIC else private_checkpoint_key)(self._lineage, last.tree_size)
        await self.store.put(key, note.encode())
        if stream is Stream.PUBLIC:
            listed = await conn.fetch(
                "select segment_index, first_sequence, last_sequence, event_count, size, hash from archive_segments "
                "where stream = 0 and state in ('verified', 'published') and segment_index <= $1 "
                "order by segment_index", last.index)
            manifest = Manifest(self._lineage, self.parent_lineage, tuple(
                ManifestSegment(r["segment_index"], r["first_sequence"], r["last_sequence"], r["event_count"],
                                r["size"], bytes(r["hash"]).hex()) for r in listed))
            validate_manifest(manifest)
            await self.store.replace(manifest_key(self._lineage), encode_manifest(manifest))
        async with conn.transaction():
            await conn.execute("insert into archive_checkpoints (stream, tree_size, root, note) values ($1, $2, $3, $4) "
                               "on conflict do nothing", int(stream), last.tree_size, checkpoint.root, note)
            await conn.execute("update archive_segments set state = 'published', published_at = now() "
                               "where stream = $1 and state = 'verified' and segment_index <= $2",
                               int(stream), last.index)
            await conn.execute("update archive_watermarks set published_through = greatest(published_through, $2), "
                               "updated_at = now() where stream = $1", int(stream), last.last)
        self.log.info("archiver.published", stream=stream.name.lower(), tree_size=last.tree_size)
        self._progressed()

    async def _measure(self, session: LockSession) -> None:
        verified = int(await session.conn.fetchval(
            "select verified_through from archive_watermarks where stream = 0"))
        self.verified_through[Stream.PUBLIC] = verified
        self.lag_events = int(await session.conn.fetchval(
            "select count(*) from (select 1 from changes where sequence > $1 limit 100000) as behind", verified))

    async def _pause(self, seconds: float, *events: asyncio.Event) -> None:
        await pause(seconds, self._stop_requested, *events)


class ArchiverCollector(SingleActiveCollector[Archiver]):
    """Prometheus gauges of the archiver running in this process (read at scrape time)."""

    kind = Archiver

    @staticmethod
    def families() -> tuple[Family, ...]:
        return (GaugeMetricFamily("toastmachine_archiver_active",
                                  "1 while this process's archiver holds the lock and archives."),
                GaugeMetricFamily("toastmachine_archive_verified_through",
                                  "Highest change sequence in a verified archive segment."),
                GaugeMetricFamily("toastmachine_archive_lag_events",
                                  "Committed changes not yet in a verified archive segment (counted up to 100000)."))

    def fill(self, actor: Archiver, families: tuple[Family, ...]) -> None:
        active, verified, lag = families
        active.add_metric([], 1.0 if actor.active else 0.0)
        if Stream.PUBLIC in actor.verified_through:
            verified.add_metric([], float(actor.verified_through[Stream.PUBLIC]))
        if actor.lag_events is not None:
            lag.add_metric([], float(actor.lag_events))


def export_metrics(registry: CollectorRegistry, current: Callable[[], Actor | None]) -> None:
    """Add the archiver gauges to ``registry`` once (later calls are no-ops)."""
    register_once(registry, ArchiverCollector(current))
