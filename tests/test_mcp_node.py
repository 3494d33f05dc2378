"""The MCP front against Node: the official TypeScript SDKs as clients, and the official conformance suite.

The Node project in tests/node (pinned in its package.json and package-lock.json; ``.ci/run`` installs
it with ``npm ci``) holds:

- ``client-v2.mjs`` (``@modelcontextprotocol/client`` 2.x, pinned to protocol 2026-07-28) and
  ``client-v1.mjs`` (``@modelcontextprotocol/sdk`` 1.x, the 2025-11-25 initialize handshake). Each
  completes OAuth through its SDK's own flow (discovery, dynamic registration, PKCE; the consent page
  approved by a scripted person), lists the tools, reads the guide, calls ``whoami`` and
  ``create_conversation`` twice with one operation token, and prints what it got as JSON. They run
  against ``toastmachine up`` (embedded) and against the Procfile's ``mcp``, ``writer`` and ``web``
  processes on RabbitMQ and PostgreSQL; the tests check, through the HTTP API and the database, that
  the write happened exactly once.
- ``@modelcontextprotocol/conformance``: every server scenario it lists for 2025-11-25 and 2026-07-28
  except those ``conformance-skip.json`` names (with the reason) must pass, through a proxy that adds
  the bearer token (the suite cannot authenticate); and its authorization-server scenarios, with
  ``conformance-authorization.mjs`` playing the person at the consent page.

Without tests/node/node_modules these tests skip, except on CI (``TOASTMACHINE_REQUIRE_SERVICES=1``),
where they fail: there the Node packages are part of what is tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx2
import pytest

from tests import procs, services
from tests.deployment import deployment
from tests.test_mcp_oauth import sdk_oauth_client
from tests.test_mcp_process import TOOL_NAMES

NODE_DIR = procs.ROOT / "tests" / "node"
CONFORMANCE = NODE_DIR / "node_modules" / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"
SKIPS = NODE_DIR / "conformance-skip.json"
#: The protocol revisions ToastMachine serves, each run through the conformance suite.
REVISIONS = ("2025-11-25", "2026-07-28")
#: What each client script speaks.
CLIENTS = {"client-v2.mjs": "2026-07-28", "client-v1.mjs": "2025-11-25"}
#: Scenarios that must stay applicable at each revision (so a growing skip list cannot hollow the test out).
CORE_SCENARIOS = {"2025-11-25": {"server-initialize", "tools-list", "resources-list", "dns-rebinding-protection"},
                  "2026-07-28": {"server-stateless", "tools-list", "resources-list", "dns-rebinding-protection"}}
#: Conformance scenarios run at once.
CONFORMANCE_PARALLEL = 4
#: Seconds one Node script may take.
NODE_TIMEOUT = 120.0

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def node_modules() -> None:
    """Skip when the Node packages are not installed, except on CI, where that is a failure."""
    missing = [what for what, ok in (("node", shutil.which("node") is not None),
                                     ("tests/node/node_modules", (NODE_DIR / "node_modules").is_dir()))
               if not ok]
    if not missing:
        return
    why = f"{' and '.join(missing)} missing: run `npm ci --prefix tests/node`"
    if services.REQUIRED:
        pytest.fail(f"the Node MCP tests are required (TOASTMACHINE_REQUIRE_SERVICES=1): {why}")
    pytest.skip(why)


@dataclass
class Up:
    """A node under test: its web front and MCP URLs, and the process serving MCP."""

    web: str
    mcp: str
    process: procs.NodeProcess


@contextlib.asynccontextmanager
async def running_up(tmp_path: Path, **env: str) -> AsyncIterator[Up]:
    """``toastmachine up`` with ``env``; it must stop cleanly (exit 0, no traceback) afterwards."""
    node = await procs.start("up", env=procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "data"),
                                                       TOASTMACHINE_PORT="0", **env))
    try:
        web = await node.wait_listening(timeout=120)
        line = next(line for line in node.output if "listening on" in line)
        yield Up(web=web, mcp=line.split(" and MCP at ", 1)[1].split()[0], process=node)
    finally:
        code = await node.stop()
    assert code == 0, "\n".join(node.output[-60:])
    assert not procs.unexpected_tracebacks(node.output), "\n".join(node.output)


async def run_node(*args: str, timeout: float = NODE_TIMEOUT) -> tuple[int, str, str]:
    """Run ``node ARGS`` in tests/node; its exit code, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        "node", *args, cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("TOASTMACHINE_")})
    out, err = await procs.communicate(proc, timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def run_client(script: str, mcp_url: str, agent: str) -> dict[str, Any]:
    """Run one client script; its JSON report."""
    code, out, err = await run_node(script, mcp_url, agent)
    assert code == 0, f"{script} exited {code}:\n{err}\n{out}"
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


async def get(url: str, **params: str) -> Any:
    async with httpx2.AsyncClient(timeout=10) as http:
        r = await http.get(url, params=params)
    assert r.status_code == 200, r.text
    return r.json()


async def check_client(up: Up, script: str, agent: str) -> dict[str, Any]:
    """Run ``script`` as ``agent`` and check what it reports and what the web front serves."""
    report = await run_client(script, up.mcp, agent)
    assert report["protocol_version"] == CLIENTS[script], report["protocol_version"]
    assert report["server"]["name"] == "toastmachine"
    assert report["server"]["version"] == importlib.metadata.version("toastmachine"), report["server"]
    assert len(report["tools"]) == 18 and set(report["tools"]) == TOOL_NAMES, report["tools"]
    assert report["whoami"]["agent"]["name"] == agent
    assert report["whoami"]["agent"]["onboarded"] is True  # reading the guide onboarded it
    created = report["created"]
    # The retry with the same operation token got the stored result, not a second conversation.
    assert report["retried"] == created
    assert created["conversation"]["subject"] == f"Written by {agent}"
    assert created["conversation"]["author"]["name"] == agent
    assert report["read_back"]["conversation"] == created["conversation"]

    conversation = await get(f"{up.web}/conversations/{created['conversation']['id']}")
    assert conversation["conversation"] == created["conversation"]
    by_agent = await get(f"{up.web}/messages", author=agent)
    assert [m["id"] for m in by_agent["items"]] == [created["message"]["id"]]
    return report


async def test_node_sdk_clients_on_the_embedded_node(tmp_path: Path) -> None:
    """Both TypeScript SDKs against ``toastmachine up`` (embedded PostgreSQL, in-process bus)."""
    async with running_up(tmp_path) as up:
        for script in CLIENTS:
            await check_client(up, script, f"node-{script.removesuffix('.mjs')}")
        corpus = await get(f"{up.web}/corpus")
    assert corpus["counts"]["conversations"] == len(CLIENTS), corpus["counts"]


async def test_node_sdk_clients_on_the_procfile_processes(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """The same against the Procfile's processes on RabbitMQ and PostgreSQL: the clients talk to the
    ``mcp`` process alone, whose writes go over the bus to the ``writer`` process; checked in the
    database too."""
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
        await dep.start("writer", "writer-1")
        await dep.start("web", "web-1")
        # Started by hand: tests/deployment.py waits for the start lines of web, writer and publisher.
        port = procs.free_port()
        mcp = await procs.start(env={**dep.env, "TOASTMACHINE_NODE_ID": "mcp-1", "PORT": str(port)},
                                program=("/bin/sh", "-c", dep.commands["mcp"]))
        dep.processes["mcp-1"] = mcp  # stopped and checked for a clean exit with the others
        mcp_url = (await mcp.wait_for_line(r"ToastMachine MCP at (http://\S+)", timeout=60)).group(1)
        assert mcp_url == f"http://127.0.0.1:{port}/mcp"
        up = Up(web=dep.urls["web-1"], mcp=mcp_url, process=mcp)
        reports = {script: await check_client(up, script, f"pg-{script.removesuffix('.mjs')}")
                   for script in CLIENTS}
    conn = await asyncpg.connect(database_url)
    try:
        for script, report in reports.items():
            rows = await conn.fetch(
                "select m.id, c.subject from messages m join conversations c on c.id = m.conversation_id"
                " join agents a on a.agent_id = m.author_id where a.name = $1", f"pg-{script.removesuffix('.mjs')}")
            assert [(str(r["id"]), r["subject"]) for r in rows] == [
                (report["created"]["message"]["id"], report["created"]["conversation"]["subject"])], rows
    finally:
        await conn.close()


# --- the conformance suite -------------------------------------------------------------------------

async def conformance(*args: str) -> tuple[int, str, str]:
    return await run_node("--import", "./lib/node20.mjs", str(CONFORMANCE), *args)


async def listed_server_scenarios(revision: str) -> list[str]:
    """The server scenarios the installed suite lists for ``revision``."""
    code, out, err = await conformance("list", "--server", "--spec-version", revision)
    assert code == 0, err
    names = re.findall(r"^\s+- (\S+) \[", out, re.MULTILINE)
    assert names, out
    return names


def checks_of(output_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """``{scenario: checks}`` from a suite run's output directory (one ``<kind>-<scenario>-<time>``
    directory per scenario, each with a checks.json)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in output_dir.glob("*/checks.json"):
        scenario = re.sub(r"^(server|authorization-server)-", "", path.parent.name)
        scenario = re.sub(r"-\d{4}-\d{2}-\d{2}T[\d-]+Z$", "", scenario)
        out[scenario] = json.loads(path.read_text())
    return out


def failures(checks: list[dict[str, Any]], allowed: dict[str, str]) -> list[str]:
    return [f"{c['id']}: {c.get('errorMessage')}" for c in checks
            if c["status"] == "FAILURE" and c["id"] not in allowed]


async def bearer_token(mcp_url: str) -> str:
    """An access token (read and write) for ``mcp_url``, by the SDK's own OAuth client and the consent page."""
    auth, storage = sdk_oauth_client(mcp_url, agent_name="conformance-suite", client_name="conformance run",
                                     scope="toastmachine:read toastmachine:write")
    async with httpx2.AsyncClient(auth=auth, timeout=30) as http:
        # Any request to /mcp: its 401 starts the OAuth flow, then the request is retried with the token.
        await http.post(mcp_url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                        headers={"Accept": "application/json, text/event-stream"})
    assert storage.tokens is not None, "the OAuth flow did not end with a token"
    return storage.tokens.access_token


async def test_conformance_server_scenarios(tmp_path: Path) -> None:
    """Every applicable server scenario, at both revisions, passes; conformance-skip.json stays true."""
    skips = json.loads(SKIPS.read_text())
    not_applicable: dict[str, str] = skips["not_applicable"]
    allowed_checks: dict[str, dict[str, str]] = skips["not_applicable_checks"]
    listed = {revision: await listed_server_scenarios(revision) for revision in REVISIONS}
    known = {name for names in listed.values() for name in names}
    stale = sorted((set(not_applicable) | set(allowed_checks)) - known)
    assert not stale, f"conformance-skip.json names scenarios the suite does not have: {stale}"

    # The node's public URL is the proxy's, as behind a load balancer: the suite's Host and Origin are
    # the node's own, and the token's audience is that URL.
    port, upstream = procs.free_port(), procs.free_port()
    public = f"http://127.0.0.1:{port}"
    token_file = tmp_path / "token"
    async with running_up(tmp_path, TOASTMACHINE_MCP_PUBLIC_URL=public, TOASTMACHINE_MCP_PORT=str(upstream)) as up:
        assert up.mcp == f"{public}/mcp"
        proxy = await procs.start("lib/bearer-proxy.mjs", str(port), f"http://127.0.0.1:{upstream}",
                                  str(token_file), env=os.environ, cwd=NODE_DIR, program=("node",))
        try:
            await proxy.wait_for_line(r"proxy listening on", timeout=30)
            token_file.write_text(await bearer_token(up.mcp))
            # One suite process per scenario (the CLI takes one), a few at a time: each spends most
            # of its time starting Node, and the scenarios are independent sessions.
            limit = asyncio.Semaphore(CONFORMANCE_PARALLEL)

            async def run(revision: str, scenario: str) -> None:
                async with limit:
                    code, out, err = await conformance(
                        "server", "--url", up.mcp, "--scenario", scenario, "--spec-version", revision,
                        "-o", str(tmp_path / f"conformance-{revision}"))
                assert code in (0, 1), f"{scenario}: the suite itself failed ({code}):\n{err}\n{out}"

            await asyncio.gather(*(run(revision, scenario) for revision in REVISIONS
                                   for scenario in listed[revision] if scenario not in not_applicable))
            results = {revision: checks_of(tmp_path / f"conformance-{revision}") for revision in REVISIONS}
        finally:
            await proxy.stop()

    problems = []
    for revision, by_scenario in results.items():
        expected = [s for s in listed[revision] if s not in not_applicable]
        assert CORE_SCENARIOS[revision] <= set(expected), (revision, expected)
        assert sorted(by_scenario) == sorted(expected), (revision, sorted(by_scenario))
        for scenario, checks in by_scenario.items():
            assert checks, f"{scenario} at {revision} made no checks"
            problems += [f"{revision} {scenario} {f}" for f in failures(checks, allowed_checks.get(scenario, {}))]
    assert not problems, "conformance failures:\n" + "\n".join(problems)


async def test_conformance_authorization_server(tmp_path: Path) -> None:
    """The suite's authorization-server scenarios (metadata; the authorization code grant with PKCE,
    state and iss, through our consent page) against the MCP front's OAuth server."""
    async with running_up(tmp_path) as up:
        issuer = up.mcp.removesuffix("/mcp")
        code, out, err = await run_node("conformance-authorization.mjs", issuer, str(tmp_path / "auth"))
    assert code == 0, f"exit {code}:\n{err}\n{out}"
    results = checks_of(tmp_path / "auth")
    assert sorted(results) == ["authorization-code-grant", "authorization-server-metadata-endpoint"], results
    for scenario, checks in results.items():
        assert any(c["status"] == "SUCCESS" for c in checks), (scenario, checks)
        assert not failures(checks, {}), (scenario, checks)

