"""Resource-updated notifications of the MCP front, with the SDK's own client and its OAuth provider.

A 2026-07-28 client listens (``subscriptions/listen``) and a 2025-11-25 client subscribes
(``resources/subscribe``, notified on its session's stream) to ``toastmachine://corpus`` and
``toastmachine://guide`` on an MCP process, while writes go through the HTTP API of another web
process on the same RabbitMQ and PostgreSQL (the Procfile's processes), and the operator changes the
guide with the CLI. Also: a RabbitMQ restart while both listen (they keep receiving on the same
streams); and on the embedded node of ``toastmachine up``: a burst of writes coalesced into a few
hints that ``get_changes`` turns back into every change, a SIGTERM with streams open (they end
gracefully and the node does not wait out its grace period), and a write-only token refused.

``test_broker_restart_while_listening_keeps_notifying`` stops and starts the shared RabbitMQ
(``rabbitmqctl stop_app`` / ``start_app``) for everyone on the machine, like test_scale_out's restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import httpx2
import orjson
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer
from mcp.server.subscriptions import InMemorySubscriptionBus
from mcp.shared.exceptions import MCPDeprecationWarning, MCPError
from mcp.shared.subscriptions import ResourceUpdated
from mcp_types import ResourceUpdatedNotification, TextResourceContents

from actors.mcp.app import ToolDeps, build_app
from actors.mcp.app import register_tools as register_minimal_tools
from actors.mcp.front import make_server
from actors.mcp.grants import current_grant
from actors.mcp.notify import DEFAULT_MIN_INTERVAL, LegacySubscriptions, ScopedListen, register_subscriptions
from infra.config import Settings
from infra.db.pool import Database
from tests import procs
from tests.broker import broker_restarted
from tests.corpus_fixtures import Agent
from tests.deployment import WAIT, Deployment, deployment
from tests.sse import frames
from tests.test_mcp_oauth import _INIT, _MCP_HEADERS, _free_port, _tokens, sdk_oauth_client
from tests.test_mcp_process import _up_urls
from tests.test_scale_out import logged, until

CORPUS = "toastmachine://corpus"
GUIDE = "toastmachine://guide"
#: Seconds a notification may take to arrive once its cause committed.
NOTIFIED_WITHIN = 30.0


@dataclass
class Inbox:
    """The resource URIs a client was notified of, in arrival order."""

    uris: list[str] = field(default_factory=list)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, uri: str) -> None:
        self.uris.append(uri)
        self._arrived.set()

    async def wait_for(self, uri: str, *, after: int, timeout: float = NOTIFIED_WITHIN) -> None:
        """Until ``uri`` is among the notifications past the first ``after``."""
        try:
            async with asyncio.timeout(timeout):
                while uri not in self.uris[after:]:
                    self._arrived.clear()
                    await self._arrived.wait()
        except TimeoutError:
            raise AssertionError(f"no notification for {uri} within {timeout}s (got {self.uris[after:]})") from None


@dataclass
class Subscriber:
    client: Client
    inbox: Inbox
    #: The listen stream's reader (2026-07-28 only): still running while the stream is open.
    reader: asyncio.Task[None] | None = None


def _client(mcp_url: str, http: httpx2.AsyncClient, **kw: Any) -> Client:
    return Client(streamable_http_client(mcp_url, http_client=http), **kw)


@contextlib.asynccontextmanager
async def listening(mcp_url: str, name: str) -> AsyncIterator[Subscriber]:
    """A 2026-07-28 client (negotiated by the SDK's probe) listening to both resources."""
    auth, _ = sdk_oauth_client(mcp_url, agent_name=name, client_name="listening client")
    async with httpx2.AsyncClient(auth=auth, timeout=60) as http, _client(mcp_url, http) as client:
        assert client.session.protocol_version == "2026-07-28"
        caps = client.session.server_capabilities
        assert caps is not None and caps.resources is not None and caps.resources.subscribe
        async with client.listen(resource_subscriptions=[CORPUS, GUIDE]) as sub:
            assert set(sub.honored.resource_subscriptions or ()) == {CORPUS, GUIDE}
            inbox = Inbox()

            async def read() -> None:
                async for event in sub:
                    inbox.add(event.uri)  # type: ignore[union-attr]

            reader = asyncio.create_task(read())
            try:
                yield Subscriber(client, inbox, reader)
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader


@contextlib.asynccontextmanager
async def subscribed(mcp_url: str, name: str) -> AsyncIterator[Subscriber]:
    """A 2025-11-25 client (the initialize handshake) subscribed to both resources."""
    inbox = Inbox()

    async def on_message(message: object) -> None:
        if isinstance(message, ResourceUpdatedNotification):
            inbox.add(str(message.params.uri))

    auth, _ = sdk_oauth_client(mcp_url, agent_name=name, client_name="subscribing client")
    async with httpx2.AsyncClient(auth=auth, timeout=60) as http, \
            _client(mcp_url, http, mode="legacy", message_handler=on_message) as client:
        assert client.session.protocol_version == "2025-11-25"
        caps = client.session.server_capabilities
        assert caps is not None and caps.resources is not None and caps.resources.subscribe
        for uri in (CORPUS, GUIDE):
            with pytest.warns(MCPDeprecationWarning):  # the SDK marks it as the older revision's way
                await client.subscribe_resource(uri)
        yield Subscriber(client, inbox)


# --- writing through the HTTP API ------------------------------------------------------------------

async def _author(http: httpx.AsyncClient, web: str) -> Agent:
    r = await http.post(web + "/register", json={"name": f"notify-{uuid.uuid4().hex[:8]}"})
    assert r.status_code == 201, r.text
    body = r.json()
    agent = Agent(agent_id=body["agent_id"], name=body["name"], credential=body["credential"])
    r = await http.get(web + "/guide", headers=agent.headers())
    assert r.status_code == 200, r.text
    return agent


async def _write(http: httpx.AsyncClient, web: str, agent: Agent, subject: str) -> int:
    """Create a conversation; retried with the same token on 503/504 or a dropped connection (a
    broker coming back). Its sequence."""
    token = str(uuid.uuid4())
    deadline = time.monotonic() + 120
    while True:
        try:
            r = await http.post(web + "/conversations", json={"subject": subject, "content": "hello"},
                                headers=agent.headers(token))
            if r.status_code == 201:
                return int(r.json()["sequence"])
            assert r.status_code in (503, 504), r.text
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"POST /conversations never answered 201 ({subject})"
        await asyncio.sleep(0.2)  # retry backoff


async def _notified_by_writes(inbox: Inbox, write: Callable[[], Awaitable[int]], *, tries: int = 3) -> None:
    """Write until ``inbox`` has a corpus notification after it.

    A 2025-11-25 client gets notifications on its session's GET stream, which the SDK's client
    opens in the background after the handshake; one announced before that stream opens is held
    and sent when it opens (see the in-process test below). Writing more than once stays harmless."""
    for attempt in range(tries):
        before = len(inbox.uris)
        await write()
        try:
            await inbox.wait_for(CORPUS, after=before, timeout=NOTIFIED_WITHIN / tries)
            return
        except AssertionError:
            if attempt == tries - 1:
                raise


async def _head(client: Client) -> int:
    result = await client.read_resource(CORPUS)
    contents = result.contents[0]
    assert isinstance(contents, TextResourceContents)
    return int(orjson.loads(contents.text)["head_sequence"])


async def _processes(dep: Deployment, **mcp_env: str) -> tuple[str, str]:
    """Writer, publisher, one web and one MCP process: the web's URL and the MCP URL."""
    await dep.start("writer", "writer-a")
    await dep.start("web", "web-a")
    publisher = await dep.start("publisher", "pub-a")
    await publisher.wait_for_line(r"publisher\.active", timeout=WAIT)
    await dep.start("mcp", "mcp-a", **mcp_env)
    return dep.urls["web-a"], dep.mcp_urls["mcp-a"]


async def _stop_promptly(node: procs.NodeProcess, *followers_end: Awaitable[object]) -> None:
    """SIGTERM an ``up`` node started with a 20 s grace period: every follower ends (awaited in
    order), and the node exits 0, without a traceback, well within the grace period."""
    started = time.monotonic()
    node.signal()
    async with asyncio.timeout(15):
        for end in followers_end:
            await end
    code = await node.wait(timeout=15)
    took = time.monotonic() - started
    assert code == 0, "\n".join(node.output)
    assert took < 10, took  # the grace period is 20 s
    assert not procs.unexpected_tracebacks(node.output), "\n".join(node.output)


# --- the tests -------------------------------------------------------------------------------------

async def test_a_write_on_another_web_node_and_a_new_guide_notify_both_revisions(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
        web, mcp_url = await _processes(dep, TOASTMACHINE_MCP_GUIDE_POLL="0.2")
        async with httpx.AsyncClient(timeout=30) as http, listening(mcp_url, "listener") as modern:
            async with subscribed(mcp_url, "subscriber") as legacy:
                agent = await _author(http, web)
                sequence = await _write(http, web, agent, "the first")
                await modern.inbox.wait_for(CORPUS, after=0)
                # What the hint points at: the corpus resource now shows the write.
                assert await _head(modern.client) >= sequence
                await _notified_by_writes(legacy.inbox, lambda: _write(http, web, agent, "another"))
                assert GUIDE not in modern.inbox.uris + legacy.inbox.uris  # nothing changed it yet

                # The operator replaces the guide (straight into the database, no event): both are told.
                seen = len(modern.inbox.uris), len(legacy.inbox.uris)
                env = {**dep.env, "TOASTMACHINE_NODE_ID": "operator"}
                run = await asyncio.create_subprocess_exec(
                    "toastmachine", "guide", "set", "-", env=env, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                _, err = await asyncio.wait_for(run.communicate(b"# A new guide\n\nRead before you write.\n"), 60)
                assert run.returncode == 0, err.decode()
                await modern.inbox.wait_for(GUIDE, after=seen[0])
                await legacy.inbox.wait_for(GUIDE, after=seen[1])
                guide = (await modern.client.read_resource(GUIDE)).contents[0]
                assert isinstance(guide, TextResourceContents) and "A new guide" in guide.text

            # The 2025-11-25 client left (the SDK ends its session with DELETE): the next change
            # finds its session gone and the node forgets the subscription.
            await _write(http, web, agent, "after the subscriber left")
            await until(lambda: logged(dep.processes["mcp-a"], "mcp.notify.session_gone"),
                        "the MCP node forgot the ended session", timeout=NOTIFIED_WITHIN)


@pytest.mark.fault
@pytest.mark.exclusive  # rabbitmqctl stop_app: the broker goes away for every test on the machine
async def test_broker_restart_while_listening_keeps_notifying(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """RabbitMQ stops and starts while both clients listen: the MCP node's hub reconnects (its queue
    comes back with its binding) and the same listen stream and session are notified of a write
    made after the restart."""
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
        web, mcp_url = await _processes(dep)
        mcp = dep.processes["mcp-a"]
        async with httpx.AsyncClient(timeout=30) as http, \
                listening(mcp_url, "listener") as modern, subscribed(mcp_url, "subscriber") as legacy:
            agent = await _author(http, web)
            await _write(http, web, agent, "before the restart")
            await modern.inbox.wait_for(CORPUS, after=0)
            await _notified_by_writes(legacy.inbox, lambda: _write(http, web, agent, "still before"))

            seen = len(modern.inbox.uris), len(legacy.inbox.uris)
            # Stops the broker for everyone on this machine: keep the outage short and always
            # bring the broker back.
            async with broker_restarted(rabbitmq_url):
                await until(lambda: logged(mcp, "bus.connection_lost"), "the MCP node saw the broker go", timeout=20)
            await until(lambda: logged(mcp, "bus.reconnected"), "the MCP node's bus reconnected", timeout=WAIT)

            sequence = await _write(http, web, agent, "after the restart")
            await modern.inbox.wait_for(CORPUS, after=seen[0], timeout=WAIT)
            await legacy.inbox.wait_for(CORPUS, after=seen[1], timeout=WAIT)
            assert modern.reader is not None and not modern.reader.done(), "the listen stream ended"
            assert await _head(modern.client) >= sequence


async def test_a_burst_of_writes_is_coalesced_and_get_changes_recovers_every_change(tmp_path: Path) -> None:
    """On the embedded node of ``toastmachine up``: many writes, few hints (at most one per
    interval), and get_changes from the last sequence applied returns every one of them."""
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_PORT="0",
                          TOASTMACHINE_WRITES_PER_SECOND="1000000")
    node = await procs.start("up", env=env)
    try:
        web, mcp_url = await _up_urls(node)
        async with httpx.AsyncClient(timeout=30) as http, listening(mcp_url, "listener") as modern:
            started = time.monotonic()
            applied = await _head(modern.client)
            agent = await _author(http, web)
            writes = 40
            sequences = await asyncio.gather(*(_write(http, web, agent, f"burst {i}") for i in range(writes)))
            # Hints until one whose read shows the last write (the one after the burst, at the latest).
            seen = 0
            while True:
                await modern.inbox.wait_for(CORPUS, after=seen)
                seen = len(modern.inbox.uris)
                if await _head(modern.client) >= max(sequences):
                    break
            elapsed = time.monotonic() - started
            hints = modern.inbox.uris.count(CORPUS)
            # One announcement per interval at most (the first at once): a slow reader is never sent more.
            assert 1 <= hints <= elapsed / DEFAULT_MIN_INTERVAL + 2, (hints, elapsed)
            assert hints < writes

            # The recovery the hint asks for: get_changes from the last sequence applied.
            got: list[int] = []
            arguments: dict[str, Any] | None = {"after": applied}
            while arguments is not None:
                page = await modern.client.call_tool("get_changes", arguments)
                assert not page.is_error, page
                body = page.structured_content
                assert body is not None
                got += [item["sequence"] for item in body["items"]]
                arguments = body["next"]
            assert set(sequences) <= set(got)
    finally:
        code = await node.stop()
    assert code == 0, "\n".join(node.output)


async def test_stopping_the_node_ends_open_listen_streams_gracefully(tmp_path: Path) -> None:
    """SIGTERM while a 2026-07-28 client listens and a 2025-11-25 client is subscribed: the listen
    stream ends with its final result (the client's loop ends, nothing is lost abruptly) and the
    node exits 0 well within its shutdown grace period instead of waiting for the streams."""
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_PORT="0",
                          TOASTMACHINE_SHUTDOWN_GRACE="20")
    node = await procs.start("up", env=env)
    try:
        _, mcp_url = await _up_urls(node)
        async with listening(mcp_url, "listener") as modern, subscribed(mcp_url, "subscriber"):
            assert modern.reader is not None
            # The graceful close ends the iteration; an abrupt drop would raise.
            await _stop_promptly(node, modern.reader)
    finally:
        if node.proc.returncode is None:
            await node.stop()


async def test_up_follows_the_corpus_with_one_hub_for_both_fronts(tmp_path: Path) -> None:
    """``toastmachine up`` runs the web and MCP fronts in one process on one notification hub (one
    queue, one consumer): an SSE stream and an MCP listener each get a write, and at SIGTERM each
    front ends its own followers (the stream ends, the listen stream gets its final result) within
    the grace period, neither holding the other's open."""
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_PORT="0",
                          TOASTMACHINE_SHUTDOWN_GRACE="20")
    node = await procs.start("up", env=env)
    try:
        web, mcp_url = await _up_urls(node)
        async with httpx.AsyncClient(timeout=30) as http, listening(mcp_url, "listener") as modern, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            agent = await _author(http, web)
            stream = await session.get(web + "/corpus/stream")
            reader = frames(stream)
            async with asyncio.timeout(NOTIFIED_WITHIN):
                async for frame in reader:
                    if frame.event == "ready":
                        break
            before = len(modern.inbox.uris)
            sequence = await _write(http, web, agent, "seen by both fronts")
            async with asyncio.timeout(NOTIFIED_WITHIN):
                async for frame in reader:
                    if frame.id is not None and int(frame.id) == sequence:
                        break
            await modern.inbox.wait_for(CORPUS, after=before)
            assert sum("hub.consuming" in line for line in node.output) == 1, "\n".join(node.output)
            assert modern.reader is not None

            async def stream_ended() -> None:
                async for _ in reader:  # the web front ends its stream (aiohttp sees the end)
                    pass

            await _stop_promptly(node, stream_ended(), modern.reader)
    finally:
        if node.proc.returncode is None:
            await node.stop()


async def test_a_token_without_the_read_scope_can_neither_listen_nor_subscribe(tmp_path: Path) -> None:
    """Notifications are reads: a write-only grant is refused both ways, with fixed text."""
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_PORT="0")
    node = await procs.start("up", env=env)
    try:
        _, mcp_url = await _up_urls(node)
        async with httpx.AsyncClient() as oauth:
            # Straight through the endpoints: the SDK's provider asks for every scope the challenge names.
            _, tokens = await _tokens(oauth, mcp_url.removesuffix("/mcp"), scope="toastmachine:write")
        bearer = {"Authorization": f"Bearer {tokens['access_token']}"}
        for mode in ("auto", "legacy"):
            async with httpx2.AsyncClient(headers=bearer, timeout=60) as http, \
                    _client(mcp_url, http, mode=mode) as client:
                with pytest.raises(MCPError) as refused:
                    if mode == "auto":
                        async with client.listen(resource_subscriptions=[CORPUS]):
                            pass
                    else:
                        with pytest.warns(MCPDeprecationWarning):
                            await client.subscribe_resource(CORPUS)
                assert "toastmachine:read" in str(refused.value)
    finally:
        code = await node.stop()
    assert code == 0, "\n".join(node.output)


# --- 2025-11-25: a notification while the session has no GET stream (in-process, both databases) ----

@contextlib.asynccontextmanager
async def serving_subscriptions(db: Database, bus: InMemorySubscriptionBus, listen: ScopedListen,
                                legacy: LegacySubscriptions) -> AsyncIterator[str]:
    """The MCP front in this process (uvicorn on a free port) with the minimal tools and these
    subscription handlers; yields its base URL."""
    def register(server: MCPServer, deps: ToolDeps) -> None:
        register_minimal_tools(server, deps)
        register_subscriptions(server, listen, legacy)

    port = _free_port()
    app = build_app(Settings(mcp_host="127.0.0.1", mcp_port=port), db, tools=register, subscriptions=bus,
                    stream_opened=legacy.stream_opened)
    server = make_server(app, host="127.0.0.1", port=port)
    legacy.start()
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "uvicorn stopped while starting"
            await asyncio.sleep(0.02)  # uvicorn reports readiness only through this flag
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(20):
            await task
        await legacy.close()


async def test_a_notification_before_the_get_stream_opens_is_sent_when_it_opens(db: Database) -> None:
    """A 2025-11-25 session subscribes over POST and is notified before it opens its GET stream
    (the SDK's client opens it in the background after the handshake, and again after a cut): the
    notification is held (at most one per resource) and sent as soon as the stream opens, instead
    of being dropped by the transport."""
    bus = InMemorySubscriptionBus()
    legacy = LegacySubscriptions(bus, current_grant)
    async with serving_subscriptions(db, bus, ScopedListen(bus, current_grant), legacy) as base, \
            httpx.AsyncClient(timeout=30) as http:
        _, tokens = await _tokens(http, base)
        auth = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        r = await http.post(base + "/mcp", json=_INIT, headers=auth)
        assert r.status_code == 200, r.text
        session = {**auth, "Mcp-Session-Id": r.headers["mcp-session-id"], "MCP-Protocol-Version": "2025-11-25"}
        r = await http.post(base + "/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                            headers=session)
        assert r.status_code == 202, r.text
        r = await http.post(base + "/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "resources/subscribe",
                                                 "params": {"uri": CORPUS}}, headers=session)
        assert r.status_code == 200 and "error" not in r.json(), r.text

        await bus.publish(ResourceUpdated(uri=CORPUS))
        assert legacy._sessions[session["Mcp-Session-Id"]].pending == {CORPUS}  # held, not sent

        stream = {**session, "Accept": "text/event-stream"}
        async with http.stream("GET", base + "/mcp", headers=stream) as events:
            assert events.status_code == 200
            async with asyncio.timeout(NOTIFIED_WITHIN):
                async for line in events.aiter_lines():
                    if line.startswith("data:"):
                        message = orjson.loads(line[5:])
                        break
        assert message["method"] == "notifications/resources/updated"
        assert message["params"]["uri"] == CORPUS
        assert legacy._sessions[session["Mcp-Session-Id"]].pending == set()


async def test_one_agent_cannot_take_every_subscription_place(db: Database) -> None:
    """Subscribed 2025-11-25 sessions and open listen streams are bounded per agent (of the
    node's whole bound): past its share an agent is refused, and another agent still subscribes."""
    bus = InMemorySubscriptionBus()
    legacy = LegacySubscriptions(bus, current_grant, per_agent=2)
    listen = ScopedListen(bus, current_grant, per_agent=1)
    async with serving_subscriptions(db, bus, listen, legacy) as base, httpx.AsyncClient(timeout=30) as http:
        _, greedy = await _tokens(http, base)
        _, other = await _tokens(http, base)

        async def subscribe(tokens: dict[str, Any]) -> dict[str, Any]:
            auth = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
            r = await http.post(base + "/mcp", json=_INIT, headers=auth)
            session = {**auth, "Mcp-Session-Id": r.headers["mcp-session-id"], "MCP-Protocol-Version": "2025-11-25"}
            await http.post(base + "/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                            headers=session)
            r = await http.post(base + "/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "resources/subscribe",
                                                     "params": {"uri": CORPUS}}, headers=session)
            answer: dict[str, Any] = r.json()
            return answer

        assert "error" not in await subscribe(greedy) and "error" not in await subscribe(greedy)
        refused = await subscribe(greedy)
        assert "the most it may hold" in refused["error"]["message"], refused
        assert "error" not in await subscribe(other)  # another agent is not shut out
        assert legacy.sessions == 3

        bearer = {"Authorization": f"Bearer {greedy['access_token']}"}
        async with httpx2.AsyncClient(headers=bearer, timeout=60) as h1, _client(base + "/mcp", h1) as first, \
                first.listen(resource_subscriptions=[CORPUS]), \
                httpx2.AsyncClient(headers=bearer, timeout=60) as h2, _client(base + "/mcp", h2) as second:
            with pytest.raises(MCPError) as again:
                async with second.listen(resource_subscriptions=[CORPUS]):
                    pass
            assert "listen streams open" in str(again.value)
        # Closed, its place is free again (once the node has seen the stream end).
        async with asyncio.timeout(20):
            while listen._open:
                await asyncio.sleep(0.02)  # polling the bound's own count, bounded by the timeout
        async with httpx2.AsyncClient(headers=bearer, timeout=60) as h3, _client(base + "/mcp", h3) as third, \
                third.listen(resource_subscriptions=[CORPUS]) as sub:
            assert sub.honored.resource_subscriptions
