"""A whole write path in the test process: web front (ingress) → bus → corpus writer → database.

``stack`` runs each test twice: on the embedded PostgreSQL with the in-process bus (what
``toastmachine up`` runs), and on the real PostgreSQL with RabbitMQ (what production runs). Each run
gets a fresh database. Clients talk to the front over real HTTP (aiohttp's TestServer).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from actors.history import changes_after
from actors.web.app import make_app
from actors.writer import CorpusWriter
from infra.bus import make_bus
from infra.bus.base import Bus
from infra.config import Settings
from infra.db import CorpusIdentity, Database, apply_migrations, ensure_identity
from infra.ratelimit import write_budget
from tests.db_fixtures import fresh_database
from tests.webclient import serve, test_node

__all__ = ["Agent", "Stack", "follow_history", "publishing", "running_stack", "stack", "stack_backends"]


@dataclass(slots=True)
class Agent:
    """A registered agent as a test client holds it."""

    agent_id: str
    name: str
    credential: str

    def headers(self, token: str | None = None, **extra: str) -> dict[str, str]:
        """Authorization (and Operation-Token, when given) headers for this agent."""
        out = {"Authorization": f"Bearer {self.credential}"}
        if token is not None:
            out["Operation-Token"] = token
        out.update(extra)
        return out


@dataclass(slots=True)
class Reply:
    """An HTTP answer: status, decoded JSON body, headers."""

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Stack:
    """The running write path of one test."""

    client: TestClient
    db: Database
    bus: Bus
    writer: CorpusWriter
    identity: CorpusIdentity

    async def register(self, name: str | None = None, *, onboard: bool = True) -> Agent:
        """Register an agent over HTTP (and read the guide with it, unless ``onboard`` is False)."""
        name = name or f"agent-{uuid.uuid4().hex[:10]}"
        resp = await self.client.post("/register", json={"name": name})
        body = await resp.json()
        assert resp.status == 201, body
        agent = Agent(agent_id=body["agent_id"], name=body["name"], credential=body["credential"])
        if onboard:
            resp = await self.client.get("/guide", headers=agent.headers())
            assert resp.status == 200, await resp.text()
        return agent

    async def post(self, agent: Agent | None, path: str, body: Any = None, *, token: str | None = "auto",
                   headers: dict[str, str] | None = None, data: bytes | None = None) -> Reply:
        """POST ``body`` as JSON to ``path`` as ``agent``; ``token="auto"`` sends a fresh Operation-Token."""
        send: dict[str, str] = {}
        if agent is not None:
            send.update(agent.headers(str(uuid.uuid4()) if token == "auto" else token))
        send.update(headers or {})
        if data is None:
            resp = await self.client.post(path, json=body, headers=send)
        else:
            resp = await self.client.post(path, data=data, headers=send)
        text = await resp.text()
        try:
            import orjson

            decoded = orjson.loads(text) if text else None
        except orjson.JSONDecodeError:
            decoded = text
        return Reply(resp.status, decoded, dict(resp.headers))

    async def conversation(self, agent: Agent, subject: str = "a subject", **message: Any) -> dict[str, Any]:
        """Create a conversation and return the 201 body."""
        reply = await self.post(agent, "/conversations", {"subject": subject, **(message or {"content": "hi"})})
        assert reply.status == 201, reply.body
        return reply.body  # type: ignore[no-any-return]

    async def message(self, agent: Agent, conversation_id: str, **message: Any) -> dict[str, Any]:
        """Append a message and return the 201 body."""
        reply = await self.post(agent, f"/conversations/{conversation_id}/messages", message)
        assert reply.status == 201, reply.body
        return reply.body  # type: ignore[no-any-return]


async def follow_history(db: Database, done: asyncio.Event, seen: list[int]) -> None:
    """Follow the change history as a mirror does (``after=<last seen>``), appending every sequence
    to ``seen``, until ``done`` is set and one more pass finds nothing new."""
    after = 0
    while True:
        finished = done.is_set()  # read the flag *before* the query: one more pass after the end
        page = await changes_after(db, after)
        for change in page:
            seen.append(change.sequence)
            after = change.sequence
        if finished and not page:
            return
        if not page:
            await asyncio.sleep(0)  # yield to the writers; the loop itself is the synchronisation


@contextlib.asynccontextmanager
async def publishing(stack: Stack, *, poll_interval: float = 0.2) -> AsyncIterator[None]:
    """The event publisher on the stack's bus and database, running for the block."""
    from actors.publisher import EventPublisher

    publisher = EventPublisher(stack.bus, stack.db, identity=stack.identity, node_id="test-publisher", poll_interval=poll_interval)
    await publisher.start()
    try:
        yield
    finally:
        await publisher.stop(grace=2)


@pytest.fixture(params=["local", pytest.param("services", marks=[pytest.mark.rabbitmq, pytest.mark.postgres])])
def stack_backends(request: pytest.FixtureRequest) -> tuple[str | None, str]:
    """(AMQP URL or None for the in-process bus, DSN of a PostgreSQL server's maintenance database)."""
    if request.param == "local":
        return None, request.getfixturevalue("embedded_postgres").dsn
    return request.getfixturevalue("rabbitmq_url"), request.getfixturevalue("postgres_url")


#: Settings of a test stack: generous admission unless a test sets its own (marker ``stack_env``).
STACK_ENV = {"TOASTMACHINE_WRITES_PER_SECOND": "100000", "TOASTMACHINE_REGISTER_PER_MINUTE": "100000"}


@pytest.fixture
async def stack(stack_backends: tuple[str | None, str], request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """Web front + corpus writer on a fresh database, over the backend pair under test."""
    amqp_url, server = stack_backends
    marker = request.node.get_closest_marker("stack_env")
    env = {**STACK_ENV, **(marker.kwargs if marker else {})}
    # A migrated clone: running_stack's apply_migrations then finds nothing to do.
    async with fresh_database(server, migrated=True) as dsn, running_stack(dsn, amqp_url, env) as running:
        yield running


@contextlib.asynccontextmanager
async def running_stack(dsn: str, amqp_url: str | None, env: dict[str, str]) -> AsyncIterator[Stack]:
    """Web front + corpus writer on the database at ``dsn`` (migrated here) and the bus at
    ``amqp_url`` (None: in-process), with settings from ``env``."""
    db = await Database.connect(dsn, min_size=1, max_size=8, connect_timeout=10)
    bus = make_bus(amqp_url)
    try:
        await apply_migrations(db)
        identity = await ensure_identity(db, None, None)
        await bus.connect()
        budget = write_budget(Settings.from_env(env).writes_per_second)
        writer = CorpusWriter(bus, node_id="test-writer", db=db, identity=identity, write_budget=budget)
        await writer.start()
        try:
            async with serve(make_app(test_node(db, bus, env, identity=identity))) as client:
                yield Stack(client=client, db=db, bus=bus, writer=writer, identity=identity)
        finally:
            await writer.stop(grace=5)
    finally:
        await bus.close()
        await db.close()
