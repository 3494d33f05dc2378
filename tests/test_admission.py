"""Admission limits hold across web nodes, and client addresses cannot be forged.

Two web fronts (two apps, each with its own in-memory pre-filter) share one corpus writer, one bus
and one database, as two nodes behind a load balancer do. Each test runs on both backend pairs of
``stack``: embedded PostgreSQL with the in-process bus, and PostgreSQL with RabbitMQ. One agent (or
one address) spreading its requests over both nodes must get one node's limit, not twice it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import structlog
import structlog.testing
from aiohttp.test_utils import TestClient

from actors.web.app import make_app
from infra.client_address import TrustedProxies, admission_key, client_address, parse_address
from infra.logs import merge_trace_context
from tests.corpus_fixtures import STACK_ENV, Agent, Reply, Stack
from tests.deployment import deployment
from tests.webclient import serve, test_node

#: Writes per second in the write tests: bursts of 2 x RATE.
RATE = 2.0
BURST = int(2 * RATE)
#: Admissions the measured time cannot explain: float rounding of the two clocks (test and database).
SLACK = 1


@contextlib.asynccontextmanager
async def second_node(stack: Stack, **env: str) -> AsyncIterator[TestClient]:
    """Another web front on the stack's database and bus, with the same settings plus ``env``."""
    settings = {**STACK_ENV, **env}
    async with serve(make_app(test_node(stack.db, stack.bus, settings, identity=stack.identity))) as client:
        yield client


async def post(client: TestClient, agent: Agent | None, path: str, body: Any, token: str | None = None,
               **headers: str) -> Reply:
    send = dict(agent.headers(token)) if agent is not None else {}
    send.update(headers)
    resp = await client.post(path, json=body, headers=send)
    text = await resp.text()
    return Reply(resp.status, orjson.loads(text) if text else None, dict(resp.headers))


def refused(reply: Reply) -> int:
    """Check a 429 envelope; return its Retry-After in seconds."""
    assert reply.status == 429, reply.body
    error = reply.body["error"]
    assert error["code"] == "rate_limited" and error["message"] and error["how_to_proceed"], error
    seconds = int(reply.headers["Retry-After"])
    assert seconds >= 1 and error["retry_after"] == seconds
    return seconds


async def counts(stack: Stack, agent: Agent) -> tuple[int, int]:
    """(changes, idempotency records) of ``agent`` in the database."""
    row = await stack.db.pool.fetchrow(
        "select (select count(*) from changes where author_id = $1) as changes,"
        " (select count(*) from operations where author_id = $1) as operations", uuid.UUID(agent.agent_id))
    return row["changes"], row["operations"]


# --- writes ------------------------------------------------------------------------------------


@pytest.mark.stack_env(TOASTMACHINE_WRITES_PER_SECOND=str(RATE))
async def test_one_agent_writing_through_two_nodes_gets_one_nodes_limit(stack: Stack) -> None:
    alice = await stack.register()
    async with second_node(stack, TOASTMACHINE_WRITES_PER_SECOND=str(RATE)) as other:
        nodes = (stack.client, other)
        writes = [(nodes[i % 2], str(uuid.uuid4()), {"subject": f"s{i}", "content": "c"}) for i in range(BURST + 8)]
        started = time.monotonic()
        replies = await asyncio.gather(*(post(node, alice, "/conversations", body, token)
                                         for node, token, body in writes))
        elapsed = time.monotonic() - started
        statuses = [r.status for r in replies]
        admitted = statuses.count(201)
        # Each node alone would have let its own burst through: 2 x BURST before the fix.
        assert BURST <= admitted <= BURST + elapsed * RATE + SLACK, (statuses, elapsed)
        waits = [refused(r) for r in replies if r.status != 201]
        assert len(waits) == len(writes) - admitted
        # A refusal wrote nothing and did not use up its Operation-Token.
        assert await counts(stack, alice) == (admitted, admitted)

        # The identical refused request, retried after its Retry-After on the other node, is written.
        index = next(i for i, r in enumerate(replies) if r.status == 429)
        _, token, body = writes[index]
        await asyncio.sleep(int(replies[index].headers["Retry-After"]))  # the wait the contract asks for
        retried = await post(nodes[(index + 1) % 2], alice, "/conversations", body, token)
        assert retried.status == 201, retried.body
        assert "Idempotent-Replayed" not in retried.headers
        assert await counts(stack, alice) == (admitted + 1, admitted + 1)


@pytest.mark.stack_env(TOASTMACHINE_WRITES_PER_SECOND="0.5")  # a burst of 1, then one write every 2 s
async def test_the_writer_refuses_what_the_other_nodes_pre_filter_lets_through(stack: Stack) -> None:
    alice, bob = await stack.register(), await stack.register()
    async with second_node(stack, TOASTMACHINE_WRITES_PER_SECOND="0.5") as second, \
            second_node(stack, TOASTMACHINE_WRITES_PER_SECOND="0.5") as third:
        token, body = str(uuid.uuid4()), {"subject": "first", "content": "c"}
        assert (await post(stack.client, alice, "/conversations", body, token)).status == 201
        # A replay is answered from the idempotency record although the budget is spent, uncharged.
        replay = await post(second, alice, "/conversations", body, token)
        assert replay.status == 201 and replay.headers["Idempotent-Replayed"] == "true", replay.body
        # The third node has never seen alice: its own bucket is full, but her budget is spent.
        fresh = await post(third, alice, "/conversations", {"subject": "second", "content": "c"}, str(uuid.uuid4()))
        assert 1 <= refused(fresh) <= 2
        assert await counts(stack, alice) == (1, 1)
        # Another agent has a budget of its own.
        assert (await post(third, bob, "/conversations", body, str(uuid.uuid4()))).status == 201


# --- registrations -----------------------------------------------------------------------------


@pytest.mark.stack_env(TOASTMACHINE_REGISTER_PER_MINUTE="3")
async def test_registrations_from_one_address_through_two_nodes_get_one_nodes_limit(stack: Stack) -> None:
    async with second_node(stack, TOASTMACHINE_REGISTER_PER_MINUTE="3") as other:
        first = f"agent-{uuid.uuid4().hex[:10]}"
        names = [first, f"agent-{uuid.uuid4().hex[:10]}", first.upper()]  # the third one is taken: it still counts
        names += [f"agent-{uuid.uuid4().hex[:10]}" for _ in range(3)]
        nodes = (stack.client, other, stack.client, other, other, stack.client)
        replies = [await post(node, None, "/register", {"name": name}) for node, name in zip(nodes, names, strict=True)]
        assert [r.status for r in replies] == [201, 201, 409, 429, 429, 429]
        assert all(1 <= refused(r) <= 20 for r in replies[3:])  # one registration comes back every 20 s
        assert await stack.db.pool.fetchval("select count(*) from agents") == 2
        assert await _budget_keys(stack) == ["127.0.0.1/32"]


@pytest.mark.stack_env(TOASTMACHINE_REGISTER_PER_MINUTE="2")
async def test_forged_forwarding_headers_from_an_untrusted_peer_change_nothing(stack: Stack) -> None:
    async with second_node(stack, TOASTMACHINE_REGISTER_PER_MINUTE="2") as other:
        statuses = []
        for i, node in enumerate((stack.client, other, stack.client, other)):
            forged = {"X-Forwarded-For": f"203.0.113.{i + 1}"} if i % 2 else {"Forwarded": f"for=198.51.100.{i}"}
            statuses.append((await post(node, None, "/register", {"name": f"forger-{i}"}, **forged)).status)
        assert statuses == [201, 201, 429, 429]
        assert await _budget_keys(stack) == ["127.0.0.1/32"]


@pytest.mark.stack_env(TOASTMACHINE_REGISTER_PER_MINUTE="2", TOASTMACHINE_TRUSTED_PROXIES="127.0.0.1, 10.0.0.0/8")
async def test_forwarding_headers_from_a_trusted_proxy_name_the_client(stack: Stack) -> None:
    proxies = "127.0.0.1, 10.0.0.0/8"
    async with second_node(stack, TOASTMACHINE_REGISTER_PER_MINUTE="2", TOASTMACHINE_TRUSTED_PROXIES=proxies) as other:
        async def register(node: TestClient, **headers: str) -> int:
            return (await post(node, None, "/register", {"name": f"a-{uuid.uuid4().hex[:10]}"}, **headers)).status

        # The right-most address that is not a trusted proxy is the client; what the client wrote
        # to its left (any address it likes) is not.
        chain = {"X-Forwarded-For": "192.0.2.1, 203.0.113.7, 10.1.2.3"}
        assert await register(stack.client, **chain) == 201
        assert await register(other, **{"X-Forwarded-For": "192.0.2.99, 203.0.113.7"}) == 201
        assert await register(stack.client, Forwarded='for=192.0.2.5, for="203.0.113.7:4711";proto=http') == 429
        # Other clients behind the proxy have budgets of their own, IPv6 ones by /64.
        assert await register(other, Forwarded='for="[2001:db8:1:2::1]:80"') == 201
        assert await register(stack.client, **{"X-Forwarded-For": "2001:db8:1:2::ffff"}) == 201
        assert await register(other, **{"X-Forwarded-For": "2001:db8:1:2:aaaa::1"}) == 429
        # Malformed or ambiguous headers are ignored: the request is the proxy's own.
        for headers in ({"X-Forwarded-For": "not-an-address"}, {"X-Forwarded-For": "203.0.113.9,,"},
                        {"Forwarded": "for"}, {"X-Forwarded-For": "203.0.113.10", "Forwarded": "for=203.0.113.11"}):
            assert await register(stack.client, **headers) in (201, 429)
        assert await _budget_keys(stack) == ["127.0.0.1/32", "203.0.113.7/32", "2001:db8:1:2::/64"]


@pytest.mark.stack_env(TOASTMACHINE_TRUSTED_PROXIES="127.0.0.1")
async def test_log_lines_name_the_client_the_registration_was_charged_to(stack: Stack) -> None:
    async with second_node(stack) as untrusting:  # the default: trust nobody
        with structlog.testing.capture_logs(processors=[merge_trace_context]) as logs:
            forwarded = {"X-Forwarded-For": "198.51.100.1, 203.0.113.50"}
            trusted = await post(stack.client, None, "/register", {"name": f"a-{uuid.uuid4().hex[:10]}"}, **forwarded)
            untrusted = await post(untrusting, None, "/register", {"name": f"a-{uuid.uuid4().hex[:10]}"}, **forwarded)
    clients = {line["agent_id"]: line["client"] for line in logs if line["event"] == "agent.registered"}
    assert clients == {trusted.body["agent_id"]: "203.0.113.50", untrusted.body["agent_id"]: "127.0.0.1"}


@pytest.mark.stack_env(TOASTMACHINE_REGISTER_PER_MINUTE="1000000", TOASTMACHINE_TRUSTED_PROXIES="127.0.0.1")
async def test_the_registration_budget_keeps_only_rows_that_carry_state(stack: Stack) -> None:
    # At this rate a row carries state for 60 microseconds: each registration drops those before it.
    for i in range(30):
        reply = await post(stack.client, None, "/register", {"name": f"a-{uuid.uuid4().hex[:10]}"},
                           **{"X-Forwarded-For": f"203.0.113.{i + 1}"})
        assert reply.status == 201, reply.body
    assert await stack.db.pool.fetchval("select count(*) from registration_budget") <= 3


async def _budget_keys(stack: Stack) -> list[str]:
    rows = await stack.db.pool.fetch("select text(address) as key from registration_budget order by address")
    return [row["key"] for row in rows]


# --- separate processes --------------------------------------------------------------------------


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_the_limits_hold_across_two_web_processes(tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """The Procfile's processes: one writer and two web nodes, each with its own settings from the
    environment, as an operator runs them."""
    limits = {"TOASTMACHINE_WRITES_PER_SECOND": str(RATE), "TOASTMACHINE_REGISTER_PER_MINUTE": "2"}
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
        await dep.start("writer", "writer-a", **limits)
        for name in ("web-a", "web-b"):
            await dep.start("web", name, **limits)
        urls = list(dep.urls.values())
        async with aiohttp.ClientSession() as session:
            async def send(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
                async with session.post(url + path, json=body, headers=headers or {}) as resp:
                    return Reply(resp.status, await resp.json(), dict(resp.headers))

            registered = await send(urls[0], "/register", {"name": "alice"})
            assert registered.status == 201, registered.body
            alice = Agent(registered.body["agent_id"], "alice", registered.body["credential"])
            async with session.get(urls[1] + "/guide", headers=alice.headers()) as resp:
                assert resp.status == 200
            # Registrations: the second address budget slot is used on the other node, then none is left.
            statuses = [(await send(url, "/register", {"name": f"a-{uuid.uuid4().hex[:10]}"})).status
                        for url in (urls[1], urls[0], urls[1])]
            assert statuses == [201, 429, 429]

            writes = [(urls[i % 2], alice.headers(str(uuid.uuid4()))) for i in range(BURST + 8)]
            started = time.monotonic()
            replies = await asyncio.gather(*(send(url, "/conversations", {"subject": "s", "content": "c"}, headers)
                                             for url, headers in writes))
            elapsed = time.monotonic() - started
            admitted = [r.status for r in replies].count(201)
            assert BURST <= admitted <= BURST + elapsed * RATE + SLACK, ([r.status for r in replies], elapsed)
            assert all(refused(r) for r in replies if r.status != 201)


# --- the address parser ------------------------------------------------------------------------

TRUSTED = TrustedProxies.parse("127.0.0.1,10.0.0.0/8,::1")


@pytest.mark.parametrize(("peer", "forwarded", "xff", "expected"), [
    ("192.0.2.1", [], ["203.0.113.1"], "192.0.2.1"),              # untrusted peer: headers ignored
    ("127.0.0.1", [], [], "127.0.0.1"),
    ("127.0.0.1", [], ["203.0.113.1"], "203.0.113.1"),
    ("127.0.0.1", [], ["198.51.100.1, 203.0.113.1"], "203.0.113.1"),
    ("127.0.0.1", [], ["198.51.100.1", "203.0.113.1, 10.0.0.2"], "203.0.113.1"),  # several lines, in order
    ("127.0.0.1", [], ["10.0.0.3, 10.0.0.2"], "10.0.0.3"),          # all trusted: the left-most
    ("127.0.0.1", [], ["unknown, 10.0.0.2"], "10.0.0.2"),           # unparsable hop: who reported it
    ("127.0.0.1", [], ["203.0.113.1,"], "127.0.0.1"),               # malformed list: the peer
    ("127.0.0.1", [], ["203.0.113.1:8080"], "203.0.113.1"),
    ("127.0.0.1", [], ["x" * 8000], "127.0.0.1"),
    ("127.0.0.1", ['for="[2001:db8::1]:4711"'], [], "2001:db8::1"),
    ("127.0.0.1", ["for=192.0.2.60;proto=http;by=203.0.113.43"], [], "192.0.2.60"),
    ("127.0.0.1", ["for=_hidden"], [], "127.0.0.1"),
    ("127.0.0.1", ["proto=http"], [], "127.0.0.1"),
    ("127.0.0.1", ["for=1.2.3.4"], ["5.6.7.8"], "127.0.0.1"),       # both: ambiguous
    ("::ffff:127.0.0.1", [], ["203.0.113.1"], "203.0.113.1"),       # IPv4-mapped peer
    ("::1", [], ["2001:db8::5"], "2001:db8::5"),
    (None, [], ["203.0.113.1"], None),
])
def test_client_address(peer: str | None, forwarded: list[str], xff: list[str], expected: str | None) -> None:
    address = client_address(peer, forwarded, xff, TRUSTED)
    assert (str(address) if address is not None else None) == expected


def test_many_trusted_hops_stop_at_the_bound() -> None:
    hops = ", ".join(["203.0.113.1"] + ["10.0.0.1"] * 100)
    assert str(client_address("127.0.0.1", [], [hops], TRUSTED)) == "10.0.0.1"


def test_admission_keys() -> None:
    assert admission_key(parse_address("203.0.113.1")) == "203.0.113.1/32"
    assert admission_key(parse_address("2001:db8:1:2:3:4:5:6")) == "2001:db8:1:2::/64"
    assert admission_key(None) == "::/128"


@pytest.mark.parametrize("raw", ["", " , ", "127.0.0.1", "10.0.0.0/8, ::1, 192.168.0.1/32"])
def test_trusted_proxies_parse(raw: str) -> None:
    parsed = TrustedProxies.parse(raw)
    assert TrustedProxies.parse(str(parsed)) == parsed
