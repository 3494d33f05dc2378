"""Following the corpus: how fast the history reaches a follower, against PostgreSQL's own COPY.

(b) ``--catchup`` (the default): seeds a fresh database with ``--changes`` changes (default 100,000:
one agent, a conversation per ``--per-conversation`` messages, every message with its ~600-byte
``changes.event`` envelope built by :mod:`protocol.representations`, inserted with COPY after the
migrations), then measures, in alternating rounds:

- ours: the whole history over HTTP from ``GET /corpus/changes.jsonl``, pages of ``--limit``
  (default 10,000) following ``X-Corpus-Next`` until ``X-Corpus-Has-More: false``, from a web front
  in a subprocess (``--server subprocess``, the default: the front and this client each get their own
  process, as in production) or in this process (``--server inprocess``);
- baseline: ``COPY (SELECT event FROM changes ORDER BY sequence) TO STDOUT`` of the same rows through
  asyncpg's ``copy_from_query``, in the same run, against the same database.

Prints rows/s and MB/s of each (median of the rounds) and the ratio ours/COPY (target >= 0.5). The
database, the web front and this client share the machine's CPUs, so single runs vary: only the
ratio compares across runs. The seeded database is dropped at the end (``--keep`` keeps it).

(a) ``--fanout``: SSE fan-out, ``--clients`` (default 1,000) concurrent ``GET /corpus/stream`` clients
on one web node while ``--rate`` changes a second (default 200) are written for ``--seconds`` (20).
In alternating rounds (default 2; the median is reported):

- ours: the Procfile's processes, ``toastmachine run writer`` and ``toastmachine run publisher`` for
  the whole run and a fresh ``toastmachine web`` per round (so that its memory per client starts
  from a clean process), on a private RabbitMQ virtual host and a fresh database, admission limits
  out of the way. The clients open their streams at the head and wait for ``ready``; then
  ``--agents`` agents (4) write messages over HTTP on a fixed schedule, a fresh Operation-Token each.
  Latency of a (client, change) pair: from the moment this process read the write's 201 answer
  (which comes after the commit, so this is a lower bound of commit-to-client) to the moment the
  client read the frame; the same from the moment the POST was sent is printed as an upper bound.
- baseline: plain aiohttp in a subprocess (``--raw-server``) putting one pre-serialised frame of
  the same size (``id``/``event``/``data``, its send time inside) into every client's bounded queue
  at the same rate, one ``StreamResponse.write`` per client; latency from the moment it queued the
  frame (``perf_counter`` is CLOCK_MONOTONIC on Linux: one clock for both processes).

The same client code reads both sides: one bare asyncio protocol per socket in this process
(chunked decoding and SSE framing by hand, to cost as little per frame as possible). Every client
must receive every change exactly once and in order; the printout says how many did. Prints
frames/s delivered (all clients, first change sent to last frame received), p50/p99, memory per
client (server RSS with the clients connected minus before, divided by the clients), the ratio
ours/raw in frames/s (target >= 0.5), whether ours meets p99 <= 100 ms, and the CPU each process
used: this client, both servers, the broker and the database share the machine's CPUs.

(c) ``--hostile``: one web node under abuse, against itself without it. Seeds ``--changes`` changes
(default 7,500), starts the Procfile's writer, publisher and one ``toastmachine web``, then measures
the write rate to that node (``--agents`` agents, as fast as ``MAX_WRITES_IN_FLIGHT`` allows, for
``--seconds``) twice: alone (the baseline), and while ``--catchups`` (200) clients hold
``GET /corpus/stream?after=0`` without ever reading (a small receive window) and ``--slowloris``
(50) connections trickle request headers, one byte a second, reconnecting when the node closes them.
Prints the web process's RSS before, during (peak) and after the hostile load (after its sockets are
closed), the two write rates and their ratio (hostile/baseline), and how many slowloris connections
the node closed. The same mode runs against older code (settings it does not know are not passed).

Run: ``python bench/stream.py [--catchup | --fanout | --hostile] [--database-url postgresql://...] [--changes N]
[--size BYTES] [--limit L] [--rounds R] [--server subprocess|inprocess] [--keep] [--verbose]
[--clients N] [--rate R] [--seconds S] [--content CHARS] [--agents A] [--drain S]
[--amqp-url amqp://...] [--vhost private|shared] [--logs DIR] [--catchups N] [--slowloris M]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import uuid
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Self, cast
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.hub import DEFAULT_SUBSCRIBER_QUEUE
from actors.web.app import make_app, make_runner
from bench.write import (
    DEFAULT_AMQP_URL,
    Agent,
    CpuMeter,
    HttpSide,
    cancel_on_sigterm,
    content_of,
    private_vhost,
    quiet_product_logs,
    scratch_database,
    stop_process,
)
from infra.bus import make_bus
from infra.config import Settings
from infra.db import Database, apply_migrations, ensure_identity
from infra.logs import configure_logging
from protocol import representations as rep
from protocol.corpus import partition_of
from tests.procs import NodeProcess, clean_env, start

DEFAULT_DSN = os.environ.get("TOASTMACHINE_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
COPY_QUERY = "SELECT event FROM changes ORDER BY sequence"


# --- seeding -----------------------------------------------------------------------------------


def fresh_database(server_dsn: str, keep: bool) -> contextlib.AbstractAsyncContextManager[str]:
    """A new database with a random ``tm_bench_`` name on the server of ``server_dsn``."""
    return scratch_database(server_dsn, f"tm_bench_{uuid.uuid4().hex[:12]}", keep=keep)


async def seed(dsn: str, changes: int, per_conversation: int, size: int) -> int:
    """Fill the migrated database at ``dsn`` with ``changes`` changes; return the bytes of their events."""
    db = await Database.connect(dsn, min_size=1, max_size=2)
    try:
        await apply_migrations(db)
        identity = await ensure_identity(db, None, None)
        corpus_id, lineage = str(identity.corpus_id), str(identity.lineage)
        agent_id, name = uuid.uuid4(), "bench-agent"
        started = datetime.now(UTC).replace(microsecond=0) - timedelta(days=1)
        filler = "lorem ipsum dolor sit amet #bench " * (size // 30 + 1)
        conversations: list[tuple[Any, ...]] = []
        messages: list[tuple[Any, ...]] = []
        rows: list[tuple[Any, ...]] = []
        total_bytes = 0
        conversation_id = ""
        root = ""
        count = 0
        for sequence in range(1, changes + 1):
            at = started + timedelta(milliseconds=sequence)
            message_id = str(uuid.uuid4())
            new = (sequence - 1) % per_conversation == 0
            if new:
                conversation_id, root, count = str(uuid.uuid4()), message_id, 0
            count += 1
            partition = partition_of(conversation_id)
            message = rep.message(
                id=message_id, conversation_id=conversation_id, author_id=str(agent_id), author_name=name,
                sequence=sequence, created_at=at, kinds=["post"], content="", payload_json=None,
                schema_name=None, schema_version=None, reply_to=None if new else root, tags=["bench"],
                mentions=[])
            # Pad the content so the whole envelope is about ``size`` bytes.
            probe = len(rep.dumps(rep.envelope(sequence=sequence, type=rep.MESSAGE_APPENDED, partition=partition,
                                               corpus_id=corpus_id, lineage=lineage, occurred_at=at,
                                               data={"message": message})))
            content = filler[:max(1, size - probe)]
            message["content"] = content
            if new:
                conversation = rep.conversation(
                    id=conversation_id, subject=f"bench {sequence}", author_id=str(agent_id), author_name=name,
                    root_message_id=message_id, created_sequence=sequence, created_at=at, message_count=1,
                    last_sequence=sequence)
                conversations.append((uuid.UUID(conversation_id), f"bench {sequence}", agent_id,
                                      uuid.UUID(message_id), partition, at))
                kind, data = rep.CONVERSATION_CREATED, {"conversation": conversation, "message": message}
            else:
                kind, data = rep.MESSAGE_APPENDED, {"message": message}
            event = rep.dumps(rep.envelope(sequence=sequence, type=kind, partition=partition, corpus_id=corpus_id,
                                           lineage=lineage, occurred_at=at, data=data)).decode()
            total_bytes += len(event) + 1
            messages.append((uuid.UUID(message_id), uuid.UUID(conversation_id), agent_id, ["post"], content,
                             None if new else uuid.UUID(root), ["bench"], at))
            rows.append((sequence, kind, partition, uuid.UUID(conversation_id), agent_id, uuid.UUID(message_id),
                         at, event))
        async with db.acquire() as conn, conn.transaction():
            await conn.execute("insert into agents (agent_id, name, credential_hash) values ($1, $2, $3)",
                               agent_id, name, os.urandom(32))
            await conn.copy_records_to_table(
                "conversations", records=conversations,
                columns=["id", "subject", "author_id", "root_message_id", "partition", "created_at"])
            await conn.copy_records_to_table(
                "messages", records=messages,
                columns=["id", "conversation_id", "author_id", "kinds", "content", "reply_to", "tags", "created_at"])
            await conn.copy_records_to_table(
                "changes", records=rows,
                columns=["sequence", "type", "partition", "conversation_id", "author_id", "message_id",
                         "occurred_at", "event"])
            await conn.execute("select setval('change_sequence', $1)", changes)
        await db.pool.execute("vacuum analyze changes")
        return total_bytes
    finally:
        await db.close()


# --- the web front under test -------------------------------------------------------------------


async def serve_front(dsn: str) -> None:
    """Child mode: serve the web front on the seeded database (in-process bus), print the port."""
    from aiohttp import web

    from toastmachine.node import Node

    configure_logging(level="warning")  # stdout carries the port line
    settings = Settings.from_env({})
    db = await Database.connect(dsn, min_size=1, max_size=settings.db_pool_size, custom_plans=True)
    bus = make_bus(None)
    await bus.connect()
    identity = await ensure_identity(db, None, None)
    node = Node(settings=settings, db=db, bus=bus, identity=identity, identity_error=None, database_label="bench")
    runner = make_runner(make_app(node), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"PORT {port}", flush=True)
    # Until the parent closes our stdin.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()
    await bus.close()
    await db.close()


@contextlib.asynccontextmanager
async def front(dsn: str, mode: str) -> AsyncIterator[str]:
    """The base URL of a web front serving ``dsn``."""
    if mode == "subprocess":
        child = await asyncio.create_subprocess_exec(sys.executable, __file__, "--serve", dsn,
                                                     stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert child.stdin is not None and child.stdout is not None
        try:
            line = await asyncio.wait_for(child.stdout.readline(), 60)
            if not line.startswith(b"PORT "):
                raise RuntimeError(f"the web front did not start: {line!r}")
            yield f"http://127.0.0.1:{int(line.split()[1])}"
        finally:
            child.stdin.close()  # the child's signal to stop
            try:
                await asyncio.wait_for(child.wait(), 30)
            except TimeoutError:
                child.kill()
                await child.wait()
        return
    from aiohttp.test_utils import TestServer

    from toastmachine.node import Node

    settings = Settings.from_env({})
    db = await Database.connect(dsn, min_size=1, max_size=settings.db_pool_size, custom_plans=True)
    bus = make_bus(None)
    await bus.connect()
    identity = await ensure_identity(db, None, None)
    server = TestServer(make_app(Node(settings=settings, db=db, bus=bus, identity=identity, identity_error=None,
                                      database_label="bench")), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()
        await bus.close()
        await db.close()


# --- (b) catch-up ------------------------------------------------------------------------------


async def catchup_http(session: aiohttp.ClientSession, base: str, limit: int) -> tuple[float, int, int]:
    """Page through the whole history; return (seconds, lines, bytes)."""
    lines = size = 0
    after = 0
    started = time.perf_counter()
    while True:
        async with session.get(f"{base}/corpus/changes.jsonl", params={"after": after, "limit": limit}) as resp:
            resp.raise_for_status()
            async for chunk in resp.content.iter_any():
                size += len(chunk)
                lines += chunk.count(b"\n")
            after = int(resp.headers["X-Corpus-Next"])
            if resp.headers["X-Corpus-Has-More"] != "true":
                break
    return time.perf_counter() - started, lines, size


async def catchup_copy(conn: asyncpg.Connection) -> tuple[float, int, int]:
    """COPY the same rows to this client; return (seconds, lines, bytes)."""
    lines = size = 0

    async def sink(chunk: bytes) -> None:
        nonlocal lines, size
        size += len(chunk)
        lines += chunk.count(b"\n")

    started = time.perf_counter()
    await conn.copy_from_query(COPY_QUERY, output=sink)
    return time.perf_counter() - started, lines, size


async def bench_catchup(args: argparse.Namespace) -> None:
    configure_logging(level="warning")
    async with fresh_database(args.database_url, args.keep) as dsn:
        started = time.perf_counter()
        seeded = await seed(dsn, args.changes, args.per_conversation, args.size)
        print(f"seeded {args.changes:,} changes ({seeded / args.changes:.0f} B per envelope line) "
              f"in {time.perf_counter() - started:.1f} s", flush=True)
        conn = await asyncpg.connect(dsn)
        try:
            async with front(dsn, args.server) as base, aiohttp.ClientSession() as session:
                await catchup_http(session, base, args.limit)  # warm up both paths and the page cache
                await catchup_copy(conn)
                results: dict[str, list[tuple[float, int, int]]] = {"ours": [], "copy": []}
                for i in range(args.rounds):
                    for who in (("copy", "ours") if i % 2 == 0 else ("ours", "copy")):
                        if who == "ours":
                            result = await catchup_http(session, base, args.limit)
                        else:
                            result = await catchup_copy(conn)
                        if result[1] != args.changes:
                            raise SystemExit(f"{who} returned {result[1]} lines, expected {args.changes}")
                        results[who].append(result)
                        if args.verbose:
                            print(f"round {i} {who:4s} {result[1] / result[0]:10,.0f} rows/s "
                                  f"{result[2] / result[0] / 1e6:8.1f} MB/s", flush=True)
        finally:
            await conn.close()

    def rates(who: str) -> tuple[float, float]:
        seconds = statistics.median(r[0] for r in results[who])
        return args.changes / seconds, results[who][0][2] / seconds / 1e6

    ours, copy = rates("ours"), rates("copy")
    print(f"{args.changes:,} changes, pages of {args.limit:,}, web front: {args.server}, "
          f"median of {args.rounds} alternating rounds")
    print(f"  changes.jsonl over HTTP   {ours[0]:10,.0f} rows/s {ours[1]:8.1f} MB/s")
    print(f"  COPY ... TO STDOUT        {copy[0]:10,.0f} rows/s {copy[1]:8.1f} MB/s")
    print(f"  ratio ours/COPY (rows/s)  {ours[0] / copy[0]:.2f}   (target >= 0.5)")


# --- (a) fan-out -------------------------------------------------------------------------------

#: Targets of the issue for (a): p99 commit-to-client latency, and delivered frames/s against raw.
FANOUT_TARGET_P99_MS = 100.0
FANOUT_TARGET_RATIO = 0.5
#: Changes the raw server lets wait per client before cutting it off: the hub's bound per stream.
RAW_CLIENT_QUEUE = DEFAULT_SUBSCRIBER_QUEUE
#: Clients connecting at once (a listen backlog is finite; a dropped SYN costs a 1-second retry).
CONNECT_CONCURRENCY = 100
#: Writes in flight at once; past it the writer falls behind its schedule (and the printout says so).
MAX_WRITES_IN_FLIGHT = 256
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-store",
               "X-Accel-Buffering": "no", "Connection": "keep-alive"}

OURS_INCLUDES = ("per change: the HTTP write (web -> RabbitMQ -> writer -> commit -> 201); in parallel "
                 "NOTIFY -> publisher -> RabbitMQ (confirmed, and one change batch per window) -> the web "
                 "node's hub queue -> hub (frames encoded once per change, fan-out in slices) -> each "
                 "stream's socket (an idle stream's straight from the pass, else its bounded queue)")
RAW_INCLUDES = ("per frame: one pre-serialised frame of the same size, the same bytes put into every "
                "client's bounded queue (the hub's bound), one aiohttp StreamResponse.write per client")
RAW_EXCLUDES = ("the database, the bus, the publisher, the hub's ordering and hole checks, per-client "
                "frame formatting, the per-write timeout; its reference time is the moment the frame is "
                "queued, ours is the moment the 201 answer was read (after the commit)")


def raise_fd_limit(clients: int) -> None:
    """Let this process, and the servers it starts (they inherit it), hold ``clients`` sockets."""
    need = clients + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"--clients {clients} needs about {need} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class SseClient(asyncio.Protocol):
    """One Server-Sent Events client on a bare socket; the same code reads ours and the raw server.

    This process reads for every client, so it must cost as little per frame as it can: it decodes
    HTTP/1.1 chunked transfer coding and splits SSE frames with a few ``bytearray.find`` calls per
    read, and keeps each frame's sequence and the time its bytes were read (``perf_counter``, which
    is CLOCK_MONOTONIC on Linux and so comparable with the raw server's clock).
    """

    def __init__(self, host: str, port: int, path: str) -> None:
        self.request = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/event-stream\r\n"
                        f"Cache-Control: no-cache\r\n\r\n").encode()
        self.transport: asyncio.Transport | None = None
        self.raw = bytearray()  # bytes read and not decoded yet (headers, chunk framing)
        self.body = bytearray()  # decoded event-stream text not split into frames yet
        self.status = 0
        self.chunk_left = 0  # data bytes of the current chunk still to come
        self.crlf_left = 0  # bytes of the CRLF after a chunk's data still to skip
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.sequences = array("q")
        self.arrivals = array("d")
        self.last = 0
        self.disorder = 0  # frames at or below a sequence already received (duplicates, reordering)
        self.frame_bytes = 0
        self.errors: list[str] = []
        self.closing = False  # closed by this side (the end of a round), not by the server
        self.lost = False  # the server or the network ended the stream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = not self.closing
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"the stream closed before `ready` ({exc!r})"))
        if not self.done.done():
            self.done.set_result(None)

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, why: str) -> None:
        self.errors.append(why)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(why))
        self.close()

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        raw = self.raw
        raw += data
        pos = 0
        if not self.status:
            end = raw.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(raw[:end]).decode("latin-1")
            self.status = int(head.split(" ", 2)[1])
            if self.status != 200 or "transfer-encoding: chunked" not in head.lower():
                self._fail(f"unexpected answer: {head.splitlines()[0]}")
                return
            pos = end + 4
        body = self.body
        size = len(raw)
        while pos < size:
            if self.chunk_left:
                take = min(self.chunk_left, size - pos)
                body += raw[pos:pos + take]
                pos += take
                self.chunk_left -= take
                if not self.chunk_left:
                    self.crlf_left = 2
            elif self.crlf_left:
                take = min(self.crlf_left, size - pos)
                pos += take
                self.crlf_left -= take
            else:
                eol = raw.find(b"\r\n", pos)
                if eol < 0:
                    break
                length = int(bytes(raw[pos:eol]).split(b";", 1)[0], 16)
                pos = eol + 2
                if not length:  # the last chunk: the server ended the stream
                    break
                self.chunk_left = length
        del raw[:pos]
        start = 0
        while (end := body.find(b"\n\n", start)) >= 0:
            if body.startswith(b"id: ", start):
                sequence = int(body[start + 4:body.find(b"\n", start)])
                if sequence <= self.last:
                    self.disorder += 1
                else:
                    self.last = sequence
                self.sequences.append(sequence)
                self.arrivals.append(now)
                self.frame_bytes += end + 2 - start
            elif body.startswith(b"event: ready", start):
                if not self.ready.done():
                    self.ready.set_result(None)
            elif body.startswith(b"event: stream-error", start):
                self.errors.append(bytes(body[start:end]).decode(errors="replace"))
            start = end + 2
        if start:
            del body[:start]


@contextlib.asynccontextmanager
async def sse_clients(base: str, path: str, count: int) -> AsyncIterator[list[SseClient]]:
    """``count`` clients of ``base + path``, yielded once every one has received ``ready``; closed after."""
    url = urlsplit(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    loop = asyncio.get_running_loop()
    clients = [SseClient(host, port, path) for _ in range(count)]
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def connect(client: SseClient) -> None:
        async with gate:
            await loop.create_connection(lambda: client, host, port)
            await client.ready

    try:
        async with asyncio.timeout(120):
            await asyncio.gather(*(connect(c) for c in clients))
        yield clients
    finally:
        for c in clients:
            c.close()
            if c.ready.done() and not c.ready.cancelled():
                c.ready.exception()  # retrieved: a failed connect was already reported by gather
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await asyncio.gather(*(c.done for c in clients if c.transport is not None))


async def wait_delivered(clients: list[SseClient], last: int, timeout: float) -> None:
    """Until every client still connected has received sequence ``last``, or ``timeout`` seconds."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if all(c.last >= last or c.done.done() for c in clients):
            return
        await asyncio.sleep(0.05)


class RssSampler:
    """The highest RSS of a process, sampled every quarter second while the block runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_bytes(pid)
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.peak = max(self.peak, rss_bytes(self.pid))

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.peak = max(self.peak, rss_bytes(self.pid))


def percentile(ordered: list[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


@dataclass(slots=True)
class FanoutRound:
    """What one side delivered to its clients in one round."""

    who: str
    clients: int
    changes: int  # changes sent (ours: writes answered 201; raw: frames queued)
    delivered: int  # frames received, all clients together
    elapsed: float  # first change sent to the last frame received
    p50_ms: float
    p99_ms: float
    upper_p50_ms: float = math.nan  # ours: from the moment the POST was sent
    upper_p99_ms: float = math.nan
    first_p50_ms: float = math.nan  # to the first client that got each change: the way there, not the fan-out
    first_p99_ms: float = math.nan
    complete: int = 0  # clients that received every change exactly once, in order
    missing: int = 0  # (client, change) pairs never received
    disorder: int = 0  # frames received at or below a sequence already received
    cut_off: int = 0  # clients that got a stream-error or lost the connection
    errors: Counter[str] = field(default_factory=Counter)
    memory_ready: float = 0.0  # bytes per client: RSS with every client ready minus before any
    memory_peak: float = 0.0  # bytes per client: highest RSS while streaming minus before any
    frame_bytes: float = 0.0
    write_rate: float = math.nan  # ours: writes answered 201 per second while writing
    commit_rate: float = math.nan  # ours: changes committed per second while writing
    write_failures: Counter[str] = field(default_factory=Counter)
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.delivered / self.elapsed if self.elapsed > 0 else 0.0


def tally(who: str, clients: list[SseClient], reference: dict[int, float], started: float,
          upper: dict[int, float] | None = None, expected: list[int] | None = None) -> FanoutRound:
    """Check every client's sequences against ``expected`` (default: those of ``reference``), and
    compute the latencies from ``reference`` (and ``upper``) for the sequences that have one."""
    expected_sequences = array("q", sorted(reference) if expected is None else expected)
    first: dict[int, float] = {}
    latencies: list[float] = []
    uppers: list[float] = []
    result = FanoutRound(who, len(clients), len(expected_sequences), 0, 0.0, math.nan, math.nan)
    expected_set = set(expected_sequences)
    last_arrival = started
    frame_bytes = 0
    for c in clients:
        result.delivered += len(c.sequences)
        frame_bytes += c.frame_bytes
        result.disorder += c.disorder
        if c.sequences == expected_sequences:
            result.complete += 1
        else:
            result.missing += len(expected_set.difference(c.sequences))
        for sequence, arrival in zip(c.sequences, c.arrivals, strict=True):
            if arrival < first.get(sequence, math.inf):
                first[sequence] = arrival
        if c.errors or c.lost:
            result.cut_off += 1
            result.errors.update(_error_code(e) for e in c.errors)
            if c.lost and not c.errors:
                result.errors["connection closed"] += 1
        if c.arrivals:
            last_arrival = max(last_arrival, c.arrivals[-1])
        latencies.extend(t - reference[s] for s, t in zip(c.sequences, c.arrivals, strict=True) if s in reference)
        if upper is not None:
            uppers.extend(t - upper[s] for s, t in zip(c.sequences, c.arrivals, strict=True) if s in upper)
    latencies.sort()
    uppers.sort()
    firsts = sorted(t - reference[s] for s, t in first.items() if s in reference)
    result.first_p50_ms, result.first_p99_ms = 1000 * percentile(firsts, 0.5), 1000 * percentile(firsts, 0.99)
    result.elapsed = last_arrival - started
    result.p50_ms, result.p99_ms = 1000 * percentile(latencies, 0.5), 1000 * percentile(latencies, 0.99)
    if upper is not None:
        result.upper_p50_ms, result.upper_p99_ms = 1000 * percentile(uppers, 0.5), 1000 * percentile(uppers, 0.99)
    result.frame_bytes = frame_bytes / result.delivered if result.delivered else 0.0
    return result


def _error_code(frame: str) -> str:
    """The error code of a ``stream-error`` frame, or the text of another failure."""
    try:
        return str(orjson.loads(frame.split("data: ", 1)[1])["error"]["code"])
    except (IndexError, KeyError, TypeError, orjson.JSONDecodeError):
        return frame.split("\n", 1)[0]


# --- (a) ours: the Procfile's processes ---------------------------------------------------------


async def append(session: aiohttp.ClientSession, url: str, agent: Agent, n: int,
                 size: int) -> tuple[int, int | None]:
    """Post one message as ``agent``; (status, sequence of the change when 201)."""
    headers = {"Authorization": f"Bearer {agent.credential}", "Operation-Token": str(uuid.uuid4()),
               "Content-Type": "application/json"}
    async with session.post(f"{url}/conversations/{agent.conversation_id}/messages", headers=headers,
                            data=orjson.dumps({"content": content_of(n, size)})) as r:
        body = await r.read()
    return r.status, int(orjson.loads(body)["sequence"]) if r.status == 201 else None


async def paced_writes(http: HttpSide, rate: float, seconds: float,
                       size: int) -> tuple[dict[int, tuple[float, float]], Counter[str], float]:
    """Write ``rate`` messages a second for ``seconds``, round robin over the agents.

    Returns {sequence: (POST sent, 201 read)}, the failures, and the seconds the writing took.
    """
    answered: dict[int, tuple[float, float]] = {}
    failures: Counter[str] = Counter()
    in_flight = asyncio.Semaphore(MAX_WRITES_IN_FLIGHT)
    tasks: set[asyncio.Task[None]] = set()

    async def one(n: int) -> None:
        try:
            sent = time.perf_counter()
            status, sequence = await append(http.session, http.url, http.agents[n % len(http.agents)], n, size)
            if sequence is not None:
                answered[sequence] = (sent, time.perf_counter())
            else:
                failures[str(status)] += 1
        except (aiohttp.ClientError, OSError, TimeoutError, KeyError, ValueError) as e:
            failures[type(e).__name__] += 1
        finally:
            in_flight.release()

    started = time.perf_counter()
    try:
        for n in range(round(rate * seconds)):
            delay = started + n / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await in_flight.acquire()
            task = asyncio.create_task(one(n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return answered, failures, time.perf_counter() - started


@dataclass(slots=True)
class Node:
    """The node's long-lived processes and what every round of ours shares."""

    env: dict[str, str]
    dsn: str
    writer: NodeProcess
    publisher: NodeProcess
    http: HttpSide
    logs: list[tuple[str, NodeProcess]] = field(default_factory=list)
    #: With ``--write-node other``: the web node that takes the writes (the streams' node takes none).
    ingress: NodeProcess | None = None
    ingress_url: str = ""


async def fanout_ours(args: argparse.Namespace, node: Node) -> FanoutRound:
    """One round of ours: a fresh ``toastmachine web``, N streams, writes at the rate, then the tally."""
    web = await start("web", env=node.env)
    node.logs.append((f"web-{len(node.logs)}", web))
    try:
        base = await web.wait_listening(60)
        pid = web.proc.pid
        node.http.url = node.ingress_url or base
        if not node.http.agents[0].credential:
            await node.http.set_up()
        # Warm up the fresh process (its stream, hub and write paths) with one client, unmeasured.
        async with sse_clients(base, "/corpus/stream", 1) as (probe,):
            last = 0
            for n in range(20):
                status, sequence = await append(node.http.session, node.http.url, node.http.agents[0], n,
                                                args.content_size)
                if sequence is None:
                    raise RuntimeError(f"a warm-up write answered {status}")
                last = sequence
            await wait_delivered([probe], last, 30)
            if probe.last < last:
                raise RuntimeError("the warm-up stream did not deliver the warm-up writes within 30 s")
        await asyncio.sleep(0.5)
        before = rss_bytes(pid)
        db = await asyncpg.connect(node.dsn)
        try:
            head = await db.fetchval("select coalesce(max(sequence), 0) from changes")
        finally:
            await db.close()
        async with sse_clients(base, "/corpus/stream", args.clients) as clients:
            ready = rss_bytes(pid)
            meter = CpuMeter.start({"web": pid, "writer": node.writer.proc.pid,
                                    "publisher": node.publisher.proc.pid, "bench": os.getpid(),
                                    **({"ingress": node.ingress.proc.pid} if node.ingress is not None else {})})
            async with RssSampler(pid) as rss:
                answered, failures, writing = await paced_writes(node.http, args.rate, args.seconds, args.content_size)
                # Every change committed in the round, 201 or not (a write answered 504 may commit later).
                db = await asyncpg.connect(node.dsn)
                try:
                    await asyncio.sleep(1.0)
                    committed = [r[0] for r in await db.fetch(
                        "select sequence from changes where sequence > $1 order by sequence", head)]
                finally:
                    await db.close()
                if committed:
                    await wait_delivered(clients, committed[-1], args.drain)
            cpu = meter.busy()
        started = min((sent for sent, _ in answered.values()), default=time.perf_counter())
        result = tally("ours", clients, {s: t for s, (_, t) in answered.items()}, started,
                       upper={s: t for s, (t, _) in answered.items()}, expected=committed)
    finally:
        await stop_process(web)
    result.memory_ready = (ready - before) / args.clients
    result.memory_peak = (rss.peak - before) / args.clients
    result.write_rate = len(answered) / writing
    result.commit_rate = len(committed) / writing
    result.write_failures = failures
    result.cpu = cpu
    return result


# --- (a) baseline: plain aiohttp ----------------------------------------------------------------


def raw_frame(sequence: int, sent: float, size: int) -> bytes:
    """An SSE frame shaped like ours (``id``, ``event``, ``data``) of ``size`` bytes, carrying its send time."""
    head = f"id: {sequence}\nevent: message.appended\ndata: ".encode()
    data = orjson.dumps({"sequence": sequence, "sent": sent, "pad": ""})
    pad = max(0, size - len(head) - len(data) - 2)
    return head + data[:-2] + b"x" * pad + b'"}\n\n'


async def serve_raw(port: int) -> None:
    """Child mode of the baseline: plain aiohttp streaming pre-serialised frames to every client.

    Prints ``PORT <port>``; each ``go <rate> <seconds> <size>`` line on stdin streams ``rate *
    seconds`` frames, one every ``1/rate`` seconds, to every connected client and then prints
    ``SENT <json list of the perf_counter time each frame was queued>``; end of stdin stops it.
    """
    from aiohttp import web

    queues: set[asyncio.Queue[bytes | None]] = set()
    slow = (b'event: stream-error\ndata: {"schema_version": 1, "error": {"code": "slow_consumer"}}\n\n')

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=RAW_CLIENT_QUEUE)
        queues.add(queue)
        try:
            await response.write(b"retry: 3000\n\n")
            await response.write(b'event: ready\ndata: {"sequence": 0}\n\n')
            while (frame := await queue.get()) is not None:
                await response.write(frame)
                if frame is slow:
                    break
        except ConnectionError:
            pass
        finally:
            queues.discard(queue)
        return response

    async def go(rate: float, seconds: float, size: int) -> list[float]:
        sent: list[float] = []
        started = time.perf_counter()
        for n in range(round(rate * seconds)):
            delay = started + n / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            frame = raw_frame(n + 1, now, size)
            for queue in list(queues):
                try:
                    queue.put_nowait(frame)
                except asyncio.QueueFull:  # cut off, like the hub: room for the error frame, then no more
                    queues.discard(queue)
                    queue.get_nowait()
                    queue.put_nowait(slow)
            sent.append(now)
        return sent

    app = web.Application()
    app.router.add_get("/stream", stream)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
    await site.start()
    print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        _, rate, seconds, size = line.split()
        sent = await go(float(rate), float(seconds), int(size))
        print("SENT " + orjson.dumps(sent).decode(), flush=True)
    for queue in list(queues):
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(None)
    await runner.cleanup()


async def fanout_raw(args: argparse.Namespace, frame_size: int) -> FanoutRound:
    """One round of the baseline: a fresh raw server, N clients, frames at the rate, then the tally."""
    # The SENT line lists every frame's send time: past 64 KiB (asyncio's default line limit) at
    # rates above about 200/s for 20 s, so the reader's limit is raised.
    child = await asyncio.create_subprocess_exec(sys.executable, __file__, "--raw-server", "0",
                                                 stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                 limit=16 * 1024 * 1024)
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout

    async def frames(rate: float, seconds: float) -> list[float]:
        stdin.write(f"go {rate} {seconds} {frame_size}\n".encode())
        await stdin.drain()
        line = await asyncio.wait_for(stdout.readline(), seconds + 120)
        if not line.startswith(b"SENT "):
            raise RuntimeError(f"the raw server failed: {line!r}")
        return list(orjson.loads(line[5:]))

    try:
        line = await asyncio.wait_for(stdout.readline(), 60)
        if not line.startswith(b"PORT "):
            raise RuntimeError(f"the raw server did not start: {line!r}")
        base = f"http://127.0.0.1:{int(line.split()[1])}"
        async with sse_clients(base, "/stream", 1) as (probe,):  # warm up, as ours is
            await frames(args.rate, 0.1)
            await wait_delivered([probe], round(args.rate * 0.1), 30)
        await asyncio.sleep(0.5)
        before = rss_bytes(child.pid)
        async with sse_clients(base, "/stream", args.clients) as clients:
            ready = rss_bytes(child.pid)
            meter = CpuMeter.start({"raw": child.pid, "bench": os.getpid()})
            async with RssSampler(child.pid) as rss:
                sent = await frames(args.rate, args.seconds)
                await wait_delivered(clients, len(sent), args.drain)
            cpu = meter.busy()
        result = tally("raw", clients, {n + 1: t for n, t in enumerate(sent)}, sent[0] if sent else 0.0)
    finally:
        stdin.close()  # the child's signal to stop
        try:
            await asyncio.wait_for(child.wait(), 30)
        except TimeoutError:
            child.kill()
            await child.wait()
    result.memory_ready = (ready - before) / args.clients
    result.memory_peak = (rss.peak - before) / args.clients
    result.cpu = cpu
    return result


# --- (a) the run --------------------------------------------------------------------------------


async def measure_frame_size(node: Node, args: argparse.Namespace) -> int:
    """Bytes of one of ours' frames for a message of ``--size`` characters (the raw server copies it)."""
    web = await start("web", env=node.env)
    node.logs.append(("web-setup", web))
    try:
        base = await web.wait_listening(60)
        node.http.url = base
        await node.http.set_up()
        async with sse_clients(base, "/corpus/stream", 1) as (probe,):
            status, sequence = await append(node.http.session, base, node.http.agents[0], 10**6, args.content_size)
            if sequence is None:
                raise RuntimeError(f"a set-up write answered {status}")
            await wait_delivered([probe], sequence, 30)
            if not probe.sequences:
                raise RuntimeError("the set-up stream delivered nothing within 30 s")
            return probe.frame_bytes // len(probe.sequences)
    finally:
        await stop_process(web)


def fanout_cpu_line(result: list[FanoutRound]) -> str:
    names = [n for n in ("web", "ingress", "writer", "publisher", "raw", "bench", "postgres", "rabbitmq", "machine")
             if any(n in r.cpu for r in result)]
    return ", ".join(f"{n} {statistics.median(r.cpu.get(n, 0.0) for r in result):.2f}" for n in names)


def print_fanout(args: argparse.Namespace, frame_size: int, ours: list[FanoutRound], raw: list[FanoutRound]) -> None:
    def med(rounds: list[FanoutRound], value: Callable[[FanoutRound], float]) -> float:
        return statistics.median(value(r) for r in rounds)

    def checks(rounds: list[FanoutRound]) -> str:
        complete = sum(r.complete for r in rounds)
        total = sum(r.clients for r in rounds)
        text = f"{complete}/{total} client-rounds got every change exactly once, in order"
        missing, disorder, cut = (sum(r.missing for r in rounds), sum(r.disorder for r in rounds),
                                  sum(r.cut_off for r in rounds))
        if missing or disorder or cut:
            errors = sum((r.errors for r in rounds), Counter[str]())
            text += f"; MISSING {missing} (client, change) pairs, {disorder} duplicate or out-of-order frames, " \
                    f"{cut} clients cut off {dict(errors) or ''}"
        return text

    offered = args.clients * args.rate
    print(f"SSE fan-out: {args.clients:,} clients on one node, {args.rate:g} changes/s for {args.seconds:g} s "
          f"(~{frame_size} B frames, offered {offered:,.0f} frames/s), median of {len(ours)} alternating rounds; "
          f"writes through {'a second web node' if args.write_node == 'other' else 'the streams node itself'}")
    print(f"  ours     {med(ours, lambda r: r.rate):10,.0f} frames/s   commit-to-client p50 "
          f"{med(ours, lambda r: r.p50_ms):7.1f} ms  p99 {med(ours, lambda r: r.p99_ms):7.1f} ms   "
          f"memory/client {med(ours, lambda r: r.memory_ready) / 1024:5.1f} KiB ready, "
          f"{med(ours, lambda r: r.memory_peak) / 1024:5.1f} KiB peak")
    print(f"           latency from the 201 answer (after the commit, so a lower bound); from the POST sent "
          f"(an upper bound): p50 {med(ours, lambda r: r.upper_p50_ms):.1f} ms  "
          f"p99 {med(ours, lambda r: r.upper_p99_ms):.1f} ms")
    print(f"           to the first client (the way there, without the fan-out): p50 "
          f"{med(ours, lambda r: r.first_p50_ms):.1f} ms  p99 {med(ours, lambda r: r.first_p99_ms):.1f} ms")
    print(f"           changes committed {med(ours, lambda r: r.commit_rate):.0f}/s, writes answered 201 "
          f"{med(ours, lambda r: r.write_rate):.0f}/s, of {args.rate:g}/s asked"
          + (f"; failed: {dict(sum((r.write_failures for r in ours), Counter[str]()))}"
             if any(r.write_failures for r in ours) else ""))
    print(f"  raw      {med(raw, lambda r: r.rate):10,.0f} frames/s   queued-to-client    p50 "
          f"{med(raw, lambda r: r.p50_ms):7.1f} ms  p99 {med(raw, lambda r: r.p99_ms):7.1f} ms   "
          f"memory/client {med(raw, lambda r: r.memory_ready) / 1024:5.1f} KiB ready, "
          f"{med(raw, lambda r: r.memory_peak) / 1024:5.1f} KiB peak")
    print(f"           to the first client: p50 {med(raw, lambda r: r.first_p50_ms):.1f} ms  "
          f"p99 {med(raw, lambda r: r.first_p99_ms):.1f} ms")
    ratio = med(ours, lambda r: r.rate) / med(raw, lambda r: r.rate)
    p99 = med(ours, lambda r: r.p99_ms)
    print(f"  ratio ours/raw (frames/s) {ratio:.2f}: target >= {FANOUT_TARGET_RATIO} "
          f"{_met(ratio >= FANOUT_TARGET_RATIO)};  ours p99 {p99:.1f} ms: target <= {FANOUT_TARGET_P99_MS:g} ms "
          f"{_met(p99 <= FANOUT_TARGET_P99_MS)}")
    print(f"  check, ours: {checks(ours)}")
    print(f"  check, raw:  {checks(raw)}")
    print(f"  ours includes {OURS_INCLUDES}")
    print(f"  raw includes {RAW_INCLUDES}; it excludes {RAW_EXCLUDES}")
    print("  frames/s = frames received by all clients / (first change sent -> last frame received); "
          "memory/client = (server RSS with the clients connected - RSS before) / clients, "
          "a fresh server process each round")
    print(f"  CPUs busy (of {os.cpu_count()}), ours: {fanout_cpu_line(ours)}")
    print(f"  CPUs busy (of {os.cpu_count()}), raw:  {fanout_cpu_line(raw)}")
    print("  (bench = this process, which reads for every client on both sides; postgres and rabbitmq: "
          "every such process on this machine)")


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _describe_round(r: FanoutRound) -> str:
    return (f"{r.who:4s} {r.rate:10,.0f} frames/s  p50 {r.p50_ms:7.1f} ms  p99 {r.p99_ms:7.1f} ms  "
            f"first client p50 {r.first_p50_ms:.1f} p99 {r.first_p99_ms:.1f} ms  "
            + (f"writes 201 {r.write_rate:.0f}/s committed {r.commit_rate:.0f}/s {dict(r.write_failures)}  "
               if r.who == "ours" else "")
            + f"{r.complete}/{r.clients} complete  memory/client {r.memory_ready / 1024:.1f}/"
            f"{r.memory_peak / 1024:.1f} KiB  cpu {', '.join(f'{k} {v:.2f}' for k, v in r.cpu.items())}")


async def bench_fanout(args: argparse.Namespace) -> None:
    """(a) SSE fan-out: ours (the Procfile's processes) and plain aiohttp, in alternating rounds."""
    raise_fd_limit(args.clients)
    quiet_product_logs()
    tag = uuid.uuid4().hex[:12]
    ours: list[FanoutRound] = []
    raw: list[FanoutRound] = []
    with cancel_on_sigterm(), tempfile.TemporaryDirectory(prefix="tm-bench-") as data_dir:
        async with private_vhost(args.amqp_url, args.vhost, f"tm_bench_{tag}") as amqp_url, \
                fresh_database(args.database_url, args.keep) as dsn, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=MAX_WRITES_IN_FLIGHT),
                                      timeout=aiohttp.ClientTimeout(total=60)) as session:
            env = clean_env(TOASTMACHINE_AMQP_URL=amqp_url, TOASTMACHINE_DATABASE_URL=dsn,
                            TOASTMACHINE_DATA_DIR=data_dir, TOASTMACHINE_PORT="0",
                            TOASTMACHINE_WRITES_PER_SECOND="1000000", TOASTMACHINE_REGISTER_PER_MINUTE="1000000",
                            # Every client connects from this machine: the stream caps must not refuse them.
                            **known_settings(TOASTMACHINE_STREAM_MAX=str(max(10_000, args.clients + 10)),
                                             TOASTMACHINE_STREAM_MAX_PER_CLIENT=str(args.clients + 10)))
            started: list[tuple[str, NodeProcess]] = []
            try:
                writer = await start("run", "writer", env=env)
                started.append(("writer", writer))
                await writer.wait_for_line(r"ToastMachine running writer", 60)  # it migrates the database
                publisher = await start("run", "publisher", env=env)
                started.append(("publisher", publisher))
                await publisher.wait_for_line(r"ToastMachine running publisher", 60)
                agents = [Agent(f"f{tag[:6]}_{i}") for i in range(args.agents)]
                node = Node(env, dsn, writer, publisher, HttpSide(session, "", agents, args.content_size), started)
                if args.write_node == "other":
                    node.ingress = await start("web", env=env)
                    started.append(("ingress", node.ingress))
                    node.ingress_url = await node.ingress.wait_listening(60)
                frame_size = await measure_frame_size(node, args)
                for i in range(args.rounds):
                    for who in (("raw", "ours") if i % 2 == 0 else ("ours", "raw")):
                        if who == "ours":
                            result = await fanout_ours(args, node)
                            ours.append(result)
                        else:
                            result = await fanout_raw(args, frame_size)
                            raw.append(result)
                        if args.verbose:
                            print(f"round {i} {_describe_round(result)}", flush=True)
            finally:
                await asyncio.gather(*(stop_process(p) for _, p in started))
                if args.logs is not None:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    for label, p in started:
                        (args.logs / f"{label}.log").write_text("\n".join(p.output) + "\n")
    print_fanout(args, frame_size, ours, raw)



# --- (c) hostile clients against one web node ---------------------------------------------------


#: Concurrent writers of the --hostile write-rate measurement.
WRITERS = 16


async def write_rate(http: HttpSide, seconds: float) -> tuple[float, Counter[str]]:
    """Writes per second answered 201 by ``WRITERS`` concurrent writers writing for ``seconds``."""
    failures: Counter[str] = Counter()
    accepted = 0
    deadline = time.perf_counter() + seconds

    async def writer(i: int) -> None:
        nonlocal accepted
        n = 0
        while time.perf_counter() < deadline:
            n += 1
            try:
                status, _ = await append(http.session, http.url, http.agents[i % len(http.agents)], n, http.size)
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                failures[type(e).__name__] += 1
                continue
            if status == 201:
                accepted += 1
            else:
                failures[str(status)] += 1

    started = time.perf_counter()
    await asyncio.gather(*(writer(i) for i in range(WRITERS)))
    return accepted / (time.perf_counter() - started), failures


async def non_reading_catchup(host: str, port: int, opened: list[socket.socket]) -> None:
    """Open ``GET /corpus/stream?after=0`` with a small receive window and never read it."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, port))
    await loop.sock_sendall(sock, b"GET /corpus/stream?after=0 HTTP/1.1\r\nHost: bench\r\n\r\n")
    opened.append(sock)


async def slowloris(host: str, port: int, closed: Counter[str]) -> None:
    """Keep one connection trickling request headers (a byte a second), reconnecting when closed."""
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            closed["connect_failed"] += 1
            await asyncio.sleep(1)
            continue
        try:
            writer.write(b"GET /corpus HTTP/1.1\r\nHost: bench\r\n")
            while not reader.at_eof():
                writer.write(b"X")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        if await reader.read(65536) == b"":
                            break
            closed["by_server"] += 1
        except (ConnectionError, OSError):
            closed["by_server"] += 1
        finally:
            writer.close()


def known_settings(**env: str) -> dict[str, str]:
    """The ``TOASTMACHINE_*`` variables of ``env`` that this code's Settings knows (older code refuses others)."""
    fields = {f.name.upper() for f in dataclasses.fields(Settings)}
    return {k: v for k, v in env.items() if k.removeprefix("TOASTMACHINE_") in fields}


async def bench_hostile(args: argparse.Namespace) -> None:
    """(c) the write rate and RSS of one web node with and without hostile stream and slowloris clients."""
    raise_fd_limit(args.catchups + args.slowloris + 1024)
    quiet_product_logs()
    tag = uuid.uuid4().hex[:12]
    with cancel_on_sigterm(), tempfile.TemporaryDirectory(prefix="tm-bench-") as data_dir:
        async with private_vhost(args.amqp_url, args.vhost, f"tm_bench_{tag}") as amqp_url, \
                fresh_database(args.database_url, args.keep) as dsn, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=MAX_WRITES_IN_FLIGHT),
                                      timeout=aiohttp.ClientTimeout(total=60)) as session:
            await seed(dsn, args.changes, args.per_conversation, args.size)
            env = clean_env(TOASTMACHINE_AMQP_URL=amqp_url, TOASTMACHINE_DATABASE_URL=dsn,
                            TOASTMACHINE_DATA_DIR=data_dir, TOASTMACHINE_PORT="0",
                            TOASTMACHINE_WRITES_PER_SECOND="1000000", TOASTMACHINE_REGISTER_PER_MINUTE="1000000",
                            **known_settings(TOASTMACHINE_STREAM_MAX_PER_CLIENT=str(args.catchups + 100),
                                             TOASTMACHINE_HTTP_READ_TIMEOUT=str(args.read_timeout)))
            started: list[tuple[str, NodeProcess]] = []
            sockets: list[socket.socket] = []
            closed: Counter[str] = Counter()
            try:
                for role in ("writer", "publisher"):
                    proc = await start("run", role, env=env)
                    started.append((role, proc))
                    await proc.wait_for_line(rf"ToastMachine running {role}", 60)
                web = await start("web", env=env)
                started.append(("web", web))
                url = await web.wait_listening(60)
                host, port = urlsplit(url).hostname or "127.0.0.1", urlsplit(url).port or 80
                http = HttpSide(session, url, [Agent(f"h{tag[:6]}_{i}") for i in range(args.agents)],
                                args.content_size)
                await http.set_up()
                await write_rate(http, 2.0)  # warm-up, unmeasured
                baseline, base_failures = await write_rate(http, args.seconds)
                before = rss_bytes(web.proc.pid)
                async with RssSampler(web.proc.pid) as rss:
                    await asyncio.gather(*(non_reading_catchup(host, port, sockets) for _ in range(args.catchups)))
                    lorises = [asyncio.create_task(slowloris(host, port, closed)) for _ in range(args.slowloris)]
                    try:
                        hostile, hostile_failures = await write_rate(http, args.seconds)
                    finally:
                        for task in lorises:
                            task.cancel()
                        await asyncio.gather(*lorises, return_exceptions=True)
                    during = rss_bytes(web.proc.pid)
                for sock in sockets:
                    sock.close()
                await asyncio.sleep(3.0)  # let the node notice the closed sockets and end their streams
                after = rss_bytes(web.proc.pid)
            finally:
                for sock in sockets:
                    sock.close()
                await asyncio.gather(*(stop_process(p) for _, p in started))
                if args.logs is not None:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    for label, p in started:
                        (args.logs / f"{label}.log").write_text("\n".join(p.output) + "\n")
    mib = 1024 * 1024
    print(f"hostile: {args.catchups} non-reading after=0 streams on a {args.changes}-change history, "
          f"{args.slowloris} slowloris connections, {args.seconds:g} s of writes each side")
    print(f"web RSS: before {before / mib:.0f} MiB, during {during / mib:.0f} MiB (peak {rss.peak / mib:.0f}), "
          f"after {after / mib:.0f} MiB")
    print(f"writes/s: baseline {baseline:.0f}, under hostile load {hostile:.0f}, ratio {hostile / baseline:.2f}"
          f"  (failures: baseline {dict(base_failures) or 0}, hostile {dict(hostile_failures) or 0})")
    print(f"slowloris connections closed by the node: {closed['by_server']}"
          + (f" (connects failed: {closed['connect_failed']})" if closed["connect_failed"] else ""))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--catchup", action="store_true", help="(b) changes.jsonl catch-up vs COPY (default)")
    which.add_argument("--fanout", action="store_true", help="(a) SSE fan-out vs plain aiohttp")
    which.add_argument("--hostile", action="store_true", help="(c) one web node under hostile clients")
    which.add_argument("--serve", metavar="DSN", help=argparse.SUPPRESS)  # child mode of --server subprocess
    which.add_argument("--raw-server", metavar="PORT", type=int, help=argparse.SUPPRESS)  # child of --fanout
    parser.add_argument("--database-url", default=DEFAULT_DSN, help="a PostgreSQL server's maintenance database")
    parser.add_argument("--changes", type=int, default=100_000)
    parser.add_argument("--per-conversation", type=int, default=100, help="messages per conversation")
    parser.add_argument("--size", type=int, default=600, help="approximate bytes per event envelope")
    parser.add_argument("--limit", type=int, default=10_000, help="changes.jsonl page size")
    parser.add_argument("--rounds", type=int, help="alternating rounds; the median is reported (5; --fanout 2)")
    parser.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess")
    parser.add_argument("--keep", action="store_true", help="keep the seeded database")
    parser.add_argument("--verbose", action="store_true", help="print every round")
    fanout = parser.add_argument_group("--fanout")
    fanout.add_argument("--clients", type=int, default=1000, help="concurrent SSE clients")
    fanout.add_argument("--rate", type=float, default=200.0, help="changes written per second")
    fanout.add_argument("--seconds", type=float, default=20.0, help="seconds of writing per round")
    fanout.add_argument("--content", type=int, default=100, dest="content_size",
                        help="characters of message content")
    fanout.add_argument("--agents", type=int, default=4, help="agents writing, round robin")
    fanout.add_argument("--write-node", choices=("other", "same"), default="other",
                        help="where the writes go: a second web node (as a deployment that serves many "
                             "streams would), or the streams' own node, which then also does their ingress")
    fanout.add_argument("--drain", type=float, default=30.0,
                        help="seconds the clients get to receive the last change after the writing")
    fanout.add_argument("--amqp-url", default=DEFAULT_AMQP_URL)
    fanout.add_argument("--vhost", choices=("private", "shared"), default="private",
                        help="private: a RabbitMQ virtual host of its own (needs rabbitmqctl)")
    fanout.add_argument("--logs", type=Path, help="write the node processes' output to DIR/<process>.log")
    hostile = parser.add_argument_group("--hostile (also uses --changes, --seconds, --agents, --content)")
    hostile.add_argument("--catchups", type=int, default=200, help="non-reading after=0 streams")
    hostile.add_argument("--slowloris", type=int, default=50, help="connections trickling request headers")
    hostile.add_argument("--read-timeout", type=float, default=5.0,
                         help="TOASTMACHINE_HTTP_READ_TIMEOUT of the node (where the code knows it)")
    args = parser.parse_args()
    if args.hostile and args.changes == parser.get_default("changes"):
        args.changes = 7_500
    if args.rounds is None:
        args.rounds = 2 if args.fanout else 5
    if args.serve:
        await serve_front(args.serve)
    elif args.raw_server is not None:
        await serve_raw(args.raw_server)
    elif args.fanout:
        await bench_fanout(args)
    elif args.hostile:
        await bench_hostile(args)
    else:
        await bench_catchup(args)


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        asyncio.run(main())
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
