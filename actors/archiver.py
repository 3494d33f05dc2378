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
Steps 2 to 5 go a **batch** at a time: up to :data:`BATCH_SEGMENTS` segments (and
:data:`BATCH_SEGMENT_BYTES` segments' worth of bytes) read in one query, sealed and encoded in one
pass, each state change recorded for the whole batch in one statement, one checkpoint and one
manifest for the batch. Caught up, a batch is the one segment that just sealed, so it is published
at once; behind, the checkpoints are fewer (each still extends the last): at most one a
:data:`PUBLISH_INTERVAL` while another batch follows at once.

2. **Seal**: the events after the last segment are cut into segments at ``policy.events`` events,
   when the next event would take one past ``policy.bytes`` bytes, or ``policy.seconds`` after its
   first event (only for the batch's open tail, and only when no rows may follow it). Only
   committed events are ever read, and the writer assigns sequences in commit order under its
   sequence lock (:mod:`actors.writer.store`), so every sequence below a visible one is already
   visible: the visible history is the safe watermark, the same rule the publisher and every
   ``after=`` reader rely on (private sequences are assigned by the archiver alone, under its
   lock). The decisions (index, range, count, tree size, previous hash) are recorded in
   ``archive_segments`` *before* anything is put, so an archiver restarted at any point encodes
   the same bytes again (:meth:`Archiver._reencode`).
3. **Write**: put create-only (:data:`STORE_CONCURRENCY` at once); an existing identical object
   counts as written, a different one is a :class:`~infra.archive_store.ForkAlarm` that stops the
   archiver loudly: it crashes, and every restart the supervisor makes (with its growing back-off)
   meets the same object and reports it again, until an operator acts. The rows move to
   ``written`` with size, hash, root and the Merkle frontier after each.
4. **Verify**: read each object back; recompute its SHA-256 and compare it with the row's, check
   link, lineage, index and stream, and either compare it byte for byte with the bytes this process
   put (kept until then) or, for a segment written by an earlier run, walk its frames and CRC32Cs
   (:func:`protocol.archive.check_read_back`, :meth:`Archiver._check_now`): only then ``verified``.
   This step of one batch overlaps the next round's seal and write: the read-back, check and sync
   need no statement, so they run beside the next batch's on the lock session, and that round
   (which follows at once: the round that wrote a batch reports more to do) records the batch
   verified (:meth:`Archiver._round`); a stopping instance records the one in flight first.
5. **Publish**: sign a checkpoint of the stream's tree (``checkpoints/<size>``, kept for ever;
   private: ``private/checkpoints/<size>``, with the extension line ``private``), put the public key
   once, replace ``manifest.json`` (public stream), and mark the segments ``published``.

While behind, the batches after the one being sealed are read ahead on a pool connection (the
first one while the store is probed) and encoded ahead (:class:`actors.archive_ahead.ReadAhead`):
the next one is encoded while the one after it is read, as the current one is put, read back and
published. Batches start at :data:`FIRST_BATCH_SEGMENTS` segments after each activation and grow
:data:`BATCH_GROWTH` times a batch up to ``batch_segments``. Encoding and the read-back check run in a worker thread (hashing whole
segments and lists of events releases the GIL).

Single-active on the PostgreSQL advisory lock :data:`ARCHIVER_LOCK` with take-over (see
:mod:`infra.db.lock_session`); all lock-protected work runs on the lock's session. At its first
activation it probes the store and refuses (crashes with :class:`~infra.archive_store.CreateOnlyIgnored`)
one that ignores create-only writes. A store that is unreachable is retried with a back-off; nothing
is marked verified without a successful read-back, and sealing stops until the backlog drains
(once the failure is seen: the batch after the one being read back may already be written).

Memory: three batches' rows at most (the current one, the next one and the one after it; each at
most ``BATCH_SEGMENT_BYTES * policy.bytes`` plus one event), two of them encoded once more, and the
batch being read back twice while it is checked (the bytes put, kept for the comparison, and those
read back), plus the manifest.

Emits: archive objects and the manifest; the watermarks in ``archive_watermarks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import math
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from actors.archive_ahead import Limits, ReadAhead, Rows, Start
from actors.reads.archive import NEWEST_CHECKPOINT
from infra.archive_keys import discard_generated
from infra.archive_store import (
    ArchiveStore,
    ArchiveStoreError,
    CreateOnlyIgnored,
    ForkAlarm,
    ObjectNotFound,
    ObjectTooLarge,
)
from infra.bus.base import Bus, Consumer, Delivery, QueueKind, QueueSpec
from infra.db import CorpusIdentity, Database
from infra.db.copy_rows import copy_rows
from infra.db.lock_session import (
    LockLost,
    LockSession,
    guarded,
    lock_holder,
    open_lock_session,
    pause,
    serve_while_locked,
)
from infra.db.pool import UNAVAILABLE_ERRORS as DB_UNAVAILABLE
from infra.db.pool import Target
from infra.metrics import Family, SingleActiveCollector, register_once
from infra.runtime import Actor
from protocol.archive import (
    FORMAT_VERSION,
    FRAME_OVERHEAD,
    GENESIS_HASH,
    HASH_SIZE,
    HEADER_SIZE,
    TRAILER_SIZE,
    ArchiveFormatError,
    Stream,
    check_read_back,
    checkpoint_key,
    encode_chain,
    manifest_key,
    private_checkpoint_key,
    public_key_key,
    segment_key,
)
from protocol.archive_private import AgentRecord, OperationRecord, PrivateRecord, encode_private_record
from protocol.checkpoint import Checkpoint, SignerKey, sign_checkpoint
from protocol.errors import ConfigError, ProcessFatal, ToastMachineError
from protocol.manifest import (
    PAGE_SEGMENTS,
    ManifestPage,
    ManifestSegment,
    encode_page,
    encode_paged,
    validate_run,
)
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
#: Segments sealed, written, verified and published together at most by default (a batch: when the
#: archiver is behind, one checkpoint and one manifest per batch instead of per segment;
#: ``TOASTMACHINE_ARCHIVE_BATCH_SEGMENTS``).
BATCH_SEGMENTS = 32
#: Event bytes read per batch at most, in segments of ``policy.bytes`` (16 MiB by default).
BATCH_SEGMENT_BYTES = 4
#: Segments in a stream's first batch after the archiver becomes active; each batch read while
#: behind may hold :data:`BATCH_GROWTH` times as many as the one before, up to ``batch_segments``.
#: A cold start then puts a small batch while the next is read and encoded, instead of waiting for
#: a whole ``batch_segments`` batch to be read and encoded before the store has anything to do
#: (measured: about a fifth of a 120,000-event catch-up went to that first wait).
FIRST_BATCH_SEGMENTS = 4
#: How much larger each batch read while behind may be than the one before. Measured on a
#: 120,000-event catch-up (5 runs each): starting at 4 segments and growing 4 times reached full
#: batches two batches sooner than 2 and twice, and archived about a tenth faster.
BATCH_GROWTH = 4
#: Store requests in flight at once within a batch.
STORE_CONCURRENCY = 8
#: Seconds between two checkpoints of a stream at least while it is behind (a round that seals
#: another batch right after verifying one leaves that one verified, and the next round publishes
#: both); caught up, every verified batch is published at once. A publish (checkpoint and manifest
#: put and synced, one statement) took about a sixth of a 16,000-event catch-up batch's time on the
#: event loop, once per batch, while a mirror gains nothing from a checkpoint every tenth of a second.
PUBLISH_INTERVAL = 1.0
#: Pending private records captured per transaction.
CAPTURE_BATCH = 500
#: Seconds between two rounds of the private stream at most while the public one is behind.
#: Measured on a 120,000-event catch-up: a private round after every public batch, each a few
#: statements that found nothing to do, took about a twentieth of the time.
PRIVATE_INTERVAL = 0.5
#: Seconds between two counts of the archive's lag.
MEASURE_INTERVAL = 1.0
#: Lag counted row by row up to this many sequences; above it, the sequence difference (counting
#: sequences of rolled-back writes too) stands in, as counting costs a scan of that many rows.
EXACT_LAG = 10_000
#: Extension line of a private stream checkpoint (never a valid public one).
PRIVATE_EXTENSION = "private"
#: Seconds between a standby's checks of the signing key the database records (until one is).
KEY_WATCH_INTERVAL = 2.0
#: Seconds the start-up check of the archive's public key waits for the store (a store that does
#: not answer in time is checked again at activation, before anything is signed).
KEY_CHECK_TIMEOUT = 10.0


T = TypeVar("T")


class ArchiverError(ToastMachineError):
    """The history or the archive's bookkeeping is not what the archiver recorded: it stops."""


class StoreLacksArchive(ConfigError, ProcessFatal):
    """The archive store lacks the last checkpoint the database records as published: it is not the
    store this corpus archives to (an archiver started with another ``TOASTMACHINE_ARCHIVE_URL``, or
    its ``DATA_DIR``'s default directory on another machine), or objects were lost from it.

    Archiving on there would split the history between stores: the next segment written where
    every earlier one is missing, a manifest naming objects the store never held, and the right
    store left with a gap that no later segment fills. Checked at each activation, before anything
    is put (the create-only probe included), and once more after the store back-off before giving
    up; the process then stops with exit 2, as for a configuration error."""


class SigningKeyMismatch(ConfigError, ProcessFatal):
    """The archive already holds the public key of another signing key than this archiver's.

    Every archiver of a corpus must sign with the same key: a standby with a key of its own (its own
    ``DATA_DIR/archive-signing-key`` on another machine) would meet this only at take-over, as a
    fork alarm on ``public-key.txt``, and archive nothing. It is checked at start (a standby finds
    out when it is deployed, not when it must take over) and again at each activation (a key
    published since); either way the process stops with exit 2, as for any configuration error: a
    restart meets the same key."""


def wake_queue(corpus_id: str) -> str:
    """The archiver's durable wake-up queue of a corpus."""
    return f"tm.archiver.{corpus_id}"


#: "Nothing recorded yet": distinct from None (the store answers) and from any error text.
_UNRECORDED = object()


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


# One catch-up batch of a stream: at most {limit} rows after {after}, no more than fit in {budget}
# bytes plus the row that crosses the line (so the caller can tell whether the size rule cut a
# segment, and whether rows may follow the batch). Read through binary COPY (infra.db.copy_rows),
# where a text column's binary form is its UTF-8 bytes (the connection's encoding): measured,
# about half the client CPU of fetching the same rows as records (bodies as bytea through
# textsend(), itself cheaper than text decoded to str and encoded again, than convert_to() and
# than parsing COPY's text output). The running sum's frame is in rows (the sequence is unique,
# so the same sum as the default range frame): measured, a quarter less of the server's time
# than the range frame. The placeholders take integers only.
_BATCH = (
    "select sequence, body from ("
    "  select sequence, body, sum(octet_length(body)) over (order by sequence rows unbounded preceding) - octet_length(body) as before"
    "  from (select sequence, {column} as body from {table} where sequence > {after}"
    "  order by sequence limit {limit}) as page) as sized where before < {budget} order by sequence")
_RANGE = "select sequence, {column} from {table} where sequence between {first} and {last} order by sequence"
#: Per stream: the table its events are read from, and the column holding an event's bytes.
_SOURCES = {Stream.PUBLIC: {"table": "changes", "column": "event"},
            Stream.PRIVATE: {"table": "archive_private_records", "column": "body"}}


async def _read_batch(conn: Any, stream: Stream, after: int, limit: int, budget: int) -> tuple[list[int], list[bytes]]:
    """The sequences and bodies of the batch after ``after`` (see ``_BATCH``)."""
    return await copy_rows(conn, _BATCH.format(**_SOURCES[stream], after=int(after), limit=int(limit),
                                               budget=int(budget)))


async def _read_range(conn: Any, stream: Stream, first: int, last: int) -> tuple[list[int], list[bytes]]:
    """The sequences and bodies of ``stream``'s events ``first`` to ``last``."""
    return await copy_rows(conn, _RANGE.format(**_SOURCES[stream], first=int(first), last=int(last)))


# Seconds since the first event after $1 (the start of the open segment), or no row.
_PUBLIC_AGE = ("select extract(epoch from now() - occurred_at)::float8 from changes where sequence > $1 "
               "order by sequence limit 1")
_PRIVATE_AGE = ("select extract(epoch from now() - captured_at)::float8 from archive_private_records "
                "where sequence > $1 order by sequence limit 1")

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


def segment_size(bodies: Iterable[bytes]) -> int:
    """The encoded size of a segment holding ``bodies``."""
    return HEADER_SIZE + TRAILER_SIZE + sum(FRAME_OVERHEAD + len(b) for b in bodies)


def seal_cuts(lengths: list[int], policy: SealPolicy) -> tuple[list[tuple[int, int, str]], int]:
    """The segments the events and bytes rules cut from consecutive events of these byte lengths,
    as ``(start, end, rule)`` index ranges, and where the uncut tail starts (``len(lengths)``: none).

    A segment ends after ``policy.events`` events, or before the event that would take its encoded
    size past ``policy.bytes`` (a segment holds at least one event, however large). A stretch of
    ``policy.events`` events whose whole size fits is cut at once (sizes only grow as events are
    added); only a stretch that does not fit is walked event by event, to find where it crosses.
    """
    cuts: list[tuple[int, int, str]] = []
    empty, events, limit, n = HEADER_SIZE + TRAILER_SIZE, policy.events, policy.bytes, len(lengths)
    start = 0
    while start < n:
        end = min(start + events, n)
        if empty + FRAME_OVERHEAD * (end - start) + sum(lengths[start:end]) <= limit:
            if end - start < events:
                break  # the open tail
            cuts.append((start, end, "events"))
            start = end
            continue
        size = empty + FRAME_OVERHEAD + lengths[start]
        for i in range(start + 1, end):
            size += FRAME_OVERHEAD + lengths[i]
            if size > limit:
                cuts.append((start, i, "bytes"))
                start = i
                break
        else:
            # Only the first event is past the limit, and it is alone in this stretch: no event
            # can join it, so it is a segment of its own at once (whether or not rows follow it, as a
            # batch that ends at its byte budget may hold only this event).
            cuts.append((start, end, "events" if end - start >= events else "bytes"))
            start = end
    return cuts, start


@dataclass(frozen=True, slots=True)
class _Encoded:
    """A sealed segment's bytes, before they are put: the row as recorded, and the row it becomes."""

    sealed: _Row
    data: bytes
    #: The stream's tree after this segment, as the row's ``frontier`` column holds it.
    frontier: bytes

    @property
    def written(self) -> _Row:
        return dataclasses.replace(self.sealed, state="written", size=len(self.data), hash=self.data[-HASH_SIZE:],
                                   frontier=self.frontier)

    @property
    def root(self) -> bytes:
        return self.data[-2 * HASH_SIZE:-HASH_SIZE]


async def _last_segment(conn: Any, stream: Stream) -> _Row | None:
    """The newest ``archive_segments`` row of ``stream``, whatever its state (None: none yet)."""
    last = await conn.fetchrow(
        f"select {_SEGMENT_COLUMNS} from archive_segments where stream = $1 order by segment_index desc limit 1",
        int(stream))
    return _row(last) if last is not None else None


def _start_after(last: _Encoded) -> tuple[Start, CompactTree]:
    """Where the encoding of the batch after the one ending with segment ``last`` starts, and the tree."""
    return (last.sealed.index + 1, last.data[-HASH_SIZE:], last.sealed.tree_size), last.written.tree()


def _chain_start(previous: _Row | None) -> tuple[int, Start, CompactTree]:
    """Where the batch after segment ``previous`` (None: the first) starts: the sequence after which
    its events are read, where its encoding starts, and the stream's tree before it."""
    if previous is None:
        return 0, (0, GENESIS_HASH, 0), CompactTree()
    assert previous.hash is not None  # the previous segment is written, hence encoded
    return previous.last, (previous.index + 1, previous.hash, previous.tree_size), previous.tree()


async def _store_all(calls: list[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run store calls, :data:`STORE_CONCURRENCY` at a time, and wait for all of them.

    Every call finishes before any failure is raised (none is left running on its own); a fork
    alarm outranks other errors, since it must stop the archiver whatever else failed.
    """
    semaphore = asyncio.Semaphore(STORE_CONCURRENCY)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with semaphore:
            return await call()

    results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if isinstance(e, ForkAlarm)), errors[0])
    return cast("list[T]", results)


@dataclass(frozen=True, slots=True)
class _Stored:
    """What reading a batch back found: the segments gone from the store, and whether the sync of
    all of them succeeded (it fails when one is gone)."""

    missing: list[_Row]
    synced: bool


@dataclass(slots=True)
class _Checking:
    """A written batch being read back, checked and synced (:meth:`Archiver._check_stored`)."""

    rows: list[_Row]
    task: asyncio.Future[_Stored]  # holds the bytes put (for the comparison) until it is done

    async def outcome(self) -> _Stored:
        return await self.task

    def close(self) -> None:
        """Drop the check (see :func:`_drop`)."""
        _drop(self.task)


def _drop(future: asyncio.Future[Any]) -> None:
    """Cancel ``future`` and retrieve its failure, if it had one, when it ends (no warning)."""
    future.cancel()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


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
        batch_segments: segments handled together at most (see :data:`BATCH_SEGMENTS`).
        manifest_page: segments per manifest page (:data:`protocol.manifest.PAGE_SEGMENTS`).
        generated_key_file: the key file this process generated for ``signer``, if it did.
        publish_interval: seconds between two checkpoints of a stream at least while batches follow
            at once (:data:`PUBLISH_INTERVAL`; 0 publishes every batch).
    """

    name = "archiver"

    def __init__(self, bus: Bus, db: Database, *, identity: CorpusIdentity | None, store: ArchiveStore,
                 signer: SignerKey | None, node_id: str, dsn: str | None = None, policy: SealPolicy | None = None,
                 sweep_interval: float = 5.0, standby_interval: float = DEFAULT_STANDBY_INTERVAL,
                 parent_lineage: uuid.UUID | None = None, batch_segments: int = BATCH_SEGMENTS,
                 store_backoff: tuple[float, float] = STORE_BACKOFF, manifest_page: int = PAGE_SEGMENTS,
                 generated_key_file: Path | None = None, publish_interval: float = PUBLISH_INTERVAL) -> None:
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
        self.batch_segments = batch_segments
        #: Back-off after a store failure: doubles from the first value up to the second (STORE_BACKOFF).
        self.store_backoff = store_backoff
        #: Segments per manifest page (PAGE_SEGMENTS; smaller in tests, to have pages at all).
        self.manifest_page = manifest_page
        #: The key file this process generated for ``signer`` (None: configured, or found): removed
        #: again when the key is refused as not the corpus's.
        self.generated_key_file = generated_key_file
        self.publish_interval = publish_interval
        #: The manifest pages written or found this activation (built up from its first publish).
        self._pages: list[ManifestPage] = []
        self.lineage = uuid.UUID(str(identity.lineage)) if identity is not None else None
        #: True while this instance holds the lock and archives.
        self.active = False
        #: Times this instance became active.
        self.activations = 0
        #: The last store failure while active (None once the store answers again).
        self.store_error: str | None = None
        #: What archiver_store_state says this instance recorded last (_UNRECORDED: not read or
        #: written since this activation, so the first round writes it whatever it held).
        self._recorded_store_error: str | None | object = _UNRECORDED
        #: Per stream: the highest sequence in a verified segment, as this instance last saw it.
        self.verified_through: dict[Stream, int] = {}
        #: Per stream: the tree size of the last checkpoint this instance published.
        self.published_size: dict[Stream, int] = {}
        #: Per stream: the event loop's time of this instance's last publish (see PUBLISH_INTERVAL).
        self._published_at: dict[Stream, float] = {}
        #: Public events committed but not yet in a verified segment (as of the last round).
        self.lag_events: int | None = None
        #: Objects this instance put (created or found identical), by outcome name.
        self.puts: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._consumer: Consumer | None = None
        self._probed = False
        self._store_checked = False
        #: The key of the published checkpoint last found absent, until it is found again (see
        #: :meth:`_check_store_holds_published`: absent twice in a row, a back-off apart, stops it).
        self._absent_once: str | None = None
        self._key_published = False  # public-key.txt written and synced (and the parent lineage read)
        #: Set once this process's sweep of leftover staging files is done (it runs beside the
        #: rounds: on a large directory store, walking every folder takes a while).
        self.staging_swept = asyncio.Event()
        self._sweeping: asyncio.Task[None] | None = None
        self._progress = asyncio.Event()
        #: Per stream: the batches after the current one, read and encoded ahead while it is put and read back.
        self._ahead: dict[Stream, ReadAhead[_Encoded, CompactTree]] = {}
        #: Per stream: segments the next batch may hold (see :data:`FIRST_BATCH_SEGMENTS`).
        self._batch_now: dict[Stream, int] = {}
        #: Per stream: the last batch written, being read back, checked and synced while the next
        #: one is sealed and put (recorded verified by the next round: :meth:`_round`).
        self._checking: dict[Stream, _Checking] = {}

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
        # A standby must be able to take over: check its key now, not at the take-over.
        try:
            async with asyncio.timeout(KEY_CHECK_TIMEOUT):
                await self._check_signing_key(self.db.pool)
        except _KEY_UNCHECKED as e:
            self.log.warning("archiver.key_unchecked", error=str(e) or "no answer in time",
                             detail="the signing key is checked again before the first checkpoint")

    async def _check_signing_key(self, conn: Any, *, record: bool = False) -> None:
        """Raise :class:`SigningKeyMismatch` when this corpus signs with another key than this
        archiver's: the one its database recorded (migration 0014: the first archiver's, or the
        restored archive's), or the one whose public key the archive already holds. ``record``
        (when active, before it first signs): record this archiver's key when none is yet."""
        ours = self._signer.verifier().text()
        recorded = await conn.fetchval(_RECORDED_KEY)
        if recorded is not None and recorded != ours:
            raise self._recorded_mismatch(ours, recorded)
        key = public_key_key(self._lineage)
        try:
            stored: bytes | None = await self.store.get(key, max_bytes=4096)
        except ObjectNotFound:
            stored = None
        except ObjectTooLarge:
            stored = b""  # no public key is that long
        if stored is not None and stored != (ours + "\n").encode():
            raise self._key_mismatch(ours, f"{key} at {self.store.description} holds "
                                           f"{_shown(stored.decode('utf-8', 'replace').strip())}")
        if record and recorded is None:
            await conn.execute("insert into archive_signing_key (public_key) values ($1) on conflict do nothing", ours)
            recorded = await conn.fetchval(_RECORDED_KEY)
            if recorded != ours:  # (only the lock holder records: no other can have come first)
                raise self._recorded_mismatch(ours, recorded)

    def _recorded_mismatch(self, ours: str, recorded: str | None) -> SigningKeyMismatch:
        """The refusal of this archiver's key for the one the database records (``recorded``)."""
        return self._key_mismatch(ours, f"this corpus's database records {_shown(recorded or '')}")

    def _key_mismatch(self, ours: str, theirs: str) -> SigningKeyMismatch:
        """The refusal of this archiver's key; a key file this process generated for it goes (it is
        no key of this corpus: left there, it could be backed up as the corpus's)."""
        if self.generated_key_file is not None and self.signer is not None:
            discard_generated(self.generated_key_file, self.signer)
        return SigningKeyMismatch(
            f"this archiver's signing key ({ours}) is not the one that signs this corpus's archive ({theirs}): "
            "every archiver of a corpus signs with the corpus's key. Set TOASTMACHINE_ARCHIVE_SIGNING_KEY to it "
            "(the contents of the first archiver's DATA_DIR/archive-signing-key), or, after a restore, copy that "
            "file into this DATA_DIR (if it is lost, restore again into an empty database with --new-signing-key)")

    async def _on_wake(self, _delivery: Delivery) -> None:
        # A hint only: returning acks it; the next round reads the history itself.
        self._wake.set()

    async def stop_intake(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.cancel()

    async def close(self) -> None:
        self._drop_read_ahead()
        self._drop_checking()
        if self._sweeping is not None and not self._sweeping.done():
            self._sweeping.cancel()  # the walk's thread finishes on its own; nothing waits for it
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
        watch = asyncio.ensure_future(self._watch_key_while_standby())
        try:
            await serve_while_locked(
                "archiver", self.log, self._stop_requested,
                lambda: open_lock_session(self.db, self.dsn, ARCHIVER_LOCK, application_name(self.node_id)),
                self._archive_while_active, self._inactive, self.standby_interval)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    async def _check_store_holds_published(self, conn: Any) -> None:
        """:class:`StoreLacksArchive` unless the store holds, byte for byte, each stream's last
        checkpoint the database records as published (a different one is a :class:`ForkAlarm`)."""
        for stream, key_of in ((Stream.PUBLIC, checkpoint_key), (Stream.PRIVATE, private_checkpoint_key)):
            last = await conn.fetchrow(NEWEST_CHECKPOINT, int(stream))
            if last is None:
                continue
            key = key_of(self._lineage, last["tree_size"])
            try:
                stored = await self.store.get(key)
            except ObjectNotFound:
                if self._absent_once != key:
                    # Looked at again after the back-off before stopping for good: a store may answer
                    # "not found" for a moment (a replica catching up, a share just remounted).
                    self._absent_once = key
                    raise ArchiveStoreError(f"archive store ({self.store.description}): {key}, published by "
                                            "this corpus, was not found; looking again before stopping") from None
                raise StoreLacksArchive(
                    f"the archive store ({self.store.description}) lacks {key}, the {stream.name.lower()} "
                    f"checkpoint at tree size {last['tree_size']} this corpus's database records as published: "
                    "it is not the store this corpus archives to, or objects were lost from it. Every archiver "
                    "of a corpus must use the same TOASTMACHINE_ARCHIVE_URL (a shared S3 bucket, not each "
                    "machine's DATA_DIR); 'toastmachine archive verify' lists what a store lacks.") from None
            self._absent_once = None
            note = last["note"].encode()
            if stored != note:
                raise ForkAlarm(key, hashlib.sha256(stored).hexdigest(), hashlib.sha256(note).hexdigest())

    async def _watch_key_while_standby(self) -> None:
        """While this instance stands by, compare its key with the one the database records, every
        :data:`KEY_WATCH_INTERVAL` seconds until one is recorded: a standby started with a key of
        its own beside the first archiver of a fresh corpus (nothing recorded yet when it started)
        stops as soon as that one records its key, not when it has to take over."""
        ours = self._signer.verifier().text()
        while not self._stop_requested.is_set():
            await pause(KEY_WATCH_INTERVAL, self._stop_requested)
            if self.active or self._stop_requested.is_set():
                continue
            try:
                recorded = await self.db.pool.fetchval(_RECORDED_KEY)
            except DB_UNAVAILABLE:
                continue
            if recorded == ours:
                return
            if recorded is not None:
                self.fail(self._recorded_mismatch(ours, recorded))
                return

    async def _sweep_staging(self) -> None:
        """Remove the staging files a crash left behind, once per process, beside the rounds (the
        sweep only removes files an hour old, never a put's own, and never raises)."""
        swept, left = await self.store.sweep_staging()
        if swept or left:
            self.log.info("archiver.staging_swept", removed=swept, left=left,
                          detail="staging files a crash left behind (left: not removable)")
        self.staging_swept.set()

    def _inactive(self) -> None:
        self.active = False
        self._drop_read_ahead()
        self._drop_checking()

    def _drop_checking(self) -> None:
        """Forget the read-backs in flight: their segments stay ``written`` in the database, and a
        later round (this instance's or a successor's) verifies them again from there."""
        for checking in self._checking.values():
            checking.close()
        self._checking.clear()

    async def _archive_while_active(self, session: LockSession) -> None:
        self.active = True
        self.activations += 1
        self._batch_now.clear()  # each activation starts with small batches again
        self._recorded_store_error = _UNRECORDED  # a predecessor may have left a failure recorded
        self._pages = []  # built again from the database, from this activation's first publish
        self._store_checked = False  # the store checked again: another process may have written since
        self.log.info("archiver.active", store=self.store.description)
        backoff = self.store_backoff[0]
        loop = asyncio.get_running_loop()
        next_measure = next_private = loop.time()
        # Read the first public batch while the store is probed and the first round starts.
        await guarded(session, self._read_first(session))
        while not self._stop_requested.is_set():
            self._wake.clear()
            try:
                if not self._store_checked:
                    # At each activation, before anything is put (the probe included).
                    await guarded(session, self._check_store_holds_published(session.conn))
                    self._store_checked = True
                if not self._probed:
                    await self.store.probe_create_only()  # CreateOnlyIgnored propagates: refused
                    if self._sweeping is None:
                        self._sweeping = asyncio.ensure_future(self._sweep_staging())
                    self._probed = True
                if not self._key_published:
                    # Its own step: a store that fails here (after a good probe) gets it retried
                    # after the back-off, without another probe object each time.
                    # A key published or recorded since this process started; this one recorded if none.
                    await guarded(session, self._check_signing_key(session.conn, record=True))
                    await self.store.put(public_key_key(self._lineage), (self._signer.verifier().text() + "\n").encode())
                    await self.store.sync([public_key_key(self._lineage)])
                    if self.parent_lineage is None:
                        # A restored history names its parent in the manifest (migration 0008's row).
                        self.parent_lineage = await session.conn.fetchval(
                            "select parent_lineage from corpus_provenance")
                    self._key_published = True
                busy = await guarded(session, self._round(session, Stream.PUBLIC))
                # Behind on the public stream, the private one gets a round once a PRIVATE_INTERVAL
                # (each costs a few statements even with nothing to do); caught up, every time.
                if not busy or loop.time() >= next_private:
                    busy |= await guarded(session, self._round(session, Stream.PRIVATE))
                    next_private = loop.time() + PRIVATE_INTERVAL
                if loop.time() >= next_measure:
                    # Counting the lag costs a scan of up to EXACT_LAG rows: once a second is plenty.
                    await guarded(session, self._measure(session))
                    next_measure = loop.time() + MEASURE_INTERVAL
            except (ForkAlarm, CreateOnlyIgnored):
                raise
            except ArchiveStoreError as e:
                self.store_error = str(e)
                self.log.warning("archiver.store_unavailable", error=str(e), retry_in=round(backoff, 2),
                                 detail="nothing is marked verified until the store answers again")
                await guarded(session, self._record_store_state(session, self.store_error))
                await self._pause(backoff, session.lost)
                if session.lost.is_set():
                    raise LockLost("the archiver's database session closed") from None
                backoff = min(backoff * 2, self.store_backoff[1])
                continue
            if self.store_error is not None:
                self.log.info("archiver.store_available")
                self.store_error = None
            await guarded(session, self._record_store_state(session, None))
            backoff = self.store_backoff[0]
            if busy:
                continue
            wait = await guarded(session, self._next_deadline(session))
            await self._pause(min(self.sweep_interval, wait), session.lost, self._wake)
            if session.lost.is_set():
                raise LockLost("the archiver's database session closed")
        # Stopping: record the batches still being read back (within the stop's grace period), so a
        # successor does not read them back again walking every frame.
        try:
            await guarded(session, self._finish_checking(session))
        except ArchiveStoreError as e:
            self.log.warning("archiver.stop_unverified", error=str(e),
                             detail="left written; the next archiver verifies them")

    async def _finish_checking(self, session: LockSession) -> None:
        """Record verified, and publish, the batches whose read-back is in flight."""
        for stream in list(self._checking):
            await self._record_checked(session.conn, stream, self._checking.pop(stream))

    async def _record_checked(self, conn: Any, stream: Stream, checking: _Checking, *,
                              more: bool = False) -> None:
        """Once its read-back, check and sync are done, record ``checking``'s batch verified, then
        publish (``more``: another batch is on its way, so not within ``publish_interval`` of the
        last publish); the check is dropped if this fails before it is done."""
        try:
            stored = await checking.outcome()
        except BaseException:
            checking.close()
            raise
        await self._verified(conn, checking.rows, stored)
        loop = asyncio.get_running_loop()
        if more and loop.time() < self._published_at.get(stream, -math.inf) + self.publish_interval:
            return  # the next round publishes it with its own batch (or, caught up, at once)
        await self._publish(conn, stream)

    @property
    def _lineage(self) -> uuid.UUID:
        assert self.lineage is not None
        return self.lineage

    @property
    def _signer(self) -> SignerKey:
        assert self.signer is not None
        return self.signer

    def _limits(self, segments: int) -> Limits:
        """Events and event bytes a batch of ``segments`` segments is read with at most.

        The bytes always allow one whole segment (the batch query returns the row that crosses the
        line too), so a batch of large events still cuts a segment by the bytes rule."""
        byte_segments = max(1, BATCH_SEGMENT_BYTES * segments // self.batch_segments)
        return self.policy.events * segments, self.policy.bytes * byte_segments

    def _batch_limits(self, stream: Stream) -> Limits:
        """The limits ``stream``'s next batch is read with (growing while behind, from
        :data:`FIRST_BATCH_SEGMENTS` after each activation)."""
        return self._limits(self._batch_now.get(stream, min(FIRST_BATCH_SEGMENTS, self.batch_segments)))

    def _grown(self, limits: Limits) -> Limits:
        """The limits of the batch after one read with ``limits``, while behind: :data:`BATCH_GROWTH`
        times the segments, up to ``batch_segments``."""
        return self._limits(min(self.batch_segments, BATCH_GROWTH * (limits[0] // self.policy.events)))

    def _start_read_ahead(self, stream: Stream, after: int, limits: Limits, start: Start, tree: CompactTree) -> None:
        """Read and encode ahead the batches of ``stream`` after ``after``, encoded from ``start``."""
        async def read(after: int, limits: Limits) -> tuple[list[int], list[bytes]]:
            # The history is committed and immutable: reading it needs no lock (what is sealed
            # from it is decided under the lock).
            async with self.db.pool.acquire() as conn:
                return await _read_batch(conn, stream, after, *limits)

        async def encode(start: Start, segments: list[tuple[list[int], list[bytes]]], tree: CompactTree) -> list[_Encoded]:
            return await self._encode(stream, start[0], start[1], segments, tree)

        old = self._ahead.pop(stream, None)
        if old is not None:
            old.close()
        self._ahead[stream] = ReadAhead(read=read, cut=functools.partial(seal_cuts, policy=self.policy),
                                        encode=encode, follow=_start_after, grow=self._grown,
                                        after=after, limits=limits, start=start, tree=tree)

    def _drop_read_ahead(self, stream: Stream | None = None) -> None:
        for key in [stream] if stream is not None else list(self._ahead):
            ahead = self._ahead.pop(key, None)
            if ahead is not None:
                ahead.close()

    async def _read_first(self, session: LockSession) -> None:
        """Start reading ahead the public batches after the last segment (used if the first seal wants
        them): when that segment is written (a sealed one is finished first, from the database)."""
        previous = await _last_segment(session.conn, Stream.PUBLIC)
        if previous is not None and previous.hash is None:
            return
        after, start, tree = _chain_start(previous)
        self._start_read_ahead(Stream.PUBLIC, after, self._batch_limits(Stream.PUBLIC), start, tree)

    async def _round(self, session: LockSession, stream: Stream) -> bool:
        """Move ``stream`` one batch on; True when there may be more to do at once.

        Rounds overlap: the batch written by the previous round is read back, checked
        and synced (:meth:`_check_stored`, store work only, no statement) while this round seals and
        puts the next one; then this round records the previous one verified and publishes it, and
        leaves its own batch being checked. The database always says where a batch is (sealed,
        written, verified, published), so a round that fails, or an instance that stops, drops the
        check in flight and the next round verifies those ``written`` segments from the database.
        """
        conn = session.conn
        if stream is Stream.PRIVATE:
            await self._capture(conn)
        previous = self._checking.pop(stream, None)
        batch: list[_Encoded] = []
        try:
            if previous is None:
                unfinished = [_row(r) for r in await conn.fetch(
                    f"select {_SEGMENT_COLUMNS} from archive_segments where stream = $1 and state <> 'published' "
                    "order by segment_index", int(stream))]
                if unfinished:
                    await self._finish(conn, stream, unfinished)
                    return True
            batch = await self._seal(conn, stream)
            if batch:
                await self._write(conn, batch)
        except BaseException:
            if previous is not None:
                previous.close()
            raise
        if previous is not None:
            await self._record_checked(conn, stream, previous, more=bool(batch))
        if batch:
            rows = [e.written for e in batch]
            self._checking[stream] = _Checking(rows, asyncio.ensure_future(
                self._check_stored(rows, {e.sealed.index: e.data for e in batch})))
        return bool(batch) or previous is not None

    async def _finish(self, conn: Any, stream: Stream, unfinished: list[_Row]) -> None:
        """Carry a batch that an earlier round (this instance's, or a predecessor's) left half done on
        from the recorded states, up to published. Sealed ranges are encoded again from the database:
        the range and the link are recorded, so the bytes are the same."""
        sealed = [r for r in unfinished if r.state == "sealed"]
        written = [r for r in unfinished if r.state == "written"]
        encoded: list[_Encoded] = []
        if sealed:
            encoded = await self._reencode(conn, sealed)
            await self._write(conn, encoded)
            written += [e.written for e in encoded]
        if written:
            await self._verify(conn, written, {e.sealed.index: e.data for e in encoded})
        await self._publish(conn, stream)

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

    async def _seal(self, conn: Any, stream: Stream) -> list[_Encoded]:
        """Seal the segments the rules allow after the last one, at most one batch; their bytes.

        One query reads the batch's rows, which are cut into segments and encoded in the same pass;
        the decisions (index, range, count, tree size, previous hash) are recorded in one statement
        before anything is put to the store. Encoding before recording changes nothing a restart
        could see: the bytes are a function of the recorded decision, and :meth:`_reencode` makes
        them again from it.
        """
        after, start, tree = _chain_start(await _last_segment(conn, stream))
        ahead = self._ahead.get(stream)
        ready = await ahead.take(after, start) if ahead is not None else None
        if ready is None:
            self._drop_read_ahead(stream)
            limits = self._batch_limits(stream)
            sequences, bodies = await _read_batch(conn, stream, after, *limits)
            cuts, tail = seal_cuts(list(map(len, bodies)), self.policy)
            rows, batch = Rows(after, limits, sequences, bodies, cuts, tail), None
        else:
            rows, batch = ready.rows, ready.encoded
            if ahead is not None and ahead.ended:
                self._drop_read_ahead(stream)
        if not rows.sequences:
            return []
        self._batch_now[stream] = rows.limits[0] // self.policy.events
        cuts = list(rows.cuts)
        # A full batch may be followed by more rows: its open tail could still fill up, so it is
        # left for later; else the tail is sealed once its first event is old enough.
        if rows.tail < len(rows.sequences) and not rows.full:
            age = await conn.fetchval(_PUBLIC_AGE if stream is Stream.PUBLIC else _PRIVATE_AGE,
                                      rows.sequences[rows.tail - 1] if rows.tail else after)
            if age is not None and age >= self.policy.seconds:
                cuts.append((rows.tail, len(rows.sequences), "age"))
                batch = None  # encoded ahead by the size rules alone
        if not cuts:
            self._drop_read_ahead(stream)
            return []
        if batch is None:
            batch = await self._encode(stream, start[0], start[1], [
                (rows.sequences[lo:hi], rows.bodies[lo:hi]) for lo, hi, _ in cuts], tree)
        if rows.continues and stream not in self._ahead:
            # Behind: read and encode the next (larger) batches while this one is put, read back and published.
            self._start_read_ahead(stream, rows.next_after, self._grown(rows.limits), *_start_after(batch[-1]))
        rows_ = [e.sealed for e in batch]
        await conn.execute(
            "insert into archive_segments (stream, format_version, segment_index, first_sequence, last_sequence, "
            "event_count, tree_size, previous_hash) select $1::smallint, $8::smallint, * from unnest($2::bigint[], "
            "$3::bigint[], $4::bigint[], $5::integer[], $6::bigint[], $7::bytea[])",
            int(stream), [r.index for r in rows_], [r.first for r in rows_], [r.last for r in rows_],
            [r.count for r in rows_], [r.tree_size for r in rows_], [r.previous_hash for r in rows_],
            FORMAT_VERSION)
        self.log.info("archiver.sealed", stream=stream.name.lower(), index=rows_[0].index, segments=len(rows_),
                      first=rows_[0].first, last=rows_[-1].last, events=sum(r.count for r in rows_),
                      rules=sorted({rule for _, _, rule in cuts}))
        return batch

    async def _next_deadline(self, session: LockSession) -> float:
        """Seconds until the oldest unarchived event of either stream turns ``policy.seconds`` old."""
        wait = self.sweep_interval
        for stream, query in ((Stream.PUBLIC, _PUBLIC_AGE), (Stream.PRIVATE, _PRIVATE_AGE)):
            after = await session.conn.fetchval(
                "select coalesce(max(last_sequence), 0) from archive_segments where stream = $1", int(stream))
            age = await session.conn.fetchval(query, after)
            if age is not None:
                wait = min(wait, max(0.0, self.policy.seconds - age) + 0.01)
        return wait

    # --- encode, write, verify ---------------------------------------------------------------

    async def _encode(self, stream: Stream, index: int, previous_hash: bytes,
                      segments: list[tuple[list[int], list[bytes]]], tree: CompactTree) -> list[_Encoded]:
        """Consecutive segments' bytes from their (sequences, bodies), as sealed rows; ``tree`` is
        extended with their leaves.

        All of it runs in a thread: SHA-256 over whole segments releases the GIL, and the rest
        fills the event loop's waits (the next batch's rows arriving, store calls completing).
        """
        return await asyncio.to_thread(self._encode_now, stream, index, previous_hash, segments, tree)

    def _encode_now(self, stream: Stream, index: int, previous_hash: bytes,
                    segments: list[tuple[list[int], list[bytes]]], tree: CompactTree) -> list[_Encoded]:
        out: list[_Encoded] = []
        for i, ((sequences, _bodies), (data, nodes)) in enumerate(
                zip(segments, encode_chain(stream, self._lineage, index, previous_hash, segments))):
            tree.extend(nodes)  # reusing the subtree's nodes where the tree so far is aligned
            assert tree.frontier is not None
            out.append(_Encoded(_Row(stream, index + i, sequences[0], sequences[-1], len(sequences), tree.size,
                                     previous_hash, "sealed", None, None, None), data, b"".join(tree.frontier)))
            previous_hash = data[-HASH_SIZE:]
        return out

    async def _reencode(self, conn: Any, rows: list[_Row]) -> list[_Encoded]:
        """The bytes of consecutive recorded segments, encoded again from the history (one query)."""
        first = rows[0]
        if first.index == 0:
            tree = CompactTree()
        else:
            prior = await conn.fetchrow(f"select {_SEGMENT_COLUMNS} from archive_segments "
                                        "where stream = $1 and segment_index = $2", int(first.stream), first.index - 1)
            tree = _row(prior).tree()
        sequences, bodies = await _read_range(conn, first.stream, first.first, rows[-1].last)
        segments: list[tuple[list[int], list[bytes]]] = []
        position = 0
        for row in rows:
            start = position
            while position < len(sequences) and sequences[position] <= row.last:
                position += 1
            count = position - start
            if count != row.count or (count and sequences[start] < row.first):
                raise ArchiverError(f"{row.stream.name.lower()} segment {row.index} was sealed with {row.count} "
                                    f"events in {row.first}..{row.last}, the history now holds {count} there "
                                    "(or before it)")
            segments.append((sequences[start:position], bodies[start:position]))
        out = await self._encode(first.stream, first.index, first.previous_hash, segments, tree)
        for row, again in zip(rows, out):
            if (again.sealed.previous_hash, again.sealed.tree_size) != (row.previous_hash, row.tree_size):
                raise ArchiverError(f"{row.stream.name.lower()} segment {row.index} was sealed linking to "
                                    f"{row.previous_hash.hex()} at tree size {row.tree_size}; encoded again it "
                                    f"links to {again.sealed.previous_hash.hex()} at {again.sealed.tree_size}")
        return [dataclasses.replace(e, sealed=row) for row, e in zip(rows, out)]

    def _key(self, row: _Row) -> str:
        return segment_key(self._lineage, row.index, row.first, row.last, row.stream)

    async def _write(self, conn: Any, batch: list[_Encoded]) -> None:
        """Put a batch's segments (create-only, a few at a time), then record them written at once."""
        outcomes = await _store_all([functools.partial(self.store.put, self._key(e.sealed), e.data) for e in batch])
        for outcome in outcomes:
            self.puts[outcome.name.lower()] = self.puts.get(outcome.name.lower(), 0) + 1
        stream = batch[0].sealed.stream
        # One statement, so one round trip and atomic (each state change below is written this way).
        await conn.execute(
            "with segments as (update archive_segments as s set state = 'written', size = u.size, hash = u.hash, "
            "merkle_root = u.root, frontier = u.frontier, written_at = now() "
            "from unnest($2::bigint[], $3::integer[], $4::bytea[], $5::bytea[], $6::bytea[]) "
            "as u(segment_index, size, hash, root, frontier) "
            "where s.stream = $1 and s.segment_index = u.segment_index and s.state = 'sealed') "
            "update archive_watermarks set archived_through = greatest(archived_through, $7), "
            "updated_at = now() where stream = $1",
            int(stream), [e.sealed.index for e in batch], [len(e.data) for e in batch],
            [e.data[-HASH_SIZE:] for e in batch], [e.root for e in batch], [e.frontier for e in batch],
            batch[-1].sealed.last)
        self.log.info("archiver.written", stream=stream.name.lower(), index=batch[0].sealed.index,
                      segments=len(batch), size=sum(len(e.data) for e in batch),
                      outcomes=sorted({o.name.lower() for o in outcomes}))
        self._progressed()

    async def _read_back(self, row: _Row) -> bytes | None:
        """The stored bytes of ``row``'s segment, or None when the object is gone."""
        try:
            return await self.store.get(self._key(row))
        except ObjectNotFound:
            return None

    async def _verify(self, conn: Any, rows: list[_Row], written: dict[int, bytes]) -> None:
        """Read written segments back, check them, make them durable, and only then record them
        verified (at once): :meth:`_check_stored`, then :meth:`_verified`.

        ``written``: by segment index, the bytes this process encoded and put in this run (the
        others, written by an earlier run, are walked frame by frame: see :meth:`_check_now`).
        """
        await self._verified(conn, rows, await self._check_stored(rows, written))

    async def _check_stored(self, rows: list[_Row], written: dict[int, bytes]) -> _Stored:
        """The store's half of verifying ``rows``: read each back and check it (in a worker thread,
        like encoding: SHA-256 over whole segments releases the GIL), and make them durable. No
        statement: this runs beside the next batch's, on the lock session.

        The store's sync (on a directory, an fsync of each file and its directory) runs while they
        are read back and checked. Measured on a 120,000-event catch-up (median of 5 rounds each,
        before the rounds overlapped): 0.48x raw without any sync, 0.39x syncing before recording
        them written, 0.42x this way.
        """
        keys = [self._key(row) for row in rows]
        durable = asyncio.ensure_future(self.store.sync(keys))
        try:
            found = await _store_all([functools.partial(self._read_back, row) for row in rows])
            present = [(row, data) for row, data in zip(rows, found) if data is not None]
            await asyncio.to_thread(self._check_now, [r for r, _ in present], [d for _, d in present], written)
        except BaseException:
            _drop(durable)
            raise
        try:
            await durable
            synced = True
        except ObjectNotFound:  # one is gone: it is written again, then all are synced
            synced = False
        return _Stored([row for row, data in zip(rows, found) if data is None], synced)

    async def _verified(self, conn: Any, rows: list[_Row], stored: _Stored) -> None:
        """Record ``rows`` verified once :meth:`_check_stored` found them all: a segment found gone is
        first written again (from the history), read back and checked, then all are synced again."""
        for row in stored.missing:
            # Written once, gone now (an operator's mistake, a store that lost it): write it again.
            key = self._key(row)
            self.log.error("archiver.segment_missing", key=key, detail="writing it again")
            (encoded,) = await self._reencode(conn, [row])
            await self.store.put(key, encoded.data)
            await asyncio.to_thread(self._check_now, [row], [await self.store.get(key)], {row.index: encoded.data})
        if stored.missing or not stored.synced:
            await self.store.sync([self._key(row) for row in rows])
        stream, through = rows[0].stream, max(r.last for r in rows)
        await conn.execute("with segments as (update archive_segments set state = 'verified', verified_at = now() "
                           "where stream = $1 and segment_index = any($2::bigint[]) and state = 'written') "
                           "update archive_watermarks set verified_through = greatest(verified_through, $3), "
                           "updated_at = now() where stream = $1", int(stream), [r.index for r in rows], through)
        self.verified_through[stream] = max(through, self.verified_through.get(stream, 0))
        self.log.info("archiver.verified", stream=stream.name.lower(), index=rows[0].index, segments=len(rows))
        self._progressed()

    def _check_now(self, rows: list[_Row], datas: list[bytes], written: dict[int, bytes]) -> None:
        """Check every segment read back against its row; ArchiverError naming the first that fails.

        A segment this process encoded and put in this run is compared with the bytes it put, kept
        in memory until now, and re-hashed: identical bytes are the encoder's output for the recorded
        decision, so walking their frames again would only test the encoder against itself (about a
        third of the archiver's time, measured). A segment written by an earlier run (found
        ``written`` after a restart or a take-over) has no such bytes here: its frames and CRC32Cs
        are walked (:func:`protocol.archive.check_read_back`).
        """
        for row, data in zip(rows, datas):
            try:
                assert row.hash is not None
                checked = check_read_back(data, expected_hash=row.hash, expected_previous_hash=row.previous_hash,
                                          expected_lineage=self._lineage, expected_index=row.index,
                                          expected_stream=row.stream, written=written.get(row.index))
            except ArchiveFormatError as e:
                raise ArchiverError(f"segment {self._key(row)} read back from the store fails its check: "
                                    f"{e.kind}: {e}") from e
            if checked.size != row.size:
                raise ArchiverError(f"segment {self._key(row)} read back from the store is not the one written")

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
            pages = await self._manifest_pages(conn, last.index)
            start = pages[-1].last_index + 1 if pages else 0
            tail = await self._listed(conn, start, last.index)
            validate_run(tail, start, pages[-1].last_sequence if pages else -1)
            await self.store.replace(manifest_key(self._lineage),
                                     encode_paged(self._lineage, self.parent_lineage, pages, tail))
        await self.store.sync([key, manifest_key(self._lineage)] if stream is Stream.PUBLIC else [key])
        await conn.execute(
            "with checkpoint as (insert into archive_checkpoints (stream, tree_size, root, note) "
            "values ($1, $2, $3, $4) on conflict do nothing), "
            "segments as (update archive_segments set state = 'published', published_at = now() "
            "where stream = $1 and state = 'verified' and segment_index <= $5) "
            "update archive_watermarks set published_through = greatest(published_through, $6), "
            "updated_at = now() where stream = $1",
            int(stream), last.tree_size, checkpoint.root, note, last.index, last.last)
        self.published_size[stream] = last.tree_size
        self._published_at[stream] = asyncio.get_running_loop().time()
        self.log.info("archiver.published", stream=stream.name.lower(), tree_size=last.tree_size)
        self._progressed()

    @staticmethod
    async def _listed(conn: Any, first: int, last: int) -> tuple[ManifestSegment, ...]:
        """The manifest entries of verified or published public segments ``first`` to ``last``."""
        rows = await conn.fetch(
            "select segment_index, first_sequence, last_sequence, event_count, size, hash from archive_segments "
            "where stream = 0 and state in ('verified', 'published') and segment_index between $1 and $2 "
            "order by segment_index", first, last)
        return tuple(ManifestSegment(r["segment_index"], r["first_sequence"], r["last_sequence"], r["event_count"],
                                     r["size"], bytes(r["hash"]).hex()) for r in rows)

    async def _manifest_pages(self, conn: Any, last_index: int) -> list[ManifestPage]:
        """The manifest's pages up to segment ``last_index``: every full run of
        :attr:`manifest_page` segments, each written (create-only) and synced before a manifest
        names it. Kept in memory per activation: the first publish after taking the lock builds
        them from the database (the objects already there compare identical), later ones add a page
        only when one fills, so a publish costs the same however long the history is."""
        size = self.manifest_page
        written: list[str] = []
        while (len(self._pages) + 1) * size - 1 <= last_index:
            first = len(self._pages) * size
            segments = await self._listed(conn, first, first + size - 1)
            previous = self._pages[-1].last_sequence if self._pages else -1
            validate_run(segments, first, previous)
            if len(segments) != size:
                raise ArchiverError(f"manifest page {first}-{first + size - 1}: {len(segments)} segments verified")
            page, data = encode_page(self._lineage, segments)
            outcome = await self.store.put(page.key(self._lineage), data)  # different: ForkAlarm
            self.puts[outcome.name.lower()] = self.puts.get(outcome.name.lower(), 0) + 1
            written.append(page.key(self._lineage))
            self._pages.append(page)
        if written:
            await self.store.sync(written)
        return list(self._pages)

    async def _record_store_state(self, session: LockSession, error: str | None) -> None:
        """Record in archiver_store_state whether the store answers (``error`` None) or why not,
        when that differs from what this activation recorded last (one statement per change, none
        per round)."""
        if error == self._recorded_store_error:
            return
        await session.conn.execute(
            "update archiver_store_state set error = $1, node_id = $2, updated_at = now(), "
            "failing_since = case when $1::text is null then null else coalesce(failing_since, now()) end",
            error, self.node_id)
        self._recorded_store_error = error

    async def _measure(self, session: LockSession) -> None:
        verified = int(await session.conn.fetchval(
            "select verified_through from archive_watermarks where stream = 0"))
        self.verified_through[Stream.PUBLIC] = verified
        behind = int(await session.conn.fetchval("select coalesce(max(sequence), 0) from changes")) - verified
        if 0 < behind <= EXACT_LAG:
            behind = int(await session.conn.fetchval(
                "select count(*) from changes where sequence > $1", verified))
        self.lag_events = max(0, behind)

    async def _pause(self, seconds: float, *events: asyncio.Event) -> None:
        await pause(seconds, self._stop_requested, *events)


#: The public key this corpus's archive is signed with, as its database records it (migration 0014).
_RECORDED_KEY = "select public_key from archive_signing_key"
#: What leaves the start-up check of the signing key undecided (it is made again at activation).
_KEY_UNCHECKED: tuple[type[BaseException], ...] = (ArchiveStoreError, TimeoutError, *DB_UNAVAILABLE)


def _shown(key: str) -> str:
    """A public key as a message may show it (anything else is not one)."""
    return key if len(key) <= 200 and key.isprintable() else "(not a public key)"


class ArchiverCollector(SingleActiveCollector[Archiver]):
    """Prometheus gauges of the archiver running in this process (read at scrape time)."""

    kind = Archiver

    @staticmethod
    def families() -> tuple[Family, ...]:
        return (GaugeMetricFamily("toastmachine_archiver_active",
                                  "1 while this process's archiver holds the lock and archives."),
                GaugeMetricFamily("toastmachine_archive_store_up",
                                  "1 while the active archiver's object store answers, 0 while it fails (retried with a back-off)."),
                GaugeMetricFamily("toastmachine_archive_verified_through",
                                  "Highest change sequence in a verified archive segment."),
                GaugeMetricFamily("toastmachine_archive_lag_events",
                                  "Committed changes not yet in a verified archive segment (counted exactly up to 10000; above, the "
                                  "sequence difference)."))

    def fill(self, actor: Archiver, families: tuple[Family, ...]) -> None:
        active, store_up, verified, lag = families
        active.add_metric([], 1.0 if actor.active else 0.0)
        if actor.active:
            store_up.add_metric([], 0.0 if actor.store_error is not None else 1.0)
        if Stream.PUBLIC in actor.verified_through:
            verified.add_metric([], float(actor.verified_through[Stream.PUBLIC]))
        if actor.lag_events is not None:
            lag.add_metric([], float(actor.lag_events))


def export_metrics(registry: CollectorRegistry, current: Callable[[], Actor | None]) -> None:
    """Add the archiver gauges to ``registry`` once (later calls are no-ops)."""
    register_once(registry, ArchiverCollector(current))
