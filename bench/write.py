"""The HTTP write path of a multi-process node against plain asyncpg inserts, in the same run.

Ours: ``--concurrency`` agents (default 64) post messages over HTTP to a node run the way the
Procfile runs it, as separate OS processes: ``toastmachine web`` and ``toastmachine run writer``,
on RabbitMQ and a fresh PostgreSQL database. Each agent registers, reads the guide, creates its own
conversation, then appends messages to it, a fresh Operation-Token per write. Admission limits are
raised out of the way; everything else is the node's defaults.

The publisher process runs too, as in production (``toastmachine run publisher``).

Baselines, in the same run and at the same concurrency, into a second fresh, migrated database:

(a) the hardware ceiling: a write's two rows (a message and a change holding the same ~600-byte
    event envelope) inserted by plain asyncpg into bare tables, one transaction per write;
(b) the rows the writer inserts (a ``messages`` row, a ``changes`` row with its envelope, the
    completed ``operations`` record) into the migrated schema, triggers included, group-committed by
    plain asyncpg: one statement per table per transaction, at most as many writes per transaction as
    the writer committed on average in the round just before (rounded up), two transactions at once.

Neither has HTTP, authentication, a bus, the sequence advisory lock or the write budget.

Prints accepted writes/s and client-observed p50/p99 latency of each, the ratios ours/(a) (target
>= 0.3) and ours/(b) (target >= 0.5) and whether ours meets p99 <= 100 ms; then checks that the
node's database holds exactly one message, change and completed operation per 201 answer, and
shows where ours spends its time (server-side latency, the writer's writes per transaction, and
CPU-milliseconds per write of each process). Last, the floor under any design on this stack
(``bench/floor.py``, measured each round): what plain aiohttp answering a POST and one confirmed AMQP
publish per event cost alone, with baseline (b)'s own rows, against the CPU budget that the (b)
target leaves per write on this machine.

The broker, the database, both node processes and this client share the machine's CPUs, and both
sides fsync, so single runs vary by tens of percent: the rounds alternate which side goes first and
the median of the rounds is shown. Only the ratio compares across runs.

The node gets a private RabbitMQ virtual host (made with ``rabbitmqctl``, deleted at the end) so
that no other writer on the broker consumes its commands; ``--vhost shared`` uses the URL as given.

Run: ``python bench/write.py [--writes N] [--warmup N] [--concurrency C] [--rounds R] [--size S]
[--amqp-url amqp://...] [--database-url postgresql://...] [--vhost private|shared] [--logs DIR]
[--verbose]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote, urlsplit

import aiohttp
import asyncpg
import orjson
import structlog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import floor
from bench.measure import CpuMeter, Round, drive
from infra.bus.base import COMMANDS_EXCHANGE
from infra.bus.rabbitmq import RabbitBus
from protocol import corpus
from protocol import representations as rep
from protocol.messages import Ping, Pong
from protocol.routing import CorpusScope
from tests.procs import NodeProcess, clean_env, start

DEFAULT_AMQP_URL = os.environ.get("TOASTMACHINE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
DEFAULT_DATABASE_URL = os.environ.get("TOASTMACHINE_TEST_DATABASE_URL",
                                      "postgresql://postgres@127.0.0.1:5432/postgres")
#: Targets of issue #12: accepted writes/s at least these shares of baselines (a) and (b), p99 at most this.
TARGET_RATIO_BARE = 0.3
TARGET_RATIO_GROUPED = 0.5
TARGET_P99_MS = 100.0
#: Seconds a node process gets to exit after SIGTERM before it is killed.
STOP_TIMEOUT = 30.0
APPEND_ROUTE = "/conversations/{id}/messages"

BARE_INCLUDES = ("a pooled connection per write, BEGIN, INSERT bare_messages, nextval, INSERT bare_changes "
                 "(the same event envelope), COMMIT; no constraint, index or trigger but the primary keys")
GROUPED_INCLUDES = ("BEGIN, nextval('change_sequence') per write, one INSERT each into messages, operations "
                    "(completed, with its answer) and changes (the same envelope; its triggers run), COMMIT")
BASELINE_EXCLUDES = ("HTTP, authentication, admission, validation, the bus round trip, the sequence advisory "
                     "lock, the write budget, the publisher")


# --- measuring: bench/measure.py ----------------------------------------------------------------


def quiet_product_logs() -> None:
    """Drop info lines the product's modules log in this process (the ping bus connecting).

    Their module-level loggers are bound at import, before any configuration, so they keep
    structlog's default processor list; a filter put at its head is the one way to reach them.
    """

    def drop_below_warning(_logger: Any, method: str, event: Any) -> Any:
        if method in ("debug", "info"):
            raise structlog.DropEvent
        return event

    structlog.get_config()["processors"].insert(0, drop_below_warning)


# --- services -----------------------------------------------------------------------------------


async def _run(*argv: str, env: dict[str, str] | None = None) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, env=env, cwd=ROOT)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        text = out.decode(errors="replace").strip()
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {text}")


@contextlib.asynccontextmanager
async def private_vhost(amqp_url: str, mode: str, name: str) -> AsyncIterator[str]:
    """Yield ``amqp_url`` on a virtual host of its own (deleted afterwards), or as given for ``shared``."""
    if mode == "shared":
        yield amqp_url
        return
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        raise SystemExit("bench/write.py: rabbitmqctl not found; run with --vhost shared to use the URL's "
                         "virtual host (other writers on that broker would then compete for the commands)")
    user = urlsplit(amqp_url).username or "guest"
    await _run(ctl, "-q", "add_vhost", name)
    try:
        await _run(ctl, "-q", "set_permissions", "-p", name, user, ".*", ".*", ".*")
        yield urlsplit(amqp_url)._replace(path="/" + quote(name, safe="")).geturl()
    finally:
        await _run(ctl, "-q", "delete_vhost", name)


@contextlib.asynccontextmanager
async def scratch_database(server_dsn: str, name: str, *, keep: bool = False,
                           template: str | None = None) -> AsyncIterator[str]:
    """Create database ``name`` on the server of ``server_dsn`` (a copy of database ``template``
    when given, which then must have no open session), yield its DSN, drop it afterwards (unless
    ``keep``: then say that it was kept)."""
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'create database "{name}"' + (f' template "{template}"' if template else ""))
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
                # FORCE ends sessions still open (a node process that was killed, a pool left behind).
                await admin.execute(f'drop database if exists "{name}" with (force)')
            finally:
                await admin.close()


async def stop_process(node: NodeProcess) -> None:
    """SIGTERM, then SIGKILL if it has not exited within :data:`STOP_TIMEOUT`."""
    with contextlib.suppress(TimeoutError, ProcessLookupError):
        await node.stop(STOP_TIMEOUT)


@contextlib.asynccontextmanager
async def node_processes(env: dict[str, str],
                         logs: Path | None) -> AsyncIterator[tuple[NodeProcess, NodeProcess, NodeProcess]]:
    """Start the Procfile's write-path processes, web, writer and publisher; yield them once all are ready.

    The publisher runs as in production, so its work (one confirmed publish per change, read from the
    change history the writer fills) competes for the same CPUs.
    """
    started: list[NodeProcess] = []
    try:
        web = await start("web", env=env)
        started.append(web)
        writer = await start("run", "writer", env=env)
        started.append(writer)
        publisher = await start("run", "publisher", env=env)
        started.append(publisher)
        await asyncio.gather(web.wait_listening(60), writer.wait_for_line(r"ToastMachine running writer", 60),
                             publisher.wait_for_line(r"ToastMachine running publisher", 60))
        yield web, writer, publisher
    finally:
        await asyncio.gather(*(stop_process(p) for p in started))
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            for label, p in zip(("web", "writer", "publisher"), started, strict=False):
                (logs / f"{label}.log").write_text("\n".join(p.output) + "\n")


# --- ours: agents over HTTP ---------------------------------------------------------------------


@dataclass(slots=True)
class Agent:
    name: str
    credential: str = ""
    conversation_id: str = ""


def content_of(n: int, size: int) -> str:
    text = f"bench message {n}: "
    return (text + "lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]


class HttpSide:
    """The agents of one node and the requests they send."""

    def __init__(self, session: aiohttp.ClientSession, url: str, agents: list[Agent], size: int) -> None:
        self.session = session
        self.url = url
        self.agents = agents
        self.size = size
        self.accepted = 0  # every 201 this side was ever answered, set-up included

    def _headers(self, agent: Agent) -> dict[str, str]:
        return {"Authorization": f"Bearer {agent.credential}", "Operation-Token": str(uuid.uuid4()),
                "Content-Type": "application/json"}

    async def _post(self, path: str, agent: Agent, body: dict[str, Any]) -> tuple[int, bytes]:
        async with self.session.post(self.url + path, data=orjson.dumps(body),
                                     headers=self._headers(agent)) as r:
            data = await r.read()
        if r.status == 201:
            self.accepted += 1
        return r.status, data

    async def set_up(self) -> None:
        """Register every agent, read the guide with it, and create its conversation."""

        async def one(agent: Agent) -> None:
            async with self.session.post(self.url + "/register", json={"name": agent.name}) as r:
                if r.status != 201:
                    raise RuntimeError(f"POST /register answered {r.status}: {await r.text()}")
                agent.credential = (await r.json())["credential"]
            async with self.session.get(self.url + "/guide",
                                        headers={"Authorization": f"Bearer {agent.credential}"}) as r:
                if r.status != 200:
                    raise RuntimeError(f"GET /guide answered {r.status}: {await r.text()}")
                await r.read()
            body = {"subject": f"bench {agent.name}", "content": content_of(0, self.size)}
            status, data = await self._post("/conversations", agent, body)
            if status != 201:
                raise RuntimeError(f"POST /conversations answered {status}: {data.decode(errors='replace')}")
            agent.conversation_id = orjson.loads(data)["conversation"]["id"]

        await asyncio.gather(*(one(a) for a in self.agents))

    async def write(self, i: int, n: int) -> str | None:
        agent = self.agents[i]
        status, _ = await self._post(f"/conversations/{agent.conversation_id}/messages", agent,
                                     {"content": content_of(n, self.size)})
        return None if status == 201 else str(status)

    async def server_seconds(self) -> tuple[float, float, float, float]:
        """From /metrics: (sum of seconds, count) the web front measured for the append route, and
        (command messages, requests in them) of its bus's batch form."""
        async with self.session.get(self.url + "/metrics") as r:
            text = await r.text()
        values = {}
        for suffix in ("sum", "count"):
            m = re.search(rf'^toastmachine_http_request_duration_seconds_{suffix}\{{[^}}]*'
                          rf'route="{re.escape(APPEND_ROUTE)}"[^}}]*\}} (\S+)$', text, re.MULTILINE)
            values[suffix] = float(m.group(1)) if m else 0.0
        for what in ("messages", "requests"):
            m = re.search(rf'^toastmachine_bus_request_batches(?:_total)?\{{[^}}]*what="{what}"[^}}]*\}} (\S+)$',
                          text, re.MULTILINE)
            values[what] = float(m.group(1)) if m else 0.0
        return values["sum"], values["count"], values["messages"], values["requests"]


async def measure_ours(side: HttpSide, db: asyncpg.Connection, count: int, concurrency: int,
                       pids: dict[str, int]) -> Round:
    last = await db.fetchval("select coalesce(max(sequence), 0) from changes")
    server_before = await side.server_seconds()
    meter = CpuMeter.start(pids)
    result = await drive(count, concurrency, side.write)
    result.cpu = meter.busy()
    server_after = await side.server_seconds()
    served = server_after[1] - server_before[1]
    if served:
        result.extra["server_ms"] = 1000 * (server_after[0] - server_before[0]) / served
    batches, batched = server_after[2] - server_before[2], server_after[3] - server_before[3]
    if batches:
        # Requests that went alone are not counted in either figure: this is the mean of real batches.
        result.extra["web_batch"] = batched / batches
    # Rows written by one transaction share its xmin: this counts the writer's transactions.
    changes, transactions = await db.fetchrow(
        "select count(*), count(distinct xmin::text) from changes where sequence > $1", last)
    if transactions:
        result.extra["batch"] = changes / transactions
    return result


async def measure_ping(amqp_url: str, db: asyncpg.Connection, count: int, concurrency: int) -> Round:
    """The bus alone: Ping commands to the writer process and its Pong replies, the same way the web
    front sends writes (quorum queue, publisher confirm, direct reply-to), but no HTTP and no database."""
    row = await db.fetchrow("select corpus_id, lineage from corpus_witness")
    scope = CorpusScope(str(row["corpus_id"]), str(row["lineage"]))
    bus = RabbitBus(amqp_url, connection_name="bench-write-ping")
    await bus.connect()

    async def ping(i: int, n: int) -> str | None:
        reply = await bus.request(COMMANDS_EXCHANGE, scope.command_key(Ping.TYPE), Ping(nonce=f"{i}.{n}"),
                                  timeout=30, headers=scope.headers())
        return None if isinstance(reply.message, Pong) else type(reply.message).__name__

    try:
        await drive(min(count, 500), concurrency, ping)
        return await drive(count, concurrency, ping)
    finally:
        await bus.close()


# --- baselines: plain asyncpg ------------------------------------------------------------------


#: The bare tables of baseline (a): the two rows of a write with no constraint, index or trigger
#: beyond a primary key.
BARE_SCHEMA = ("create table bare_messages (id uuid primary key, conversation_id uuid not null, "
               "author_id uuid not null, content text not null, created_at timestamptz not null); "
               "create table bare_changes (sequence bigserial primary key, message_id uuid not null, "
               "event text not null)")


class RawSide:
    """The baseline database: one agent and one conversation per worker, and the raw writes.

    Baseline (a), :meth:`write_bare`: the two rows of a write (a message and a change holding the same
    event envelope) into bare tables, one transaction per write. Baseline (b), :meth:`write_grouped`:
    the rows the writer inserts (message, change with its envelope, completed operation record) into
    the migrated schema, triggers included, group-committed like the writer: up to ``batch`` writes
    per transaction, :data:`GROUP_WORKERS` transactions at a time.
    """

    def __init__(self, dsn: str, concurrency: int, size: int) -> None:
        self.dsn = dsn
        self.concurrency = concurrency
        self.size = size
        self.corpus_id, self.lineage = str(uuid.uuid4()), str(uuid.uuid4())
        self.agents: list[tuple[str, str]] = []  # (agent_id, name)
        self.conversations: list[tuple[str, int]] = []  # (conversation_id, partition)
        self.pool: asyncpg.Pool | None = None
        self.batch = 1
        self._queue: asyncio.Queue[tuple[int, int, asyncio.Future[None]]] | None = None
        self._committers: list[asyncio.Task[None]] = []
        self.transactions = 0
        self.grouped = 0

    async def set_up(self, tag: str) -> None:
        # The product's own command (infra.db.apply_migrations), in a process of its own so that its
        # log lines stay out of this one's output.
        await _run(sys.executable, "-m", "toastmachine.cli", "migrate",
                   env=clean_env(TOASTMACHINE_DATABASE_URL=self.dsn))
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(BARE_SCHEMA)
            for i in range(self.concurrency):
                agent_id, name = str(uuid.uuid4()), f"raw{tag}_{i}"
                conversation_id, root_id = str(uuid.uuid4()), str(uuid.uuid4())
                partition, now = corpus.partition_of(conversation_id), rep.now_ms()
                async with conn.transaction():
                    await conn.execute("insert into agents (agent_id, name, credential_hash, onboarded_at) "
                                       "values ($1, $2, $3, $4)", agent_id, name, os.urandom(32), now)
                    await conn.execute(
                        "insert into conversations (id, subject, author_id, root_message_id, partition, "
                        "created_at) values ($1, $2, $3, $4, $5, $6)",
                        conversation_id, f"bench {name}", agent_id, root_id, partition, now)
                    await conn.execute(
                        "insert into messages (id, conversation_id, author_id, kinds, content, created_at) "
                        "values ($1, $2, $3, $4, $5, $6)",
                        root_id, conversation_id, agent_id, list(corpus.DEFAULT_KINDS),
                        content_of(0, self.size), now)
                self.agents.append((agent_id, name))
                self.conversations.append((conversation_id, partition))
        finally:
            await conn.close()

    @contextlib.asynccontextmanager
    async def connected(self, batch: int = 0) -> AsyncIterator[None]:
        """A pool of one connection per worker, opened before timing starts; with ``batch`` > 0 also
        the group committers of baseline (b), taking up to ``batch`` writes per transaction."""
        self.pool = await asyncpg.create_pool(self.dsn, min_size=self.concurrency, max_size=self.concurrency)
        if batch > 0:
            self.batch = batch
            self._queue = asyncio.Queue(maxsize=self.concurrency)
            self._committers = [asyncio.create_task(self._commit_loop()) for _ in range(GROUP_WORKERS)]
        try:
            yield
        finally:
            for task in self._committers:
                task.cancel()
            for task in self._committers:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._committers, self._queue = [], None
            await self.pool.close()
            self.pool = None

    def event(self, sequence: int, message_id: str, conversation_id: str, partition: int, agent_id: str,
              name: str, content: str, created_at: datetime) -> bytes:
        """The message.appended envelope the writer would store for this message (same builders)."""
        data = {"message": rep.message(
            id=message_id, conversation_id=conversation_id, author_id=agent_id, author_name=name,
            sequence=sequence, created_at=created_at, kinds=corpus.DEFAULT_KINDS, content=content,
            payload_json=None, schema_name=None, schema_version=None, reply_to=None, tags=(), mentions=())}
        return rep.dumps(rep.envelope(sequence=sequence, type=rep.MESSAGE_APPENDED, partition=partition,
                                      corpus_id=self.corpus_id, lineage=self.lineage, occurred_at=created_at,
                                      data=data))

    async def write_bare(self, i: int, n: int) -> str | None:
        """Baseline (a): one transaction inserting the write's two rows into the bare tables."""
        assert self.pool is not None
        agent_id, name = self.agents[i]
        conversation_id, partition = self.conversations[i]
        message_id, content, created_at = str(uuid.uuid4()), content_of(n, self.size), rep.now_ms()
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "insert into bare_messages (id, conversation_id, author_id, content, created_at) "
                "values ($1, $2, $3, $4, $5)", message_id, conversation_id, agent_id, content, created_at)
            sequence = await conn.fetchval("select nextval('bare_changes_sequence_seq')")
            event = self.event(sequence, message_id, conversation_id, partition, agent_id, name, content,
                               created_at)
            await conn.execute("insert into bare_changes (sequence, message_id, event) values ($1, $2, $3)",
                               sequence, message_id, event.decode())
        return None

    async def write_grouped(self, i: int, n: int) -> str | None:
        """Baseline (b): hand the write to the group committers and wait for its transaction."""
        assert self._queue is not None
        done = asyncio.get_running_loop().create_future()
        await self._queue.put((i, n, done))
        await done
        return None

    async def _commit_loop(self) -> None:
        assert self._queue is not None and self.pool is not None
        while True:
            jobs = [await self._queue.get()]
            while len(jobs) < self.batch and not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            try:
                await self._commit_group(jobs)
            except (asyncpg.PostgresError, OSError) as e:
                for *_, done in jobs:
                    if not done.done():
                        done.set_exception(e)
            else:
                for *_, done in jobs:
                    if not done.done():
                        done.set_result(None)

    async def _commit_group(self, jobs: list[tuple[int, int, asyncio.Future[None]]]) -> None:
        """One transaction for ``jobs``: one statement each for messages, operations and changes."""
        assert self.pool is not None
        messages: list[list[Any]] = [[] for _ in range(5)]
        changes: list[list[Any]] = [[] for _ in range(6)]
        operations: list[list[Any]] = [[] for _ in range(6)]
        async with self.pool.acquire() as conn, conn.transaction():
            sequences = await conn.fetchval("select array_agg(nextval('change_sequence')) "
                                            "from generate_series(1, $1)", len(jobs))
            for (i, n, _), sequence in zip(jobs, sorted(sequences), strict=True):
                agent_id, name = self.agents[i]
                conversation_id, partition = self.conversations[i]
                message_id, content, created_at = str(uuid.uuid4()), content_of(n, self.size), rep.now_ms()
                event = self.event(sequence, message_id, conversation_id, partition, agent_id, name, content,
                                   created_at).decode()
                for column, value in zip(messages, (message_id, conversation_id, agent_id, content, created_at),
                                         strict=True):
                    column.append(value)
                for column, value in zip(changes, (sequence, partition, conversation_id, agent_id, message_id,
                                                   event), strict=True):
                    column.append(value)
                for column, value in zip(operations, (agent_id, str(uuid.uuid4()), os.urandom(32), sequence,
                                                      event, created_at), strict=True):
                    column.append(value)
            await conn.execute(
                "insert into messages (id, conversation_id, author_id, kinds, content, created_at) "
                "select m.id, m.conversation_id, m.author_id, $6::text[], m.content, m.created_at "
                "from unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::text[], $5::timestamptz[]) "
                "as m(id, conversation_id, author_id, content, created_at)",
                *messages, list(corpus.DEFAULT_KINDS))
            await conn.execute(
                "insert into operations (author_id, operation, token, request_hash, status, response, sequence, "
                "created_at) select o.author_id, 'append_message', o.token, o.hash, 201, o.response, o.sequence, "
                "o.created_at from unnest($1::uuid[], $2::text[], $3::bytea[], $4::bigint[], $5::text[], "
                "$6::timestamptz[]) as o(author_id, token, hash, sequence, response, created_at)", *operations)
            await conn.execute(
                "insert into changes (sequence, type, partition, conversation_id, author_id, message_id, "
                "occurred_at, event) select c.sequence, $7, c.partition, c.conversation_id, c.author_id, "
                "c.message_id, now(), c.event from unnest($1::bigint[], $2::smallint[], $3::uuid[], $4::uuid[], "
                "$5::uuid[], $6::text[]) as c(sequence, partition, conversation_id, author_id, message_id, event)",
                *changes, rep.MESSAGE_APPENDED)
        self.transactions += 1
        self.grouped += len(jobs)


#: Transactions baseline (b) runs at once, as the writer does (actors.writer.DEFAULT_BATCH_WORKERS).
GROUP_WORKERS = 2


async def measure_bare(side: RawSide, count: int) -> Round:
    """Baseline (a): the hardware ceiling for the write's two rows, one transaction per write."""
    async with side.connected():
        meter = CpuMeter.start({"bench": os.getpid()})
        result = await drive(count, side.concurrency, side.write_bare)
        result.cpu = meter.busy()
    return result


async def measure_grouped(side: RawSide, count: int, batch: int) -> Round:
    """Baseline (b): the writer's rows into the migrated schema, up to ``batch`` writes a transaction."""
    async with side.connected(batch):
        side.transactions = side.grouped = 0
        meter = CpuMeter.start({"bench": os.getpid()})
        result = await drive(count, side.concurrency, side.write_grouped)
        result.cpu = meter.busy()
        if side.transactions:
            result.extra["batch"] = side.grouped / side.transactions
        result.extra["batch_cap"] = batch
    return result


# --- the run ------------------------------------------------------------------------------------


def median(rounds: list[Round], value: Callable[[Round], float]) -> float:
    return statistics.median(value(r) for r in rounds)


def describe(label: str, rounds: list[Round], unit: str = "writes/s") -> str:
    return (f"{label} {median(rounds, lambda r: r.rate):8,.0f} {unit}   "
            f"p50 {median(rounds, lambda r: r.percentile_ms(0.50)):6.1f} ms   "
            f"p99 {median(rounds, lambda r: r.percentile_ms(0.99)):6.1f} ms")


CPU_GROUPS = ("web", "writer", "publisher", "bench", "postgres", "rabbitmq", "machine")


def cpu_line(rounds: list[Round]) -> str:
    """CPU-milliseconds per accepted write of each process group (median of the rounds)."""
    names = [n for n in CPU_GROUPS if any(n in r.cpu for r in rounds)]
    return ", ".join(f"{n} {median(rounds, lambda r, n=n: r.cpu_ms(n)):.2f}" for n in names)


@contextlib.contextmanager
def cancel_on_sigterm() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C: cancel the run so every ``finally`` stops processes and drops databases."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


@dataclass(slots=True)
class Report:
    """What a run measured, and how to print it."""

    args: argparse.Namespace
    ours: list[Round] = field(default_factory=list)
    bare: list[Round] = field(default_factory=list)
    grouped: list[Round] = field(default_factory=list)
    event_bytes: int = 0
    ping: Round | None = None
    http_floor: list[Round] = field(default_factory=list)
    publish_floor: list[Round] = field(default_factory=list)
    accepted: int = 0
    stored: dict[str, int] = field(default_factory=dict)

    @property
    def consistent(self) -> bool:
        return self.accepted == self.stored["messages"] == self.stored["changes"] == self.stored["operations"]

    def print(self) -> None:
        args = self.args
        rate = median(self.ours, lambda r: r.rate)
        ratio_a = rate / median(self.bare, lambda r: r.rate)
        ratio_b = rate / median(self.grouped, lambda r: r.rate)
        p99 = median(self.ours, lambda r: r.percentile_ms(0.99))
        batch = median(self.ours, lambda r: r.extra.get("batch", math.nan))
        print(f"{args.writes} messages per round ({args.size}-character content, "
              f"~{self.event_bytes} B events), {args.concurrency} concurrent writers, "
              f"median of {args.rounds} rounds (a and ours alternate; b follows ours at its batch size)")
        print("  " + describe("ours         (HTTP -> web -> RabbitMQ -> writer -> PostgreSQL)", self.ours))
        print("  " + describe("baseline (a) (asyncpg, 2 rows into bare tables, 1 tx/write)   ", self.bare))
        print("  " + describe("baseline (b) (asyncpg, writer's rows, migrated schema, grouped)", self.grouped))
        print(f"  ratio ours/(a) {ratio_a:.2f}: target >= {TARGET_RATIO_BARE} {_met(ratio_a >= TARGET_RATIO_BARE)};  "
              f"ratio ours/(b) {ratio_b:.2f}: target >= {TARGET_RATIO_GROUPED} "
              f"{_met(ratio_b >= TARGET_RATIO_GROUPED)};  "
              f"ours p99 {p99:.1f} ms: target <= {TARGET_P99_MS:g} ms {_met(p99 <= TARGET_P99_MS)}")
        grouped_batch = median(self.grouped, lambda r: r.extra.get("batch", math.nan))
        print(f"  (a) includes: {BARE_INCLUDES}")
        print(f"  (b) includes: {GROUPED_INCLUDES}; {grouped_batch:.1f} writes per transaction "
              f"(capped at the writer's mean batch, rounded up)")
        print(f"  both exclude: {BASELINE_EXCLUDES}")
        failed = {who: dict(sum((r.failures for r in rounds), Counter[str]()))
                  for who, rounds in (("ours", self.ours), ("a", self.bare), ("b", self.grouped))}
        if any(failed.values()):
            print(f"  refused or failed (not counted above): {failed}")
        stored = self.stored
        verdict = "OK, nothing lost or doubled" if self.consistent else "MISMATCH"
        print(f"  check: {self.accepted} answers 201 (set-up and warm-up included); the node's database "
              f"holds {stored['messages']} messages, {stored['changes']} changes and {stored['operations']} "
              f"completed operations: {verdict}")
        server_ms = median(self.ours, lambda r: r.extra.get("server_ms", math.nan))
        print(f"  ours, where the time goes: the web front's own mean latency for the route "
              f"{server_ms:.1f} ms; each command message from the web node carries "
              f"{median(self.ours, lambda r: r.extra.get('web_batch', math.nan)):.1f} writes (batches of one "
              f"aside); each writer transaction commits {batch:.1f} writes on average")
        if self.ping is not None:
            print("  " + describe("bus alone: Ping -> writer -> Pong (no HTTP, no database)      ", [self.ping],
                                  "pings/s "))
        if self.ours[0].cpu:
            print("  CPU-ms per write, per process group:")
            print(f"    ours: {cpu_line(self.ours)}")
            print(f"    (a):  {cpu_line(self.bare)}")
            print(f"    (b):  {cpu_line(self.grouped)}")
            print("  (postgres and rabbitmq: every such process on this machine, other users' included; "
                  "machine: every CPU's busy time)")
        if self.http_floor and self.publish_floor and self.ours[0].cpu:
            self.print_floor()

    def print_floor(self) -> None:
        """The stack's floor (bench/floor.py) against the CPU budget of the (b) target on this machine."""
        def ms(rounds: list[Round], group: str) -> float:
            return median(rounds, lambda r: r.cpu_ms(group))

        http_server, http_client = ms(self.http_floor, "server"), ms(self.http_floor, "bench")
        publisher, broker = ms(self.publish_floor, "bench"), ms(self.publish_floor, "rabbitmq")
        rows = ms(self.grouped, "postgres") + ms(self.grouped, "bench")
        total = http_server + http_client + publisher + broker + rows
        grouped_rate = median(self.grouped, lambda r: r.rate)
        cpus = floor.cpus()
        budget = 1000 * cpus / (TARGET_RATIO_GROUPED * grouped_rate)
        ceiling = 1000 * cpus / total / grouped_rate
        print("  the floor under any design on this stack, each part measured alone in this run "
              "(CPU-ms per write, processes' own time, median of rounds; bench/floor.py):")
        print(f"    aiohttp answering a write-sized JSON POST with 201 and nothing else: server {http_server:.3f}, "
              f"client {http_client:.3f}  ({median(self.http_floor, lambda r: r.rate):,.0f} requests/s)")
        print(f"    one confirmed publish per event (aiormq, {self.event_bytes} B, the event's headers, "
              f"{floor.PUBLISH_WINDOW} in flight, no queue bound): publisher {publisher:.3f}, rabbitmq {broker:.3f}  "
              f"({median(self.publish_floor, lambda r: r.rate):,.0f} publishes/s)")
        print(f"    baseline (b)'s own rows: postgres + its asyncpg client {rows:.3f}")
        print(f"    sum {total:.2f} ms per write; at {TARGET_RATIO_GROUPED}x (b) ({grouped_rate:,.0f} writes/s) these "
              f"{cpus} CPUs allow {budget:.2f} ms per write; so here, at this batch size, a design on this stack "
              f"reaches about {ceiling:.2f}x (b) at most even if authentication, validation, the command hop and "
              f"the writer's own code cost nothing (an estimate: each part measured alone)")
        ours = sum(ms(self.ours, group) for group in self.ours[0].cpu if group != "machine")
        print(f"    ours spends {ours:.2f} ms per write in these processes, {ours - total:.2f} above the floor; "
              f"the (b) target leaves {budget - total:.2f} ms for all of that")


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


async def run(args: argparse.Namespace) -> Report:
    """Set everything up, measure the three sides round by round, check the node's rows, tear down."""
    tag = uuid.uuid4().hex[:12]
    report = Report(args)
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as data_dir:
        async with private_vhost(args.amqp_url, args.vhost, f"tm_bench_{tag}") as amqp_url, \
                scratch_database(args.database_url, f"tm_bench_{tag}") as node_dsn, \
                scratch_database(args.database_url, f"tm_bench_{tag}_raw") as raw_dsn:
            raw = RawSide(raw_dsn, args.concurrency, args.size)
            message_id, conversation_id, agent_id = (str(uuid.uuid4()) for _ in range(3))
            report.event_bytes = len(raw.event(10**6, message_id, conversation_id, 0, agent_id, f"b{tag}",
                                               content_of(args.writes, args.size), rep.now_ms()))
            await raw.set_up(tag[:6])
            env = clean_env(TOASTMACHINE_AMQP_URL=amqp_url, TOASTMACHINE_DATABASE_URL=node_dsn,
                            TOASTMACHINE_DATA_DIR=data_dir, TOASTMACHINE_PORT="0",
                            # Admission out of the way: 64 agents at full speed is the point here.
                            TOASTMACHINE_WRITES_PER_SECOND="1000000",
                            TOASTMACHINE_REGISTER_PER_MINUTE="1000000")
            async with node_processes(env, args.logs) as (web, writer, publisher):
                assert web.url is not None
                pids = {"web": web.proc.pid, "writer": writer.proc.pid, "publisher": publisher.proc.pid,
                        "bench": os.getpid()}
                connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
                async with aiohttp.ClientSession(connector=connector,
                                                 timeout=aiohttp.ClientTimeout(total=60)) as session:
                    agents = [Agent(f"b{tag[:6]}_{i}") for i in range(args.concurrency)]
                    http = HttpSide(session, web.url, agents, args.size)
                    await http.set_up()
                    db = await asyncpg.connect(node_dsn)
                    try:
                        # Warm up every path (connections, pools, code paths, the broker's queues).
                        warm = await measure_ours(http, db, args.warmup, args.concurrency, pids)
                        await measure_bare(raw, args.warmup)
                        await measure_grouped(raw, args.warmup, _batch_cap(warm))
                        for i in range(args.rounds):
                            # Alternate which goes first: checkpoints and autovacuum caused by one
                            # side's writes would otherwise always land in the other's time. (b) runs
                            # right after ours, at the batch size the writer just showed.
                            for who in (("a", "ours", "b") if i % 2 == 0 else ("ours", "b", "a")):
                                if who == "ours":
                                    result = await measure_ours(http, db, args.writes, args.concurrency, pids)
                                    report.ours.append(result)
                                elif who == "a":
                                    result = await measure_bare(raw, args.writes)
                                    report.bare.append(result)
                                else:
                                    result = await measure_grouped(raw, args.writes, _batch_cap(report.ours[-1]))
                                    report.grouped.append(result)
                                if args.verbose:
                                    print(f"round {i} {describe(f'{who:8s}', [result])}   "
                                          f"batch {result.extra.get('batch', math.nan):.1f}   "
                                          f"failures {dict(result.failures) or 0}", flush=True)
                            await measure_floor(report, amqp_url, args)
                        report.ping = await measure_ping(amqp_url, db, args.writes, args.concurrency)
                        report.accepted = http.accepted
                        report.stored = dict(await db.fetchrow(
                            "select (select count(*) from messages) as messages, "
                            "(select count(*) from changes) as changes, "
                            "(select count(*) from operations where status = 201) as operations"))
                    finally:
                        await db.close()
    return report


async def measure_floor(report: Report, amqp_url: str, args: argparse.Namespace) -> None:
    """One round of the stack's floor (bench/floor.py): plain aiohttp, then one confirmed publish per event."""
    content = content_of(args.writes, args.size)
    async with floor.plain_server() as (base, pid), aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=args.concurrency * 2),
            timeout=aiohttp.ClientTimeout(total=60)) as session:
        report.http_floor.append(await floor.measure_http(base, pid, session, args.writes, args.concurrency, content))
    report.publish_floor.append(await floor.measure_publish(amqp_url, args.writes, report.event_bytes))


def _batch_cap(ours: Round) -> int:
    """The writer's mean batch in ``ours``, rounded up: the most writes baseline (b) commits at once."""
    batch = ours.extra.get("batch", 1.0)
    return max(1, math.ceil(batch)) if math.isfinite(batch) else 1


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=5000, help="measured writes per round and side")
    parser.add_argument("--warmup", type=int, default=1000, help="unmeasured writes per side first")
    parser.add_argument("--concurrency", type=int, default=64, help="agents (ours), tasks (baselines)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported")
    parser.add_argument("--size", type=int, default=100, help="characters of message content")
    parser.add_argument("--amqp-url", default=DEFAULT_AMQP_URL)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL,
                        help="a PostgreSQL server where this user may create databases")
    parser.add_argument("--vhost", choices=("private", "shared"), default="private",
                        help="private: a RabbitMQ virtual host of its own for the node (needs rabbitmqctl)")
    parser.add_argument("--logs", type=Path,
                        help="write the node processes' output to DIR/{web,writer,publisher}.log")
    parser.add_argument("--verbose", action="store_true", help="print every round")
    args = parser.parse_args()
    quiet_product_logs()
    with cancel_on_sigterm():
        report = await run(args)
    report.print()
    return 0 if report.consistent else 1


def run_bench(main: Callable[[], Coroutine[Any, Any, int]]) -> NoReturn:
    """Run a benchmark's ``main`` and exit with its code (130 on Ctrl-C, 143 on SIGTERM).

    The client runs on uvloop, as the node's processes do: the load and the baselines (asyncpg in
    this process) get the same, lighter loop, so less of a latency figure is this process's own
    queueing."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        loop_factory = None
    else:
        loop_factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            sys.exit(runner.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
    except asyncio.CancelledError:  # SIGTERM (see cancel_on_sigterm); everything was torn down
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    run_bench(main)
