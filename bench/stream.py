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

(a) ``--fanout``: SSE fan-out through the hub to many ``/corpus/stream`` clients. Not written yet;
its place is :func:`bench_fanout`.

Run: ``python bench/stream.py [--catchup | --fanout] [--database-url postgresql://...] [--changes N]
[--size BYTES] [--limit L] [--rounds R] [--server subprocess|inprocess] [--keep] [--verbose]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.web.app import make_app
from infra.bus import make_bus
from infra.config import Settings
from infra.db import Database, apply_migrations, ensure_identity
from infra.logs import configure_logging
from protocol import representations as rep
from protocol.corpus import partition_of

DEFAULT_DSN = os.environ.get("TOASTMACHINE_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
COPY_QUERY = "SELECT event FROM changes ORDER BY sequence"


# --- seeding -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def fresh_database(server_dsn: str, keep: bool) -> AsyncIterator[str]:
    name = f"tm_bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'create database "{name}"')
    finally:
        await admin.close()
    try:
        yield urlsplit(server_dsn)._replace(path="/" + name).geturl()
    finally:
        if keep:
            print(f"kept database {name}")
        else:
            admin = await asyncpg.connect(server_dsn)
            try:
                await admin.execute(f'drop database if exists "{name}" with (force)')
            finally:
                await admin.close()


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
    db = await Database.connect(dsn, min_size=1, max_size=settings.db_pool_size)
    bus = make_bus(None)
    await bus.connect()
    identity = await ensure_identity(db, None, None)
    node = Node(settings=settings, db=db, bus=bus, identity=identity, identity_error=None, database_label="bench")
    runner = web.AppRunner(make_app(node), access_log=None)
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
    db = await Database.connect(dsn, min_size=1, max_size=settings.db_pool_size)
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


async def bench_fanout(args: argparse.Namespace) -> None:
    """(a) SSE fan-out: to be written with its issue (many /corpus/stream clients, live writes)."""
    raise SystemExit("--fanout (part a, SSE fan-out) is not implemented yet")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--catchup", action="store_true", help="(b) changes.jsonl catch-up vs COPY (default)")
    which.add_argument("--fanout", action="store_true", help="(a) SSE fan-out (not written yet)")
    which.add_argument("--serve", metavar="DSN", help=argparse.SUPPRESS)  # child mode of --server subprocess
    parser.add_argument("--database-url", default=DEFAULT_DSN, help="a PostgreSQL server's maintenance database")
    parser.add_argument("--changes", type=int, default=100_000)
    parser.add_argument("--per-conversation", type=int, default=100, help="messages per conversation")
    parser.add_argument("--size", type=int, default=600, help="approximate bytes per event envelope")
    parser.add_argument("--limit", type=int, default=10_000, help="changes.jsonl page size")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median is reported")
    parser.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess")
    parser.add_argument("--keep", action="store_true", help="keep the seeded database")
    parser.add_argument("--verbose", action="store_true", help="print every round")
    args = parser.parse_args()
    if args.serve:
        await serve_front(args.serve)
    elif args.fanout:
        await bench_fanout(args)
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
