"""Following the corpus with every role scaled out as real OS processes, under real faults.

The processes are started from the Procfile's own command lines (``sh -c '<command>'``, so
``exec`` leaves the ``toastmachine`` process itself to receive the signals), against PostgreSQL (a
fresh database) and RabbitMQ (a virtual host of this run's own), like a deployment on one machine.

What a follower must see, whatever fails in between (README, "Following the corpus"):

- an SSE client on any web node, resuming with ``Last-Event-ID`` when its connection drops, gets
  every sequence of the history exactly once, in order;
- a durable queue of its own bound to ``tm.events`` gets every change committed after the binding
  at least once (duplicates allowed, losses not), also across a take-over between publishers and a
  restart of the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import asyncpg
import orjson
import pytest

from actors.publisher import application_name
from tests import procs
from tests.broker import broker_restarted
from tests.corpus_fixtures import Agent
from tests.deployment import COMMAND_TIMEOUT, WAIT, deployment
from tests.sse import frames

#: Messages in each load, and concurrent client tasks sending them.
MESSAGES = 600
CLIENTS = 16
#: Seconds a whole write (all its retries) may take.
WRITE_DEADLINE = 120.0
#: Longest the broker may stay stopped waiting for a write to fail against it (it is everyone's).
OUTAGE = 20.0


async def until(predicate: Callable[[], Awaitable[bool] | bool], what: str, timeout: float = WAIT) -> None:
    """For conditions nothing signals (another process's state): poll until true, fail after ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                result = predicate()
                if await result if isinstance(result, Awaitable) else result:
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


def logged(proc: procs.NodeProcess, event: str) -> bool:
    return any(event in line for line in proc.output)


async def history(database_url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return list(await conn.fetch("select sequence, type from changes order by sequence"))
    finally:
        await conn.close()


# --- followers ----------------------------------------------------------------------------------


@dataclass
class Followed:
    """What one follower applied, in arrival order, with a wake-up for each arrival."""

    sequences: list[int] = field(default_factory=list)
    #: Anything wrong in what arrived (envelope not matching its id or routing key, ...).
    problems: list[str] = field(default_factory=list)
    #: The corpus of each arrival (durable queues), beside its sequence.
    corpus_ids: list[str] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, sequence: int) -> None:
        self.sequences.append(sequence)
        self._changed.set()

    async def until_covers(self, expected: list[int], what: str, timeout: float = WAIT) -> None:
        want = set(expected)
        try:
            async with asyncio.timeout(timeout):
                while not want <= set(self.sequences):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            missing = sorted(want - set(self.sequences))
            raise AssertionError(f"not within {timeout}s: {what}; {len(missing)} missing, first "
                                 f"{missing[:20]}; received {len(self.sequences)}") from None


@dataclass
class SseFollower(Followed):
    """An SSE client of one web node: ``?after=0`` once, then ``Last-Event-ID`` after any drop."""

    base: str = ""
    #: When set, every envelope must belong to this corpus (several corpora may share the broker).
    corpus_id: str = ""
    connections: int = 0
    #: Why each connection ended (dropped, ``stream-error``, bad status), for failure messages.
    endings: list[str] = field(default_factory=list)

    async def run(self, session: aiohttp.ClientSession) -> None:
        last: int | None = None
        while True:
            query, headers = ("?after=0", {}) if last is None else ("", {"Last-Event-ID": str(last)})
            self.connections += 1
            try:
                async with session.get(self.base + "/corpus/stream" + query, headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=None, connect=10)) as resp:
                    if resp.status != 200:
                        self.endings.append(f"status {resp.status}: {await resp.text()}")
                    else:
                        async for frame in frames(resp):
                            if frame.event == "stream-error":
                                self.endings.append(f"stream-error {frame.data}")
                                break
                            if frame.id is None:
                                continue
                            sequence = int(frame.id)
                            envelope = frame.json()
                            if envelope["sequence"] != sequence or envelope["type"] != frame.event or \
                                    (self.corpus_id and envelope["corpus_id"] != self.corpus_id):
                                self.problems.append(f"frame {frame.id} {frame.event}: {frame.data[:200]}")
                            last = sequence
                            self.add(sequence)
                        else:
                            self.endings.append("stream ended")
            except (aiohttp.ClientError, TimeoutError) as e:
                self.endings.append(repr(e))
            await asyncio.sleep(0.2)  # reconnect backoff (the stream's own `retry:` asks for 3 s)


@contextlib.asynccontextmanager
async def sse_followers(urls: list[str], corpus_ids: list[str] | None = None) -> AsyncIterator[list[SseFollower]]:
    followers = [SseFollower(base=url, corpus_id=corpus) for url, corpus in zip(urls, corpus_ids or [""] * len(urls),
                                                                                strict=True)]
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(f.run(session)) for f in followers]
        try:
            yield followers
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def durable_queue(amqp_url: str, pattern: str, exchange_name: str = "tm.events",
                        corpus_id: str = "") -> AsyncIterator[Followed]:
    """A durable quorum queue of the test's own bound to ``exchange_name`` (``tm.events``: every
    corpus; ``tm.events.<corpus_id>``: one), consumed with manual acks (ack after recording) over a
    robust connection; deleted afterwards. With ``corpus_id``, an event of another corpus is a problem."""
    received = Followed()
    connection = await aio_pika.connect_robust(amqp_url, reconnect_interval=0.5,
                                             client_properties={"connection_name": "test:scale-out"})
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=200)
        exchange = await channel.declare_exchange(exchange_name, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(f"test.scale-out.{uuid.uuid4().hex[:12]}", durable=True,
                                            arguments={"x-queue-type": "quorum"})
        await queue.bind(exchange, pattern)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process(requeue=True):
                envelope = orjson.loads(message.body)
                sequence = int(envelope["sequence"])
                routing_key = message.routing_key or ""
                if routing_key != f"{envelope['type']}.{envelope['partition']}" or \
                        (message.headers or {}).get("x-corpus-sequence") != sequence or \
                        (corpus_id and (envelope["corpus_id"], (message.headers or {}).get("x-corpus-id"))
                         != (corpus_id, corpus_id)):
                    received.problems.append(f"{routing_key} {message.headers}: {message.body[:200]!r}")
                received.corpus_ids.append(str(envelope["corpus_id"]))
                received.add(sequence)

        tag = await queue.consume(on_message, no_ack=False)
        yield received
        await queue.cancel(tag)
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()


# --- the load -----------------------------------------------------------------------------------


@dataclass
class Load:
    """Progress of the load, watched (and held open) by the fault injector."""

    #: Writes started and writes answered 201.
    issued: int = 0
    created: int = 0
    #: While set, the clients keep writing past ``MESSAGES``: a fault injected late still lands
    #: mid-load, however fast the load runs.
    holding: bool = False
    #: Status of every failed attempt (or the client error's name).
    failures: list[int | str] = field(default_factory=list)
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self) -> bool:
        """Whether a client should start another write (and count it as started)."""
        if self.issued >= MESSAGES and not self.holding:
            return False
        self.issued += 1
        return True


async def post_until_created(session: aiohttp.ClientSession, url: str, agent: Agent, body: Any,
                             load: Load) -> dict[str, Any]:
    """The client's retry policy: the identical request with the same token on 503/504, a dropped
    connection or a timeout, until 201. Anything else (a 500 included) fails the test."""
    token = str(uuid.uuid4())
    deadline = time.monotonic() + WRITE_DEADLINE
    attempt = 0
    while True:
        try:
            async with session.post(url, json=body, headers=agent.headers(token),
                                    timeout=aiohttp.ClientTimeout(total=COMMAND_TIMEOUT + 10)) as resp:
                text = await resp.text()
                if resp.status == 201:
                    return orjson.loads(text)  # type: ignore[no-any-return]
                assert resp.status in (503, 504), f"POST {url}: {resp.status} {text}"
                load.failures.append(resp.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            load.failures.append(type(e).__name__)
        load.failed.set()
        assert time.monotonic() < deadline, f"POST {url} never answered 201; failures: {load.failures[-10:]}"
        await asyncio.sleep(min(0.5, 0.05 * 2 ** attempt))  # retry backoff
        attempt += 1


async def register(session: aiohttp.ClientSession, base: str) -> Agent:
    async with session.post(base + "/register", json={"name": f"scale-{uuid.uuid4().hex[:10]}"}) as resp:
        body = await resp.json()
        assert resp.status == 201, body
    agent = Agent(agent_id=body["agent_id"], name=body["name"], credential=body["credential"])
    async with session.get(base + "/guide", headers=agent.headers()) as resp:
        assert resp.status == 200, await resp.text()
    return agent


async def run_load(session: aiohttp.ClientSession, bases: list[str], load: Load) -> None:
    """At least ``MESSAGES`` messages (more while ``load.holding``) from ``CLIENTS`` concurrent
    clients, each in a conversation of its own, each write going to the next web node in turn."""
    agents = await asyncio.gather(*(register(session, bases[i % len(bases)]) for i in range(CLIENTS)))

    async def client(i: int, agent: Agent) -> None:
        created = await post_until_created(session, bases[i % len(bases)] + "/conversations", agent,
                                           {"subject": f"scale-out {i}", "content": "go"}, load)
        path = f"/conversations/{created['conversation']['id']}/messages"
        n = 0
        while load.take():
            await post_until_created(session, bases[(i + n) % len(bases)] + path, agent,
                                     {"content": f"c{i}-{n}"}, load)
            load.created += 1
            n += 1

    async with asyncio.TaskGroup() as tasks:
        for i, agent in enumerate(agents):
            tasks.create_task(client(i, agent))


async def until_created(load: Load, count: int, loader: asyncio.Task[None]) -> None:
    async def reached() -> bool:
        if loader.done():
            loader.result()  # raises the load's failure
            raise AssertionError(f"the load ended before {count} writes")
        return load.created >= count
    await until(reached, f"{count} writes created", timeout=120)


@contextlib.asynccontextmanager
async def running_load(session: aiohttp.ClientSession, urls: list[str], load: Load) -> AsyncIterator[asyncio.Task[None]]:
    """The held-open load as a task for the block. When the block ends, the load is released and
    finished (its final assertions follow); when the block fails, the load is cancelled."""
    loader = asyncio.create_task(run_load(session, urls, load))
    try:
        yield loader
        load.holding = False
        await loader
    finally:
        if not loader.done():
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)


def assert_stream_exact(follower: SseFollower, expected: list[int]) -> None:
    deduped = list(dict.fromkeys(follower.sequences))
    where = f"{follower.base} ({follower.connections} connections; endings {follower.endings[-5:]})"
    assert deduped == expected, f"{where}: missing {sorted(set(expected) - set(deduped))[:20]}, " \
                                f"out of order or extra: {[s for s in deduped if s not in set(expected)][:20]}"
    duplicates = len(follower.sequences) - len(deduped)
    assert duplicates == 0, f"{where}: the stream repeated {duplicates} sequences"
    assert not follower.problems, follower.problems[:5]


# Every test here runs the Procfile's processes against the real broker and database and injects faults.
pytestmark = [pytest.mark.fault, pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.timeout(300)]

# --- tests --------------------------------------------------------------------------------------


async def test_scale_out_two_of_each_every_follower_gets_every_change(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
        # Writers first: a web front's first write needs the writer's queue.
        for name in ("writer-a", "writer-b"):
            await dep.start("writer", name)
        for name in ("web-a", "web-b"):
            await dep.start("web", name)
        assert len(set(dep.urls.values())) == 2
        publishers = {name: await dep.start("publisher", name) for name in ("pub-a", "pub-b")}

        # Exactly one is active; the other says it stands by.
        await until(lambda: any(logged(p, "publisher.active") for p in publishers.values()),
                    "a publisher active")
        active = next(n for n, p in publishers.items() if logged(p, "publisher.active"))
        standby = next(n for n in publishers if n != active)
        await publishers[standby].wait_for_line(r"publisher\.standby", timeout=WAIT)
        assert not logged(publishers[standby], "publisher.active")
        assert await dep.holder() == application_name(active)

        async with durable_queue(rabbitmq_url, "message.appended.*") as queued, \
                sse_followers(list(dep.urls.values())) as followers, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CLIENTS * 2)) as session:
            load = Load(holding=True)  # held open until the standby publishes
            async with running_load(session, list(dep.urls.values()), load) as loader:
                await until_created(load, MESSAGES // 3, loader)
                await until(lambda: len(queued.sequences) > 0, "events queued before the kill")
                publishers[active].signal(signal.SIGKILL)
                assert await publishers[active].wait(timeout=WAIT) == -signal.SIGKILL
                killed_at = load.created
                # The standby notices within about its retry interval and takes over, and the
                # writes committed since the kill reach the queue through it.
                await publishers[standby].wait_for_line(r"publisher\.active", timeout=WAIT)
                assert await dep.holder() == application_name(standby)
                await until_created(load, killed_at + 100, loader)
                await until(lambda: len(set(queued.sequences)) > killed_at + 50,
                            "the standby publishing writes made after the kill")
            assert load.created == load.issued >= MESSAGES

            rows = await history(database_url)
            everything = [r["sequence"] for r in rows]
            messages = [r["sequence"] for r in rows if r["type"] == "message.appended"]
            assert len(messages) == load.created
            for follower in followers:
                await follower.until_covers(everything, f"SSE on {follower.base} has every change")
            await queued.until_covers(messages, "the durable queue has every message.appended")
            for follower in followers:
                assert_stream_exact(follower, everything)
            assert sorted(set(queued.sequences)) == messages
            assert not queued.problems, queued.problems[:5]


@pytest.mark.exclusive  # rabbitmqctl stop_app: the broker goes away for every test on the machine
async def test_broker_restart_during_load_loses_nothing_for_a_durable_queue(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
        await dep.start("writer", "writer-a")
        await dep.start("web", "web-a")
        publisher = await dep.start("publisher", "pub-a")
        await publisher.wait_for_line(r"publisher\.active", timeout=WAIT)

        async with durable_queue(rabbitmq_url, "#") as queued, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CLIENTS * 2)) as session:
            load = Load(holding=True)  # held open until writes succeed again after the restart
            async with running_load(session, list(dep.urls.values()), load) as loader:
                await until_created(load, MESSAGES // 3, loader)
                load.failed.clear()
                # Stops the broker for everyone on this machine: keep the outage short (until a
                # write has failed against it) and always bring the broker back.
                async with broker_restarted(rabbitmq_url), asyncio.timeout(OUTAGE):
                    await load.failed.wait()
                restarted_at = load.created
                await until_created(load, restarted_at + 100, loader)
            assert load.created == load.issued >= MESSAGES
            assert load.failures, "no write saw the outage"

            rows = await history(database_url)
            everything = [r["sequence"] for r in rows]
            assert len([r for r in rows if r["type"] == "message.appended"]) == load.created
            head = everything[-1]

            async def cursor_at_head() -> bool:
                conn = await asyncpg.connect(database_url)
                try:
                    return int(await conn.fetchval("select sequence from publisher_cursor")) >= head
                finally:
                    await conn.close()

            await until(cursor_at_head, f"the publisher's cursor reaches the head {head}")
            await queued.until_covers(everything, "the durable queue has every change")
            assert sorted(set(queued.sequences)) == everything
            assert not queued.problems, queued.problems[:5]
            # The same publisher resumed on its own (no restart, no second active period).
            assert publisher.proc.returncode is None
            assert await dep.holder() == application_name("pub-a")
