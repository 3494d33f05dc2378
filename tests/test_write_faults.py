"""The write path under real faults: a writer process killed with SIGKILL mid-load, PostgreSQL stopped.

The contract under test (SPEC: idempotent writes, 503 for outages): a client that retries the
identical request with the same Operation-Token on any 5xx, connection error or timeout sees every
write succeed exactly once, whatever died in between; and an outage of the database is a 503 the
client can retry, never a 500, with writes succeeding again once the database is back.

RabbitMQ tests run in a virtual host of their own, so that nothing of another test run on the same
broker (its dead letters, its traffic on ``tm.events``) mixes with ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
from aiohttp.test_utils import TestClient

from infra.bus.base import Bus
from infra.db import Database, EmbeddedPostgres, start_embedded
from tests import procs
from tests.corpus_fixtures import STACK_ENV, Agent, running_stack

pytestmark = pytest.mark.fault

#: Writes in the load, and client tasks sending them at once.
WRITES = 2_000
CLIENTS = 32
#: Successful writes after which the writer is killed.
KILL_AFTER = 500
#: Seconds the web front waits for the writer's reply before answering 504 (kept short so the
#: writes caught by the kill time out, and are retried, quickly).
COMMAND_TIMEOUT = 3.0
#: The client's retry policy: per-attempt timeout, attempts per write, backoff between attempts.
CLIENT_TIMEOUT = COMMAND_TIMEOUT + 7
MAX_ATTEMPTS = 25
BACKOFF = 0.05
BACKOFF_CAP = 0.5

WRITER_STARTED = r"ToastMachine running writer"


# --- helpers ------------------------------------------------------------------------------------


async def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait (polling) until ``predicate()`` holds; fail naming ``what`` after ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


async def _json(resp: aiohttp.ClientResponse) -> Any:
    text = await resp.text()
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


async def register(session: aiohttp.ClientSession, base: str, name: str) -> Agent:
    """Register an agent and read the guide with its credential (onboarding)."""
    async with session.post(base + "/register", json={"name": name}) as resp:
        body = await _json(resp)
        assert resp.status == 201, body
    agent = Agent(agent_id=body["agent_id"], name=body["name"], credential=body["credential"])
    async with session.get(base + "/guide", headers=agent.headers()) as resp:
        assert resp.status == 200, await resp.text()
    return agent


@dataclass(slots=True)
class Write:
    """One write of the load and everything the client saw while getting it done."""

    n: int
    agent: Agent
    token: str = field(default_factory=lambda: str(uuid.uuid4()))
    #: Each attempt's outcome: an HTTP status, or the name of the client-side error.
    attempts: list[int | str] = field(default_factory=list)
    body: dict[str, Any] | None = None
    replayed: bool = False
    #: The bodies of the 5xx answers, for failure messages.
    failures: list[Any] = field(default_factory=list)

    @property
    def content(self) -> str:
        return f"w-{self.n}"

    @property
    def retried(self) -> bool:
        return len(self.attempts) > 1


@dataclass(slots=True)
class Load:
    """Progress of the load, watched by the fault injector."""

    created: int = 0
    #: Set by every failed attempt; the injector clears it at the kill to see the fault land.
    failed: asyncio.Event = field(default_factory=asyncio.Event)


async def write_until_created(session: aiohttp.ClientSession, url: str, write: Write, load: Load) -> None:
    """The client's retry policy: the identical request, same token, on any 5xx / error / timeout."""
    for attempt in range(MAX_ATTEMPTS):
        try:
            async with session.post(url, json={"content": write.content},
                                    headers=write.agent.headers(write.token),
                                    timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as resp:
                body = await _json(resp)
                write.attempts.append(resp.status)
                if resp.status == 201:
                    write.body = body
                    write.replayed = resp.headers.get("Idempotent-Replayed") == "true"
                    load.created += 1
                    return
                assert resp.status >= 500, f"write {write.n}: unexpected {resp.status} {body}"
                write.failures.append(body)
        except (aiohttp.ClientError, TimeoutError) as e:
            write.attempts.append(type(e).__name__)
        load.failed.set()
        await asyncio.sleep(min(BACKOFF_CAP, BACKOFF * 2 ** attempt))
    raise AssertionError(f"write {write.n} never answered 201; attempts: {write.attempts}")


async def run_load(session: aiohttp.ClientSession, url: str, agents: list[Agent], count: int, clients: int,
                   inject_fault: Callable[[Load], Coroutine[Any, Any, None]], *,
                   until_fault: bool = False) -> list[Write]:
    """``count`` message writes from ``clients`` concurrent tasks, each retried until 201, while
    ``inject_fault`` does its damage; returns the writes with what each went through.

    With ``until_fault`` the clients keep issuing new writes past ``count`` until ``inject_fault``
    has returned, so the fault always lands on a running load (``count`` is then a minimum): a
    fast machine could otherwise finish every write before a slow fault (a server's shutdown) hits.
    """
    writes: list[Write] = []
    injected = asyncio.Event()
    load = Load()

    def take() -> Write | None:
        if len(writes) >= count and (not until_fault or injected.is_set()):
            return None
        write = Write(len(writes), agents[len(writes) % len(agents)])
        writes.append(write)
        return write

    async def client() -> None:
        while (write := take()) is not None:
            await write_until_created(session, url, write, load)

    async def fault() -> None:
        await inject_fault(load)
        injected.set()

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(fault())
        for _ in range(clients):
            tasks.create_task(client())
    return writes


# --- a writer killed mid-load --------------------------------------------------------------------


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.timeout(300)
async def test_writer_killed_mid_load_loses_and_doubles_nothing(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    amqp_url = rabbitmq_url  # a vhost of this run's own (tests/services.py)
    env = procs.clean_env(
        TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_AMQP_URL=amqp_url,
        TOASTMACHINE_DATABASE_URL=database_url, TOASTMACHINE_PORT="0",
        TOASTMACHINE_WRITES_PER_SECOND="1000000", TOASTMACHINE_REGISTER_PER_MINUTE="100000",
        TOASTMACHINE_COMMAND_TIMEOUT=str(COMMAND_TIMEOUT))
    # The writer first: both processes migrate at start, and the web front's first write needs
    # the writer's queue bound (or it answers 503 writer_unavailable).
    writers = [await procs.start("run", "writer", env=env)]
    web: procs.NodeProcess | None = None
    try:
        await writers[0].wait_for_line(WRITER_STARTED, timeout=60)
        web = await procs.start("web", env=env)
        base = await web.wait_listening(timeout=60)
        writes = await _run_killed_load(base, env, writers)
    finally:
        for proc in [p for p in (web, *writers) if p is not None]:
            if proc.proc.returncode is None:
                await proc.stop()
    assert web is not None
    assert writers[0].proc.returncode == -signal.SIGKILL
    for proc in (web, writers[-1]):  # both stopped cleanly on SIGTERM
        assert proc.proc.returncode == 0, "\n".join(proc.output[-80:])
    assert "Traceback" not in "\n".join(web.output + writers[-1].output), \
        "\n".join(web.output[-80:] + writers[-1].output[-80:])

    # Every write answered 201, with a different message, and the fault really hit the load.
    assert all(w.body is not None for w in writes)
    ids = {w.n: w.body["message"]["id"] for w in writes if w.body is not None}
    assert len(set(ids.values())) == WRITES
    statuses = {a for w in writes for a in w.attempts}
    assert 500 not in statuses, statuses
    # The kill caught writes in flight: with no writer they failed, and were retried.
    assert any(w.retried for w in writes), "no write failed while the writer was dead"

    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("select id, content from messages where content like 'w-%'")
        changes = await conn.fetch("select sequence, type, message_id from changes")
    finally:
        await conn.close()
    stored: dict[str, list[str]] = {}
    for row in rows:
        stored.setdefault(row["content"], []).append(str(row["id"]))
    doubled = {c: i for c, i in stored.items() if len(i) > 1}
    assert not doubled, f"written more than once: {doubled}"
    missing = [w.n for w in writes if w.content not in stored]
    assert not missing, f"answered 201 but not stored: {missing}"
    assert len(rows) == WRITES
    # Each 201, first-time or replayed after a retry, names the row that is stored.
    wrong = [(w.n, w.attempts, ids[w.n], stored[w.content]) for w in writes if [ids[w.n]] != stored[w.content]]
    assert not wrong, f"201 bodies naming another message than the stored one: {wrong[:10]}"
    appended = [str(c["message_id"]) for c in changes if c["type"] == "message.appended"]
    assert sorted(appended) == sorted(ids.values()), "not exactly one message.appended per message"
    sequences = {str(c["message_id"]): c["sequence"] for c in changes if c["type"] == "message.appended"}
    assert all(w.body is not None and w.body["sequence"] == sequences[ids[w.n]] for w in writes)


async def _run_killed_load(base: str, env: dict[str, str], writers: list[procs.NodeProcess]) -> list[Write]:
    """Run the load; SIGKILL the writer once KILL_AFTER writes succeeded, then start a new one."""
    connector = aiohttp.TCPConnector(limit=CLIENTS * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        agents = [await register(session, base, f"loader-{i}-{uuid.uuid4().hex[:6]}") for i in range(4)]
        async with session.post(base + "/conversations", json={"subject": "under fire", "content": "root"},
                                headers=agents[0].headers(str(uuid.uuid4()))) as resp:
            body = await _json(resp)
            assert resp.status == 201, body
        url = f"{base}/conversations/{body['conversation']['id']}/messages"

        async def inject_fault(load: Load) -> None:
            await until(lambda: load.created >= KILL_AFTER, 120, f"{KILL_AFTER} writes succeeded")
            load.failed.clear()
            writers[0].signal(signal.SIGKILL)  # a real kill -9: no shutdown, no acks, no replies
            assert await writers[0].wait(timeout=30) == -signal.SIGKILL
            # Writes are in flight (the load is concurrent); with no writer they must fail (504 at
            # COMMAND_TIMEOUT) before a new writer may pick them up. Waiting for that makes sure
            # the client's retries are exercised, whatever the new writer's start-up time.
            async with asyncio.timeout(COMMAND_TIMEOUT + 30):
                await load.failed.wait()
            writers.append(await procs.start("run", "writer", env=env))
            await writers[-1].wait_for_line(WRITER_STARTED, timeout=60)

        writes = await run_load(session, url, agents, WRITES, CLIENTS, inject_fault)
        assert len(writers) == 2, "the load ended before the writer was killed"
        return writes


# --- PostgreSQL stopped -------------------------------------------------------------------------


_LEAKS = re.compile(r"Traceback|File \"|asyncpg|psycopg|select |insert |\.s\.PGSQL|/tmp/|postgresql://",
                    re.IGNORECASE)


@dataclass(slots=True)
class InProcess:
    """Web front and writer in the test process on the test's own embedded PostgreSQL."""

    client: TestClient
    db: Database

    async def post(self, agent: Agent, path: str, body: Any, token: str) -> tuple[int, Any, str]:
        resp = await self.client.post(path, json=body, headers=agent.headers(token))
        text = await resp.text()
        return resp.status, (orjson.loads(text) if text else None), text


@contextlib.asynccontextmanager
async def in_process_stack(dsn: str, amqp_url: str | None) -> AsyncIterator[InProcess]:
    """Like the ``stack`` fixture, on ``dsn`` (whose server the test stops and starts itself)."""
    env = {**STACK_ENV, "TOASTMACHINE_COMMAND_TIMEOUT": "5"}
    async with running_stack(dsn, amqp_url, env) as stack:
        yield InProcess(client=stack.client, db=stack.db)


@pytest.mark.timeout(180)
async def test_postgres_stopped_answers_503_then_recovers(tmp_path: Path, bus_backend: str | None) -> None:
    # A server of this test's own: stopping it disturbs no other test.
    servers: list[EmbeddedPostgres] = [await start_embedded(tmp_path / "db")]
    try:
        async with in_process_stack(servers[0].dsn, bus_backend) as stack:
            resp = await stack.client.post("/register", json={"name": f"patient-{uuid.uuid4().hex[:8]}"})
            registered = await resp.json()
            assert resp.status == 201, registered
            agent = Agent(registered["agent_id"], registered["name"], registered["credential"])
            assert (await stack.client.get("/guide", headers=agent.headers())).status == 200
            status, created, _ = await stack.post(agent, "/conversations",
                                                  {"subject": "outage", "content": "before"}, str(uuid.uuid4()))
            assert status == 201, created
            path = f"/conversations/{created['conversation']['id']}/messages"

            await servers[0].stop()  # pg_ctl stop: the postgres processes exit
            token, body = str(uuid.uuid4()), {"content": "written across the outage"}
            # Each identical attempt answers 503 with the retry guidance; and so does any other write.
            outage = [await stack.post(agent, path, body, token) for _ in range(5)]
            outage.append(await stack.post(agent, "/conversations", {"subject": "s", "content": "c"},
                                           str(uuid.uuid4())))
            for status, reply, text in outage:
                assert status == 503, (status, text)
                assert set(reply) == {"error"}, text
                error = reply["error"]
                assert error["code"] in ("database_unavailable", "service_unavailable"), text
                assert error["message"], text
                assert re.search(r"\bretry\b", error["how_to_proceed"], re.IGNORECASE), text
                assert not _LEAKS.search(text), text

            servers.append(await start_embedded(tmp_path / "db"))
            assert servers[-1].dsn == servers[0].dsn  # same data directory, same socket: same DSN
            # The pool reconnects lazily: retry the identical request until it goes through.
            seen: list[int] = []
            async with asyncio.timeout(60):
                while True:
                    status, reply, text = await stack.post(agent, path, body, token)
                    seen.append(status)
                    if status == 201:
                        break
                    assert status == 503, (status, text)
                    await asyncio.sleep(0.2)
            assert reply["message"]["content"] == body["content"]
            rows = await stack.db.pool.fetch("select id from messages where content = $1", body["content"])
            assert [str(r["id"]) for r in rows] == [reply["message"]["id"]]
            appended = await stack.db.pool.fetchval(
                "select count(*) from changes where type = 'message.appended' and message_id = $1", rows[0]["id"])
            assert appended == 1
            # And again: the token's write is stored; a replay answers it without writing anything.
            status, again, _ = await stack.post(agent, path, body, token)
            assert (status, again) == (201, reply)
            assert await stack.db.pool.fetchval("select count(*) from messages where content = $1",
                                                body["content"]) == 1
    finally:
        for server in servers:
            await server.stop()


@pytest.mark.timeout(180)
async def test_postgres_stopped_mid_load_answers_only_503_and_loses_nothing(
        tmp_path: Path, bus_backend: str | None) -> None:
    """The server stops while writes are in the writer's transactions: still 503s, never a 500."""
    servers: list[EmbeddedPostgres] = [await start_embedded(tmp_path / "db")]
    try:
        async with in_process_stack(servers[0].dsn, bus_backend) as stack, \
                aiohttp.ClientSession() as session:
            base = str(stack.client.make_url("")).rstrip("/")
            agents = [await register(session, base, f"steady-{i}-{uuid.uuid4().hex[:6]}") for i in range(2)]
            status, created, _ = await stack.post(agents[0], "/conversations", {"subject": "s", "content": "c"},
                                                  str(uuid.uuid4()))
            assert status == 201, created
            url = f"{base}/conversations/{created['conversation']['id']}/messages"
            async def inject_fault(load: Load) -> None:
                await until(lambda: load.created >= 100, 60, "100 writes succeeded")
                load.failed.clear()
                await servers[0].stop()
                async with asyncio.timeout(30):
                    await load.failed.wait()
                servers.append(await start_embedded(tmp_path / "db"))

            # Until the fault: the 300 writes after the first 100 may all be done before the server stops.
            writes = await run_load(session, url, agents, 400, 8, inject_fault, until_fault=True)
            assert len(servers) == 2, "the load ended before the server was stopped"

            assert any(w.retried for w in writes), "no write failed while the server was down"
            rows = await stack.db.pool.fetch("select id, content from messages where content like 'w-%'")
            stored: dict[str, list[str]] = {}
            for row in rows:
                stored.setdefault(row["content"], []).append(str(row["id"]))
            assert {w.content: [w.body["message"]["id"]] for w in writes if w.body is not None} == stored
            assert len(rows) == len(writes)
            # Last, so that a failure here also says the writes themselves came through intact.
            internal = [(w.n, w.attempts, w.failures) for w in writes if 500 in w.attempts]
            assert not internal, f"500s while PostgreSQL was stopped: {internal}"
            assert {a for w in writes for a in w.attempts} <= {201, 503}
    finally:
        for server in servers:
            await server.stop()


@contextlib.asynccontextmanager
async def _partitionable_database(database_url: str) -> AsyncIterator[tuple[Any, Database, Database]]:
    """(proxy, direct, through): two pools on ``database_url``, the second through a TCP hop whose
    ``freeze()`` is a real partition (the connections stay open, nothing gets through)."""
    from urllib.parse import urlsplit

    from tests.tcp_proxy import TcpProxy

    server = urlsplit(database_url)
    proxy = TcpProxy(server.hostname or "127.0.0.1", server.port or 5432)
    await proxy.up()
    direct = await Database.connect(database_url, min_size=1, max_size=2)
    through = await Database.connect(database_url.replace(server.netloc, f"{server.netloc.rpartition('@')[0]}"
                                                                         f"@127.0.0.1:{proxy.port}"),
                                     min_size=1, max_size=2)
    try:
        yield proxy, direct, through
    finally:
        proxy.thaw()
        await through.close(timeout=5)
        await direct.close()
        await proxy.down()


async def test_a_database_that_stops_answering_mid_batch_is_answered_503_and_the_writer_recovers(
        bus: Bus, database_url: str) -> None:
    """A real partition between the writer and PostgreSQL (a TCP hop that drops everything while the
    connection stays open): a batch caught in it is abandoned after the writer's batch timeout and
    its command answered 503 ``database_unavailable``, instead of holding the worker (and every
    command behind it) for ever; once the network is back, the same token is applied exactly once."""
    from actors.writer import CorpusWriter
    from infra.bus.base import COMMANDS_EXCHANGE
    from infra.db import apply_migrations, ensure_identity
    from protocol.commands import WriteCommand, WriteResult
    from protocol.messages import ErrorReply

    async with _partitionable_database(database_url) as (proxy, direct, through):
        await apply_migrations(direct)
        identity = await ensure_identity(direct, None, None)
        author = uuid.uuid4()
        await direct.pool.execute("insert into agents (agent_id, name, credential_hash) values ($1, 'cut', $2)",
                                  author, author.bytes * 2)
        writer = CorpusWriter(bus, node_id="w", db=through, identity=identity, batch_timeout=1.0)
        await writer.start()

        async def write(token: str) -> object:
            command = WriteCommand(operation="conversation.create", target=None,
                                   body={"subject": "across a partition", "content": "c"},
                                   author_id=str(author), author_name="cut", token=token)
            reply = await bus.request(COMMANDS_EXCHANGE, identity.scope.command_key(command.operation), command,
                                      timeout=60, headers=identity.scope.headers())
            return reply.message

        try:
            assert isinstance(await write("before"), WriteResult)
            proxy.freeze()
            cut = await write("during")
            assert isinstance(cut, ErrorReply) and (cut.status, cut.code) == (503, "database_unavailable"), cut
            proxy.thaw()
            again = await write("during")  # the client's retry with the same token
            assert isinstance(again, WriteResult) and again.status == 201, again
            assert await direct.pool.fetchval(
                "select count(*) from operations where token = 'during' and status = 201") == 1
            assert await direct.pool.fetchval("select count(*) from changes") == 2
        finally:
            proxy.thaw()
            await writer.stop(grace=2)


async def test_a_database_that_stops_answering_does_not_stop_the_streams_heartbeats(
        bus: Bus, database_url: str) -> None:
    """The notification hub's ticker is every stream's heartbeat and stuck-write watchdog, and on a
    quiet corpus it also asks the database for the publisher's cursor (a lost last batch). Through
    a real partition (a TCP hop that drops everything while the connection stays open) that
    question gets no answer: the heartbeats must go on regardless, and the check resumes after."""
    from actors.hub import HEARTBEAT, NotificationHub
    from infra.db import apply_migrations, ensure_identity

    async with _partitionable_database(database_url) as (proxy, direct, through):
        await apply_migrations(direct)
        identity = await ensure_identity(direct, None, None)
        hub = NotificationHub(bus, through, scope=identity.scope, node_id="partitioned", heartbeat=0.1)
        await hub.start()
        try:
            async with hub.subscribe() as sub:
                proxy.freeze()
                beats = 0
                async with asyncio.timeout(10):
                    while beats < 20:  # 2 s of heartbeats: many tail checks would have hung by now
                        items = await sub.take(100)
                        assert items is not None
                        beats += sum(item == HEARTBEAT for item in items)
                assert not sub.closed
                proxy.thaw()
        finally:
            proxy.thaw()
            await hub.close()
