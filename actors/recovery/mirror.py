"""``toastmachine mirror``: a read-only copy of a node's public history, proven by its archive, followed live.

A :class:`Mirror` fills a database of its own (empty at first, or a mirror of the same lineage to
resume) in rounds:

- **Archive round**: read ``manifest.json`` and the signed checkpoint of its tree size (the
  signature checked against the **pinned** public key, never the archive's own), then every segment
  after the last one this mirror verified: each decoded completely, linked to the previous segment's
  hash, equal to its manifest entry, its events appended to the Merkle tree kept as its frontier in
  ``corpus_mirror``. The round commits only if the extended tree's size and root equal the new
  checkpoint's, which is exactly "the new checkpoint extends the one trusted before" (the mirror
  holds the older tree's frontier, so it recomputes the extension instead of trusting a proof).
  Events are written as the corpus writer would have (:class:`~actors.recovery.load.HistoryLoader`),
  with their original sequences and lineage; events the tail already applied are compared instead,
  byte for byte in canonical form, and a difference stops the mirror (:class:`MirrorFork`).
- **Tail round** (with a node URL): the changes not archived yet, from ``changes.jsonl?after=`` with
  the lineage pinned, page by page; applied at once and counted as *unverified* until an archive
  round covers them.

A mirror has no agent register (the private stream is never public): each author becomes an agent
row whose credential hash matches no credential, so nobody can write on a mirror.

Sources: any :class:`~actors.recovery.walk.ArchiveSource`: an object store (the node's bucket, or
a copy) or the node's public archive routes (:class:`NodeArchiveSource`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from actors.reads.archive import MANIFEST_PATH
from actors.recovery.load import HistoryLoader, LoadProgress, as_mirror, decode_events
from actors.recovery.walk import PageCache, read_manifest
from infra.archive_store import ArchiveStoreError, ObjectNotFound
from infra.db import Database, connection
from infra.http_client import read_capped
from infra.logs import get_logger
from infra.outages import DB_UNAVAILABLE_ERRORS
from infra.redact import redact_url
from infra.runtime import Actor
from protocol.archive import (
    GENESIS_HASH,
    MANIFEST_PAGES_DIR,
    MAX_SEGMENT_BYTES,
    ArchiveFormatError,
    Stream,
    checkpoint_key,
    decode_segment,
    event_body,
    manifest_key,
    parse_segment_key,
    segment_key,
    segment_name,
)
from protocol.checkpoint import MAX_NOTE_BYTES, CheckpointError, VerifierKey, verify_checkpoint
from protocol.errors import ProcessFatal, ToastMachineError
from protocol.manifest import (
    MAX_MANIFEST_BYTES,
    ManifestError,
    ManifestSegment,
    encode_manifest,
)
from protocol.manifest import Manifest as ManifestValue
from protocol.merkle import CompactTree

log = get_logger("toastmachine.actors.recovery.mirror")

_ORIGIN_PREFIX = "toastmachine.archive/"
#: Changes fetched per tail request, and pages per tail round (then the archive gets a turn).
TAIL_PAGE = 1000
TAIL_PAGES_PER_ROUND = 10
#: Bytes a tail page may hold. A larger one is not read on: the page is asked again with half the
#: changes (down to one, which is always under this), and the size grows back page by page.
TAIL_PAGE_BYTES = 64 << 20
#: Seconds an HTTP request to the node may take.
HTTP_TIMEOUT = 30.0


class MirrorError(ToastMachineError):
    """The mirror cannot go on: refused database, unreachable or invalid source."""


class MirrorFork(MirrorError, ProcessFatal):
    """What the source serves contradicts what this mirror verified: a rewritten or forked history.
    Fatal to ``mirror --serve``: its process stops rather than go on serving a copy that differs
    from the archive (changes applied from the live tail before the archive covered them included)."""


@dataclass(slots=True)
class MirrorState:
    """One ``corpus_mirror`` row."""

    tree: CompactTree
    segment_index: int
    segment_hash: bytes
    verified_through: int
    checkpoint_size: int
    checkpoint_root: bytes | None
    applied_through: int

    def to_json(self) -> dict[str, Any]:
        return {"tree_size": self.tree.size, "root": self.tree.root().hex(), "segments": self.segment_index + 1,
                "verified_through": self.verified_through, "applied_through": self.applied_through,
                "checkpoint_size": self.checkpoint_size}


_PAGE_NAME = re.compile(r"\d{10}-\d{10}")


class NodeArchiveSource:
    """A node's public archive routes as an :class:`~actors.recovery.walk.ArchiveSource`.

    ``GET /corpus/archive`` gives the public key; the manifest, the segments and the checkpoints
    have routes of their own, serving the store's objects, so the checks are the same as on the
    store itself.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base = base_url.rstrip("/")
        self.description = f"node {redact_url(self.base)}"  # shown by GET /corpus: no password
        self._index: dict[str, Any] | None = None

    async def _fetch(self, path: str, max_bytes: int) -> bytes:
        try:
            async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT)) as resp:
                if resp.status == 404:
                    raise ObjectNotFound(f"{self.description}: {path} not found")
                if resp.status != 200:
                    raise ArchiveStoreError(f"{self.description}: GET {path} answered {resp.status}")
                data = await read_capped(resp, max_bytes)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ArchiveStoreError(f"{self.description}: GET {path} failed: {http_failure(e)}") from None
        if data is None:
            raise ArchiveStoreError(f"{self.description}: {path} is larger than {max_bytes} bytes")
        return data

    async def lineage(self) -> uuid.UUID:
        """The lineage the node serves (``GET /corpus``)."""
        body = orjson.loads(await self._fetch("/corpus", 1 << 20))
        return uuid.UUID(body["lineage"])

    async def index(self, *, fresh: bool = False) -> dict[str, Any]:
        """``GET /corpus/archive`` (cached until ``fresh``)."""
        if self._index is None or fresh:
            self._index = orjson.loads(await self._fetch("/corpus/archive", MAX_MANIFEST_BYTES))
        return self._index

    async def get(self, key: str, *, max_bytes: int) -> bytes:
        lineage, _, rest = key.partition("/")
        if rest == "manifest.json":
            return await self._manifest(uuid.UUID(lineage))
        if rest == "public-key.txt":
            public = (await self.index())["public_key"]
            if not public:
                raise ObjectNotFound(f"{self.description} has published no public key yet")
            return str(public).encode()
        parsed = parse_segment_key(key)
        if parsed is not None and parsed.stream is Stream.PUBLIC:
            name = segment_name(parsed.index, parsed.first_sequence, parsed.last_sequence)
            return await self._fetch(f"/corpus/archive/segments/{name}", max_bytes)
        page = rest.removeprefix(MANIFEST_PAGES_DIR + "/")
        if page != rest and _PAGE_NAME.fullmatch(page):
            return await self._fetch(f"/corpus/archive/{MANIFEST_PAGES_DIR}/{page}", max_bytes)
        if rest.startswith("checkpoints/") and rest[len("checkpoints/"):].isdigit():
            return await self._fetch(f"/corpus/archive/checkpoints/{int(rest[len('checkpoints/'):])}", max_bytes)
        raise ObjectNotFound(f"{self.description} serves no {key}")

    async def _manifest(self, lineage: uuid.UUID) -> bytes:
        """``GET /corpus/archive/manifest.json``; from a node that predates that route, the manifest
        rebuilt from ``GET /corpus/archive``'s published segments.

        Such a node lists its most recent segments only; when it holds more than it lists, the
        manifest cannot be rebuilt from it, and the archive must be read from the store (``--archive``).
        """
        index = await self.index(fresh=True)
        if MANIFEST_PATH in index.get("links", {}).values():
            return await self._fetch(MANIFEST_PATH, MAX_MANIFEST_BYTES)
        listed = index["segments"]
        if index["segment_count"] > len(listed):
            raise ArchiveStoreError(f"{self.description} lists {len(listed)} of its {index['segment_count']} "
                                    "segments; read the archive from its store instead (--archive URL)")
        segments = []
        for s in listed:
            if s["state"] != "published":
                break  # published segments are a prefix; the checkpoint covers exactly them
            segments.append(ManifestSegment(s["index"], s["first_sequence"], s["last_sequence"], s["event_count"],
                                            s["size"], s["hash"]))
        try:
            return encode_manifest(ManifestValue(lineage, None, tuple(segments)))
        except ManifestError as e:
            raise ArchiveStoreError(f"{self.description}: the archive listing is not a manifest: {e}") from None

    async def keys(self, prefix: str) -> list[str] | None:
        return None  # a node does not list its bucket


def _origin_corpus(origin: str) -> uuid.UUID:
    if not origin.startswith(_ORIGIN_PREFIX):
        raise MirrorError(f"the checkpoint origin {origin!r} is not a ToastMachine corpus")
    try:
        return uuid.UUID(origin.removeprefix(_ORIGIN_PREFIX))
    except ValueError:
        raise MirrorError(f"the checkpoint origin {origin!r} names no corpus") from None


class Mirror:
    """A mirror of one lineage (see the module docstring).

    Args:
        source: where the archive is read.
        lineage: the history mirrored.
        db: the mirror's own database (empty, or a mirror of ``lineage`` made with the same key).
        trusted: the pinned verifier key of the node's checkpoints.
        node_url: the node whose ``changes.jsonl`` gives the tail (None: the archive alone).
        session: the HTTP session for the tail (required with ``node_url``).
    """

    def __init__(self, source: Any, lineage: uuid.UUID, db: Database, *, trusted: VerifierKey,
                 node_url: str | None = None, session: aiohttp.ClientSession | None = None,
                 progress: Callable[[LoadProgress], None] | None = None) -> None:
        """``progress``: told after each segment an archive round goes through (a first build of a
        long archive is one round, one transaction, and takes a while)."""
        if node_url is not None and session is None:
            raise ValueError("a node URL needs an HTTP session")
        self.source = source
        self.lineage = lineage
        self.db = db
        self.trusted = trusted
        self.node_url = node_url.rstrip("/") if node_url else None
        self.session = session
        self.progress = progress
        self.state: MirrorState | None = None
        self._tail_limit = TAIL_PAGE  # changes asked per tail page (halved after a page too large)
        #: Manifest pages already checked (write-once: each is fetched once per run, not every round).
        self._pages: PageCache = {}

    # --- state -----------------------------------------------------------------------------------

    async def _load_state(self, conn: Any) -> MirrorState | None:
        row = await conn.fetchrow("select * from corpus_mirror")
        if row is None:
            return None
        frontier = bytes(row["frontier"])
        return MirrorState(CompactTree.from_state(row["tree_size"], [frontier[i:i + 32]
                                                                      for i in range(0, len(frontier), 32)]),
                           row["segment_index"], bytes(row["segment_hash"] or GENESIS_HASH), row["verified_through"],
                           row["checkpoint_size"], None if row["checkpoint_root"] is None else bytes(row["checkpoint_root"]),
                           row["applied_through"])

    async def _save_state(self, conn: Any, state: MirrorState) -> None:
        assert state.tree.frontier is not None
        await conn.execute(
            "update corpus_mirror set tree_size = $1, frontier = $2, segment_index = $3, segment_hash = $4, "
            "verified_through = $5, checkpoint_size = $6, checkpoint_root = $7, applied_through = $8, "
            "updated_at = now()", state.tree.size, b"".join(state.tree.frontier), state.segment_index,
            state.segment_hash, state.verified_through, state.checkpoint_size, state.checkpoint_root,
            state.applied_through)

    async def _begin(self, conn: Any, corpus_id: uuid.UUID) -> MirrorState:
        """This database as a mirror of the lineage: made so if empty, else checked to be one."""
        witness = await conn.fetchrow("select corpus_id, lineage from corpus_witness")
        if witness is None:
            if await conn.fetchval("select exists (select 1 from agents) or exists (select 1 from changes)"):
                raise MirrorError("the mirror's database holds data but no corpus witness; use an empty database")
            await conn.execute("insert into corpus_witness (corpus_id, lineage) values ($1, $2)", corpus_id,
                               self.lineage)
            await conn.execute("insert into corpus_mirror (source, public_key) values ($1, $2)",
                               self.source.description, self.trusted.text())
        elif witness["lineage"] != self.lineage or witness["corpus_id"] != corpus_id:
            raise MirrorError(f"the mirror's database holds lineage {witness['lineage']}, not {self.lineage}")
        mirror_key = await conn.fetchval("select public_key from corpus_mirror")
        if mirror_key is None:
            raise MirrorError("the database is a corpus of its own, not a mirror: use an empty database")
        if mirror_key != self.trusted.text():
            raise MirrorError("the mirror was built with another public key; refusing to mix trust roots")
        state = await self._load_state(conn)
        assert state is not None
        return state

    # --- archive round ---------------------------------------------------------------------------

    async def _get(self, key: str, max_bytes: int) -> bytes:
        try:
            return await self.source.get(key, max_bytes=max_bytes)
        except ObjectNotFound:
            raise MirrorError(f"{self.source.description} has no {key}") from None

    async def archive_round(self) -> bool:
        """Verify and apply the segments published since the last round; True when some were."""
        try:
            manifest, _ = await read_manifest(self.source, await self._get(manifest_key(self.lineage),
                                                                           MAX_MANIFEST_BYTES), self._pages)
        except ObjectNotFound as e:
            raise MirrorError(f"{self.source.description} has no {e}, which its manifest names") from None
        if manifest.lineage != self.lineage:
            raise MirrorError(f"the manifest is of lineage {manifest.lineage}")
        if not manifest.segments:
            return False
        note = await self._get(checkpoint_key(self.lineage, manifest.tree_size), MAX_NOTE_BYTES)
        try:
            checkpoint = verify_checkpoint(note, self.trusted)
        except CheckpointError as e:
            raise MirrorError(f"the checkpoint of size {manifest.tree_size} is refused: {e.kind}: {e}") from None
        corpus_id = _origin_corpus(checkpoint.origin)
        async with connection(self.db) as conn, conn.transaction():
            await as_mirror(conn)
            state = await self._begin(conn, corpus_id)
            if checkpoint.size < state.tree.size:
                raise MirrorFork(f"the archive shrank from {state.tree.size} to {checkpoint.size} events")
            if state.segment_index >= 0:
                known = manifest.segments[state.segment_index] if state.segment_index < len(manifest.segments) else None
                if known is None or bytes.fromhex(known.hash) != state.segment_hash:
                    raise MirrorFork(f"segment {state.segment_index} is no longer the one this mirror verified")
            if checkpoint.size == state.tree.size:
                if state.checkpoint_root is not None and checkpoint.root != state.checkpoint_root:
                    raise MirrorFork("a checkpoint of the same size with another root: the history forked")
                self.state = state  # nothing new: the committed state as it stands
                return False
            loader = HistoryLoader(conn, str(corpus_id), str(self.lineage))
            tree = state.tree.copy()
            previous = state.segment_hash
            started = time.monotonic()
            for entry in manifest.segments[state.segment_index + 1:]:
                key = segment_key(self.lineage, entry.index, entry.first_sequence, entry.last_sequence)
                try:
                    segment = decode_segment(await self._get(key, MAX_SEGMENT_BYTES), expected_previous_hash=previous,
                                             expected_lineage=self.lineage, expected_index=entry.index,
                                             expected_stream=Stream.PUBLIC)
                except ArchiveFormatError as e:
                    raise MirrorError(f"{key} is refused: {e.kind}: {e}") from None
                if ManifestSegment.of(segment) != entry:
                    raise MirrorError(f"{key} is not the segment the manifest lists")
                tree.extend(segment.tree or segment.leaf_hashes)
                await self._apply_archived(conn, loader, state.applied_through,
                                           [(e.sequence, e.body) for e in segment.events])
                previous = segment.hash
                state.segment_index, state.segment_hash = entry.index, segment.hash
                state.verified_through = segment.last_sequence
                if self.progress is not None:
                    self.progress(LoadProgress(tree.size, manifest.tree_size, segment.last_sequence,
                                               time.monotonic() - started, state.tree.size))
            if tree.size != checkpoint.size or tree.root() != checkpoint.root:
                # Nothing of this round is committed: the checkpoint does not vouch for these segments.
                raise MirrorFork(f"the checkpoint of size {checkpoint.size} does not extend the verified tree of "
                                 f"size {state.tree.size} with these segments")
            state.tree = tree
            state.checkpoint_size, state.checkpoint_root = checkpoint.size, checkpoint.root
            state.applied_through = max(state.applied_through, state.verified_through)
            await self._save_state(conn, state)
        self.state = state
        log.info("mirror.verified", tree_size=state.tree.size, through=state.verified_through)
        return True

    async def _apply_archived(self, conn: Any, loader: HistoryLoader, applied_through: int,
                              events: list[tuple[int, bytes]]) -> None:
        """Write the archived events not yet applied; compare those the tail applied already."""
        old = [(s, body) for s, body in events if s <= applied_through]
        if old:
            rows = await conn.fetch("select sequence, event from changes where sequence = any($1::bigint[])",
                                    [s for s, _ in old])
            stored = {r["sequence"]: r["event"] for r in rows}
            for sequence, body in old:
                # Compared as canonical JSON: the mirror stores what its loader wrote, which need not be
                # the node's bytes (segments of format 2 hold those verbatim, format 1 canonical).
                if sequence not in stored or event_body(orjson.loads(stored[sequence])) != event_body(orjson.loads(body)):
                    raise MirrorFork(f"change {sequence} as archived differs from the one the node served live")
        new = decode_events((s, body) for s, body in events if s > applied_through)
        if new:
            await loader.segment(new, with_authors=True)

    # --- tail round ------------------------------------------------------------------------------

    async def tail_round(self) -> bool:
        """Apply the node's changes after the last applied one (up to a few pages); True if any."""
        if self.node_url is None or self.session is None:
            return False
        progressed = False
        for _ in range(TAIL_PAGES_PER_ROUND):
            async with connection(self.db) as conn:
                state = await self._load_state(conn)
            if state is None:
                return progressed  # nothing verified yet: the archive goes first, it names the corpus
            url = f"{self.node_url}/corpus/changes.jsonl"
            params = {"after": str(state.applied_through), "limit": str(self._tail_limit),
                      "lineage": str(self.lineage)}
            try:
                async with self.session.get(url, params=params,
                                            timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT)) as resp:
                    if resp.status == 409:
                        raise MirrorFork("the node no longer serves this lineage (409 lineage_mismatch)")
                    if resp.status == 400 and await _refused_field(resp) == "after":
                        # Its head is behind what this mirror applied from it: the node's history went
                        # back (a database restored from an older backup under the same lineage).
                        raise MirrorFork(f"the node's head is behind this mirror's {state.applied_through}: "
                                         "its history went back")
                    if resp.status != 200:
                        raise MirrorError(f"the node answered {resp.status} to changes.jsonl")
                    more = resp.headers.get("X-Corpus-Has-More") == "true"
                    body = await read_capped(resp, TAIL_PAGE_BYTES)
            except (aiohttp.ClientError, TimeoutError) as e:
                raise MirrorError(f"the node is unreachable: {http_failure(e)}") from None
            if body is None:
                if self._tail_limit == 1:
                    raise MirrorError(f"the node's changes.jsonl answered more than {TAIL_PAGE_BYTES} bytes "
                                      "for one change")
                self._tail_limit = max(1, self._tail_limit // 2)
                continue
            self._tail_limit = min(TAIL_PAGE, self._tail_limit * 2)
            try:
                events = [(int(e["sequence"]), e) for e in map(orjson.loads, body.splitlines())]
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                raise MirrorError("the node's changes.jsonl holds a line that is not a change") from None
            if events:
                witness = await self.db.pool.fetchrow("select corpus_id from corpus_witness")
                async with connection(self.db) as conn, conn.transaction():
                    await as_mirror(conn)
                    fresh = await self._load_state(conn)
                    assert fresh is not None
                    events = [(s, e) for s, e in events if s > fresh.applied_through]
                    if events:
                        loader = HistoryLoader(conn, str(witness["corpus_id"]), str(self.lineage))
                        await loader.segment(events, with_authors=True)
                        fresh.applied_through = events[-1][0]
                        await self._save_state(conn, fresh)
                        progressed = True
                        self.state = fresh
            if not more:
                break
        return progressed

    async def run(self, stop: asyncio.Event, *, poll_interval: float = 1.0) -> None:
        """Rounds until ``stop`` is set: the archive first, then the tail, pausing when idle."""
        while not stop.is_set():
            try:
                progressed = await self.archive_round()
            except ArchiveStoreError:
                # The archive cannot be read now (the node's store away): the live tail still comes
                # from the node's database, so the copy stays fresh; the failure is reported and the
                # archive tried again after the caller's back-off.
                await self.tail_round()
                raise
            progressed |= await self.tail_round()
            if not progressed:
                try:
                    await asyncio.wait_for(stop.wait(), poll_interval)
                except TimeoutError:
                    pass

    def report(self) -> dict[str, Any]:
        """The mirror's state as JSON (after a round)."""
        if self.state is None:
            return {"lineage": str(self.lineage), "tree_size": 0}
        return {"lineage": str(self.lineage), "source": self.source.description, **self.state.to_json(),
                # As the checkpoint's third line has it, to compare by eye with the node's.
                "root_base64": base64.b64encode(self.state.tree.root()).decode()}


#: Seconds between a failed round's retries at most (``mirror --serve``).
ROUND_BACKOFF_MAX = 10.0
#: What makes a round fail for a while (the source, or the mirror's own database, away; a segment
#: refused): tried again, where a fork is not.
_ROUND_RETRIED: tuple[type[BaseException], ...] = (ArchiveStoreError, MirrorError, *DB_UNAVAILABLE_ERRORS)


class MirrorFollower(Actor):
    """``toastmachine mirror --serve``: the mirror's rounds as an actor, beside the web front that
    serves the copy (read-only: migration 0011) and the publisher that feeds its streams.

    Args:
        open_mirror: builds the :class:`Mirror` on an HTTP session this actor owns (the command's
            source, lineage and pinned key), once per start.
        poll_interval: seconds between rounds when nothing is new.

    A round that fails for a while (the node or store unreachable, a refused segment, the mirror's
    own database away) is logged in one line and tried again after a back-off (doubling from 1 s
    to :data:`ROUND_BACKOFF_MAX`): the mirror resumes from its committed state. A fork
    (:class:`MirrorFork`) is fatal: the process stops and exits 1 rather than serve a copy the
    archive contradicts.
    """

    name = "mirror"

    def __init__(self, open_mirror: Callable[[aiohttp.ClientSession], Awaitable[Mirror]], *,
                 poll_interval: float = 1.0) -> None:
        super().__init__()
        self.open_mirror = open_mirror
        self.poll_interval = poll_interval
        self.mirror: Mirror | None = None
        self._session: aiohttp.ClientSession | None = None

    async def setup(self) -> None:
        self._session = aiohttp.ClientSession()
        self.mirror = await self.open_mirror(self._session)

    async def run(self) -> None:
        assert self.mirror is not None
        backoff = 1.0
        while not self._stop_requested.is_set():
            try:
                await self.mirror.run(self._stop_requested, poll_interval=self.poll_interval)
            except MirrorFork:
                raise
            except _ROUND_RETRIED as e:
                log.warning("mirror.round_failed", error=str(e), retry_in=backoff)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop_requested.wait(), backoff)
                backoff = min(backoff * 2, ROUND_BACKOFF_MAX)
                continue
            backoff = 1.0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _refused_field(resp: aiohttp.ClientResponse) -> str | None:
    """The ``field`` a node's 400 error envelope names, if it is one (read within a small bound)."""
    body = await read_capped(resp, 64 * 1024)
    try:
        error = orjson.loads(body or b"")["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    field = error.get("field") if isinstance(error, dict) else None
    return field if isinstance(field, str) else None


def http_failure(e: BaseException) -> str:
    """Why an HTTP request to the source failed, in words (not the client library's class name)."""
    if isinstance(e, TimeoutError):
        return f"no answer within {HTTP_TIMEOUT:g} s"
    if isinstance(e, aiohttp.ClientConnectorError):
        return "cannot connect (nothing listens there, or the host is unknown)"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "the answer was cut off"
    return "the connection failed"
