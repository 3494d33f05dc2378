"""The MCP front against the HTTP API, the same reads and writes in the same run; and token verification.

A node run the way the Procfile runs it, as separate OS processes (``toastmachine run writer``,
``toastmachine web`` and ``toastmachine mcp``), on a private RabbitMQ virtual host and a fresh
PostgreSQL database, admission limits raised out of the way. ``--concurrency`` agents (default 32)
register over HTTP, read the guide, create a conversation each and append ``--prefill`` messages to it.
Each agent then authorizes an MCP client through the real OAuth flow, once: one public client is
registered, and each agent goes through ``/authorize`` (PKCE S256), the consent page (linking the agent
by its credential) and the code exchange, getting its own access token. So both sides act as the same
agents on the same conversations.

Two workloads, each measured for ``--seconds`` per side per round at ``--concurrency`` calls in flight
(one worker per agent, back to back), the sides alternating which goes first over ``--rounds`` rounds
(the median round of each side is reported):

- ``get_messages``: the tool ``get_messages {conversation, limit: 50}`` against
  ``GET /messages?conversation=…&limit=50`` (the same query plan; the route needs no token, the tool
  a bearer token, verified per call);
- ``append_message``: the tool ``append_message {conversation_id, operation_token, content}`` against
  ``POST /conversations/{id}/messages`` (a fresh Operation-Token per write on both sides; both go
  over ``tm.commands`` to the same writer process).

MCP clients (``--client``), 32 concurrent MCP clients over Streamable HTTP either way:

- ``jsonrpc`` (default, the judged figure): each agent posts the 2026-07-28 JSON-RPC ``tools/call``
  requests the SDK client sends (same headers, same ``_meta``), with its own bearer token, on the HTTP
  side's own ``aiohttp`` session, and parses each answer for a JSON-RPC or tool error. Both sides then
  share one client stack, so the ratio compares the two fronts, not two client libraries.
- ``sdk``: the official SDK's ``mcp.Client`` over its Streamable HTTP transport, one per agent, each with
  its own HTTP connection and its bearer token; in mode ``--mode`` (``auto``, the default, negotiates
  2026-07-28, stateless; ``legacy`` is the 2025-11-25 initialize handshake and session). Reported, not
  judged: after every call that client re-validates the structured result against the tool's output
  schema with ``jsonschema`` (compiled once, then about 750 subschema descents for a 50-message
  ``get_messages`` result: some 10 ms of CPU per call on a 2-CPU machine), so one bench process at one
  full CPU tops out near 80-100 calls/s whatever the server does; that is the client's cost, and the
  HTTP side's client validates nothing.

Then token verification in isolation: the MCP front's verifier (``ProviderTokenVerifier`` over
:class:`actors.mcp.oauth.OAuthStore`, what its bearer middleware calls on every request; built here
without the front's token cache, so this is the database read a first call or a miss costs) is called in
this process for the agents' real tokens, ``--verifications`` times one at a time, against the node's
database through a pool of the node's size; the no-auth baseline is the bare database round trip
(``select 1``) on the same pool, measured the same way and interleaved with it. Prints p50/p99 of
each and the delta; also the verifier's p50 with ``--concurrency`` calls in flight.

Prints calls/s, p50 and p99 of each side and the ratio MCP/HTTP (target >= 0.5 for each workload), the
verification p50 (target <= 1 ms), the CPU each process used, and checks that the node's database holds
exactly one message per accepted write. The broker, the database, the three node processes and this
client share the machine's CPUs: only ratios compare across runs.

Run: ``python bench/mcp.py [--quick] [--concurrency C] [--seconds S] [--rounds R] [--prefill N]
[--client sdk|jsonrpc] [--mode auto|legacy] [--verifications N] [--amqp-url amqp://...]
[--database-url postgresql://...] [--vhost private|shared] [--logs DIR] [--verbose]``
(``--quick``: a smoke run of a few seconds, 4 agents, no targets checked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path, and this file would then shadow the
# SDK's own ``mcp`` package: put the repository root there instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import aiohttp
import httpx
import httpx2
import orjson
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.auth.provider import ProviderTokenVerifier
from mcp.shared.exceptions import MCPError
from mcp.shared.inbound import MCP_METHOD_HEADER, MCP_NAME_HEADER, MCP_PROTOCOL_VERSION_HEADER
from mcp_types import CLIENT_CAPABILITIES_META_KEY, CLIENT_INFO_META_KEY, PROTOCOL_VERSION_META_KEY

from actors.mcp.oauth import SCOPES, OAuthStore
from bench.write import (
    Agent,
    CpuMeter,
    HttpSide,
    cancel_on_sigterm,
    content_of,
    private_vhost,
    quiet_product_logs,
    run_bench,
    scratch_database,
    stop_process,
)
from infra.config import Settings
from infra.db.pool import Database
from tests import oauth_flow
from tests.procs import NodeProcess, clean_env, start

DEFAULT_AMQP_URL = os.environ.get("TOASTMACHINE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
DEFAULT_DATABASE_URL = os.environ.get("TOASTMACHINE_TEST_DATABASE_URL",
                                      "postgresql://postgres@127.0.0.1:5432/postgres")
#: Targets of issue #10: MCP calls/s at least this share of the HTTP API's; verification p50 at most this.
TARGET_RATIO = 0.5
TARGET_VERIFY_P50_MS = 1.0
#: The protocol revision the ``jsonrpc`` client speaks (the SDK's ``auto`` mode negotiates the same).
MODERN_VERSION = "2026-07-28"
MESSAGES_LIMIT = 50


# --- measuring ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Round:
    """One side of one workload for one round: latencies of the successful calls, and the failures."""

    elapsed: float
    latencies: list[float]
    failures: Counter[str]
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed > 0 else 0.0

    def ms(self, q: float) -> float:
        return percentile_ms(self.latencies, q)


def percentile_ms(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values`` (seconds), in milliseconds; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


Call = Callable[[int, int], Awaitable[str | None]]  # (worker, call number) -> None if it succeeded, else why not


async def closed_loop(workers: int, seconds: float, call: Call, pids: dict[str, int]) -> Round:
    """``workers`` workers (worker ``i`` acts as agent ``i``) calling back to back for ``seconds``."""
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    numbers = itertools.count()
    deadline = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                failure = await call(i, next(numbers))
            except (aiohttp.ClientError, httpx2.HTTPError, MCPError, OSError, TimeoutError) as e:
                failure = type(e).__name__
            if failure is None:
                latencies.append(time.perf_counter() - started)
            else:
                failures[failure] += 1

    meter = CpuMeter.start(pids)
    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(workers)))
    result = Round(time.perf_counter() - started, latencies, failures)
    result.cpu = meter.busy()
    return result


# --- the HTTP API side --------------------------------------------------------------------------


class HttpApi:
    """The two workloads over the HTTP API, as the agents of ``side`` (bench/write.py's agents)."""

    def __init__(self, side: HttpSide) -> None:
        self.side = side

    async def get_messages(self, i: int, n: int) -> str | None:
        agent = self.side.agents[i]
        params = {"conversation": agent.conversation_id, "limit": str(MESSAGES_LIMIT)}
        async with self.side.session.get(self.side.url + "/messages", params=params) as r:
            await r.read()
        return None if r.status == 200 else str(r.status)

    async def append_message(self, i: int, n: int) -> str | None:
        return await self.side.write(i, n)


# --- the MCP side -------------------------------------------------------------------------------


def _tool_failure(result: Any) -> str | None:
    if not result.is_error:
        return None
    error = (result.structured_content or {}).get("error") or {}
    return f"tool:{error.get('category', 'error')}"


class SdkClients:
    """One official SDK ``mcp.Client`` per agent over Streamable HTTP, each with its own bearer token."""

    def __init__(self, url: str, tokens: list[str], agents: list[Agent], size: int, mode: str) -> None:
        self.url, self.tokens, self.agents, self.size, self.mode = url, tokens, agents, size, mode
        self.clients: list[Client] = []
        self.accepted = 0

    @contextlib.asynccontextmanager
    async def connected(self) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for token in self.tokens:
                http = await stack.enter_async_context(httpx2.AsyncClient(
                    headers={"Authorization": f"Bearer {token}"}, timeout=60))
                transport = streamable_http_client(self.url, http_client=http)
                # No client-side response cache: every call must reach the server.
                self.clients.append(await stack.enter_async_context(Client(transport, mode=self.mode, cache=None)))
            yield

    async def get_messages(self, i: int, n: int) -> str | None:
        result = await self.clients[i].call_tool(
            "get_messages", {"conversation": self.agents[i].conversation_id, "limit": MESSAGES_LIMIT})
        return _tool_failure(result)

    async def append_message(self, i: int, n: int) -> str | None:
        result = await self.clients[i].call_tool(
            "append_message", {"conversation_id": self.agents[i].conversation_id,
                               "operation_token": str(uuid.uuid4()), "content": content_of(n, self.size)})
        failure = _tool_failure(result)
        self.accepted += failure is None
        return failure


class JsonRpcClients:
    """2026-07-28 ``tools/call`` requests posted without the SDK, on the HTTP side's own aiohttp session.

    The same client stack as the HTTP API's side (one ``aiohttp.ClientSession``, its connection pool):
    the two sides then differ only by the protocol and the front that serves it. Each agent sends its
    own bearer token.
    """

    def __init__(self, session: aiohttp.ClientSession, url: str, tokens: list[str], agents: list[Agent],
                 size: int) -> None:
        self.session, self.url, self.agents, self.size = session, url, agents, size
        self.headers = [{"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream",
                         "Content-Type": "application/json", MCP_PROTOCOL_VERSION_HEADER: MODERN_VERSION,
                         MCP_METHOD_HEADER: "tools/call"} for token in tokens]
        self.accepted = 0

    @contextlib.asynccontextmanager
    async def connected(self) -> AsyncIterator[None]:
        yield  # the session is the HTTP side's, opened and closed by run()

    async def _call(self, i: int, n: int, tool: str, arguments: dict[str, Any]) -> str | None:
        body = {"jsonrpc": "2.0", "id": n, "method": "tools/call",
                "params": {"name": tool, "arguments": arguments,
                           "_meta": {PROTOCOL_VERSION_META_KEY: MODERN_VERSION,
                                     CLIENT_INFO_META_KEY: {"name": "bench/mcp.py", "version": "1"},
                                     CLIENT_CAPABILITIES_META_KEY: {}}}}
        async with self.session.post(self.url, data=orjson.dumps(body),
                                     headers={**self.headers[i], MCP_NAME_HEADER: tool}) as r:
            data = await r.read()
        if r.status != 200:
            return str(r.status)
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            data = next((line[5:] for line in data.splitlines() if line.startswith(b"data:")), b"{}")
        answer = orjson.loads(data)
        if "error" in answer:
            return f"jsonrpc:{answer['error'].get('code')}"
        return "tool:error" if answer.get("result", {}).get("isError") else None

    async def get_messages(self, i: int, n: int) -> str | None:
        return await self._call(i, n, "get_messages",
                                {"conversation": self.agents[i].conversation_id, "limit": MESSAGES_LIMIT})

    async def append_message(self, i: int, n: int) -> str | None:
        failure = await self._call(i, n, "append_message", {
            "conversation_id": self.agents[i].conversation_id, "operation_token": str(uuid.uuid4()),
            "content": content_of(n, self.size)})
        self.accepted += failure is None
        return failure


async def authorize_agents(mcp_base: str, agents: list[Agent]) -> list[str]:
    """An access token per agent through the real OAuth flow: one registered public client, then for
    each agent /authorize, the consent page linking it by its credential, and the code exchange."""
    async with httpx.AsyncClient(timeout=30) as http:
        client_id = (await oauth_flow.register(http, mcp_base, client_name="bench/mcp.py"))["client_id"]

    async def one(agent: Agent) -> str:
        # A browser each: the consent page's CSRF cookie is per browser.
        async with httpx.AsyncClient(timeout=30) as browser:
            _, answer = await oauth_flow.tokens(browser, mcp_base, " ".join(SCOPES), client_id=client_id,
                                                credential=agent.credential)
        return str(answer["access_token"])

    return list(await asyncio.gather(*(one(a) for a in agents)))


# --- token verification -------------------------------------------------------------------------


@dataclass(slots=True)
class Verification:
    """Latencies (seconds) of the verifier and of the bare round trip, one call at a time, and the
    verifier's with ``concurrency`` calls in flight."""

    verify: list[float]
    round_trip: list[float]
    concurrent: list[float]
    concurrency: int


async def measure_verification(dsn: str, issuer: str, tokens: list[str], count: int,
                               concurrency: int) -> Verification:
    pool_size = Settings.from_env({}).db_pool_size
    db = await Database.connect(dsn, min_size=pool_size, max_size=pool_size)
    try:
        verifier = ProviderTokenVerifier(OAuthStore(db, issuer))  # type: ignore[arg-type]
        for token in tokens:  # each must verify, or the figures below would time refusals
            if await verifier.verify_token(token) is None:
                raise RuntimeError("an agent's access token does not verify")
        verify: list[float] = []
        round_trip: list[float] = []
        for n in range(count):  # interleaved, so that load on the machine hits both alike
            started = time.perf_counter()
            await verifier.verify_token(tokens[n % len(tokens)])
            verify.append(time.perf_counter() - started)
            started = time.perf_counter()
            await db.pool.fetchval("select 1")
            round_trip.append(time.perf_counter() - started)
        concurrent: list[float] = []
        numbers = iter(range(count))

        async def worker() -> None:
            for n in numbers:
                started = time.perf_counter()
                await verifier.verify_token(tokens[n % len(tokens)])
                concurrent.append(time.perf_counter() - started)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Verification(verify, round_trip, concurrent, concurrency)
    finally:
        await db.close()


# --- the run ------------------------------------------------------------------------------------


WORKLOADS = ("get_messages", "append_message")
PROCESSES = ("web", "mcp", "writer", "bench", "postgres", "rabbitmq", "machine")


@dataclass(slots=True)
class Report:
    """What a run measured, and how to print it."""

    args: argparse.Namespace
    rounds: dict[str, dict[str, list[Round]]] = field(default_factory=lambda: {
        w: {"http": [], "mcp": []} for w in WORKLOADS})
    verification: Verification | None = None
    accepted: int = 0
    stored: int = 0

    def ratio(self, workload: str) -> float:
        http = statistics.median(r.rate for r in self.rounds[workload]["http"])
        mcp = statistics.median(r.rate for r in self.rounds[workload]["mcp"])
        return mcp / http if http else 0.0

    def met(self) -> bool:
        assert self.verification is not None
        return (all(self.ratio(w) >= TARGET_RATIO for w in self.args.workloads)
                and percentile_ms(self.verification.verify, 0.5) <= TARGET_VERIFY_P50_MS)

    def print(self) -> None:
        args = self.args
        client = (f"SDK mcp.Client, mode {args.mode}" if args.client == "sdk"
                  else "JSON-RPC 2026-07-28 on the HTTP side's aiohttp session")
        print(f"{args.concurrency} agents, one call in flight each; {args.seconds:g} s per side per round, "
              f"median of {args.rounds} alternating rounds; MCP clients: {client}")
        print(f"{'workload':<16}{'side':<6}{'calls/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'server CPU ms/call':>20}"
              f"  CPUs busy (of {os.cpu_count()})")
        for workload in args.workloads:
            for side in ("http", "mcp"):
                rounds = self.rounds[workload][side]
                median = sorted(rounds, key=lambda r: r.rate)[len(rounds) // 2]
                cpu = ", ".join(f"{p} {median.cpu[p]:.2f}" for p in PROCESSES if p in median.cpu)
                failures = sum((r.failures for r in rounds), Counter[str]())
                extra = f"  failed (not counted): {dict(failures)}" if failures else ""
                # CPU time of the front that served the side (the web or the MCP process) per call.
                server = median.cpu.get("web" if side == "http" else "mcp", float("nan"))
                per_call = 1000 * server / median.rate if median.rate else float("nan")
                print(f"{workload:<16}{side:<6}{median.rate:>9,.0f}{median.ms(0.5):>9.1f}{median.ms(0.99):>9.1f}"
                      f"{per_call:>20.2f}  {cpu}{extra}")
            ratio = self.ratio(workload)
            print(f"{'':<16}ratio MCP/HTTP {ratio:.2f}: target >= {TARGET_RATIO} {_met(ratio >= TARGET_RATIO)}")
        v = self.verification
        if v is not None:
            p50 = percentile_ms(v.verify, 0.5)
            base = percentile_ms(v.round_trip, 0.5)
            print(f"token verification ({len(v.verify)} calls one at a time, ProviderTokenVerifier over "
                  f"OAuthStore): p50 {p50:.3f} ms, p99 {percentile_ms(v.verify, 0.99):.3f} ms: target p50 <= "
                  f"{TARGET_VERIFY_P50_MS:g} ms {_met(p50 <= TARGET_VERIFY_P50_MS)}")
            print(f"  no-auth baseline (select 1 on the same pool): p50 {base:.3f} ms, p99 "
                  f"{percentile_ms(v.round_trip, 0.99):.3f} ms; delta at p50 {p50 - base:+.3f} ms")
            print(f"  with {v.concurrency} in flight: p50 {percentile_ms(v.concurrent, 0.5):.3f} ms, "
                  f"p99 {percentile_ms(v.concurrent, 0.99):.3f} ms")
        verdict = "OK, nothing lost or doubled" if self.accepted == self.stored else "MISMATCH"
        print(f"check: {self.accepted} writes accepted (set-up included), the node's database holds "
              f"{self.stored} messages: {verdict}")
        print("(postgres and rabbitmq CPU: every such process on this machine, other users' included)")


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


@contextlib.asynccontextmanager
async def node(env: dict[str, str], logs: Path | None) -> AsyncIterator[dict[str, NodeProcess]]:
    """The Procfile's writer, web and mcp processes; yielded once each announced itself."""
    started: dict[str, NodeProcess] = {}
    try:
        started["writer"] = await start("run", "writer", env=env)
        await started["writer"].wait_for_line(r"ToastMachine running writer", 60)
        started["web"] = await start("web", env=env)
        started["mcp"] = await start("mcp", env=env)
        await started["web"].wait_listening(60)
        started["mcp"].url = (await started["mcp"].wait_for_line(r"ToastMachine MCP at (http://\S+)", 60)).group(1)
        yield started
    finally:
        await asyncio.gather(*(stop_process(p) for p in started.values()))
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            for label, p in started.items():
                (logs / f"{label}.log").write_text("\n".join(p.output) + "\n")


async def run(args: argparse.Namespace) -> Report:
    """Set up the node, the agents and their tokens; measure both sides in alternating rounds; verify."""
    tag = uuid.uuid4().hex[:12]
    report = Report(args)
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as data_dir:
        async with private_vhost(args.amqp_url, args.vhost, f"tm_bench_{tag}") as amqp_url, \
                scratch_database(args.database_url, f"tm_bench_{tag}") as dsn:
            env = clean_env(TOASTMACHINE_AMQP_URL=amqp_url, TOASTMACHINE_DATABASE_URL=dsn,
                            TOASTMACHINE_DATA_DIR=data_dir, TOASTMACHINE_PORT="0", TOASTMACHINE_MCP_PORT="0",
                            # Admission out of the way: the agents at full speed are the point here.
                            TOASTMACHINE_WRITES_PER_SECOND="1000000",
                            TOASTMACHINE_REGISTER_PER_MINUTE="1000000",
                            TOASTMACHINE_MCP_AUTHORIZE_PER_MINUTE="1000000")
            async with node(env, args.logs) as procs, aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=args.concurrency * 2),
                    timeout=aiohttp.ClientTimeout(total=60)) as session:
                web_url, mcp_url = procs["web"].url, procs["mcp"].url
                assert web_url is not None and mcp_url is not None
                mcp_base = mcp_url.removesuffix("/mcp")
                agents = [Agent(f"m{tag[:6]}_{i}") for i in range(args.concurrency)]
                http_side = HttpSide(session, web_url, agents, args.size)
                await http_side.set_up()
                numbers = itertools.count(1)

                async def prefill(i: int) -> None:
                    for _ in range(args.prefill):
                        if (failure := await http_side.write(i, next(numbers))) is not None:
                            raise RuntimeError(f"a prefill write failed: {failure}")

                await asyncio.gather(*(prefill(i) for i in range(len(agents))))
                tokens = await authorize_agents(mcp_base, agents)
                api = HttpApi(http_side)
                mcp: SdkClients | JsonRpcClients = (
                    SdkClients(mcp_url, tokens, agents, args.size, args.mode) if args.client == "sdk"
                    else JsonRpcClients(session, mcp_url, tokens, agents, args.size))
                pids = {name: p.proc.pid for name, p in procs.items()} | {"bench": os.getpid()}
                async with mcp.connected():
                    for workload in args.workloads:
                        sides: dict[str, Call] = {"http": getattr(api, workload), "mcp": getattr(mcp, workload)}
                        for side, call in sides.items():  # warm-up: connections, plans, code paths
                            warm = await closed_loop(args.concurrency, args.warmup, call, {})
                            if warm.failures:
                                raise RuntimeError(f"{workload} over {side} failed: {dict(warm.failures)}")
                        for i in range(args.rounds):
                            for side in (("http", "mcp") if i % 2 == 0 else ("mcp", "http")):
                                result = await closed_loop(args.concurrency, args.seconds, sides[side], pids)
                                report.rounds[workload][side].append(result)
                                if args.verbose:
                                    print(f"round {i} {workload} {side}: {result.rate:,.0f} calls/s, p50 "
                                          f"{result.ms(0.5):.1f} ms, p99 {result.ms(0.99):.1f} ms, failures "
                                          f"{dict(result.failures) or 0}", flush=True)
                report.verification = await measure_verification(dsn, mcp_base, tokens, args.verifications,
                                                                 args.concurrency)
                report.accepted = http_side.accepted + mcp.accepted
                report.stored = await _count_messages(dsn)
    return report


async def _count_messages(dsn: str) -> int:
    db = await Database.connect(dsn, min_size=1, max_size=1)
    try:
        return int(await db.pool.fetchval("select count(*) from messages"))
    finally:
        await db.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 agents, 1 s rounds, 1 round")
    parser.add_argument("--concurrency", type=int, default=32, help="agents, each with one call in flight")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per side per round")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per side first")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is reported")
    parser.add_argument("--prefill", type=int, default=60, help="messages each agent's conversation starts with")
    parser.add_argument("--size", type=int, default=100, help="characters of message content")
    parser.add_argument("--client", choices=("jsonrpc", "sdk"), default="jsonrpc",
                        help="MCP clients: a thin JSON-RPC client (judged) or the official SDK's mcp.Client")
    parser.add_argument("--mode", choices=("auto", "legacy"), default="auto",
                        help="the SDK client's mode: auto negotiates 2026-07-28; legacy the 2025-11-25 handshake")
    parser.add_argument("--workload", dest="workloads", action="append", choices=WORKLOADS,
                        help="measure only this workload (repeatable; default both)")
    parser.add_argument("--verifications", type=int, default=5000, help="token verifications to time")
    parser.add_argument("--amqp-url", default=DEFAULT_AMQP_URL)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL,
                        help="a PostgreSQL server where this user may create databases")
    parser.add_argument("--vhost", choices=("private", "shared"), default="private",
                        help="private: a RabbitMQ virtual host of its own for the node (needs rabbitmqctl)")
    parser.add_argument("--logs", type=Path, help="write the node processes' output to DIR/<process>.log")
    parser.add_argument("--verbose", action="store_true", help="print every round")
    args = parser.parse_args()
    args.workloads = args.workloads or list(WORKLOADS)
    if args.quick:
        args.concurrency, args.seconds, args.warmup, args.rounds = 4, 1.0, 0.5, 1
        args.prefill, args.verifications = 5, 200
    quiet_product_logs()
    with cancel_on_sigterm():
        report = await run(args)
    report.print()
    if report.accepted != report.stored:
        return 1
    return 0 if args.quick or report.met() else 2


if __name__ == "__main__":
    run_bench(main)
