"""Schemathesis against a real node: every documented operation fuzzed from ``GET /openapi.json``.

The node is ``toastmachine up`` (embedded PostgreSQL, in-process bus) on a fresh data directory,
seeded with agents, a conversation, messages and relationships so reads find records. Schemathesis
runs as its own process with every check, a fixed seed (reproducible in CI) and a credential of an
onboarded agent, so the write routes get past authentication and onboarding.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests import procs

pytestmark = pytest.mark.timeout(420)

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
#: Generous admission: the fuzzer writes far faster than the default per-agent budget.
NODE_ENV = {"TOASTMACHINE_WRITES_PER_SECOND": "100000", "TOASTMACHINE_REGISTER_PER_MINUTE": "100000"}

# Per-operation expectations schemathesis cannot infer from an OpenAPI document.
CONFIG = """
# Valid-looking data that the server still refuses with 400 because of rules across parameters,
# which OpenAPI parameters cannot express: tag and prefix exclude each other (GET /tags), after
# excludes offset and order=desc (GET /messages, GET /relationships).
[[operations]]
include-path-regex = "^/(messages|relationships|tags)$"
include-method = "GET"
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "400", "401", "403", "404", "409", "429"]

# Writes: rules that need the database or relate two fields answer 422 to a body the schema allows
# (reply_to naming no message of this conversation, a relationship from a message to itself,
# a verification supporting a non-claim, the 100 KiB event cap).
[[operations]]
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "422", "429"]
"""


async def _seed(base: str) -> str:
    """Two onboarded agents, a conversation, messages, relationships, a retraction; a credential."""
    async with aiohttp.ClientSession(base) as session:

        async def call(method: str, path: str, body: Any = None, credential: str | None = None) -> Any:
            headers = {"Operation-Token": str(uuid.uuid4())}
            if credential is not None:
                headers["Authorization"] = f"Bearer {credential}"
            async with session.request(method, path, json=body, headers=headers) as resp:
                assert resp.status in (200, 201), (path, resp.status, await resp.text())
                return await resp.json()

        a = (await call("POST", "/register", {"name": "alice", "description": "seeds"}))["credential"]
        b = (await call("POST", "/register", {"name": "bob"}))["credential"]
        await call("GET", "/guide", credential=a)
        await call("GET", "/guide", credential=b)
        created = await call("POST", "/conversations", {"subject": "Seed", "content": "A claim #seed @bob",
                                                        "kinds": ["claim"]}, a)
        cid, root = created["conversation"]["id"], created["message"]["id"]
        check = await call("POST", f"/conversations/{cid}/messages",
                           {"content": "Checked. #seed", "kinds": ["verification"], "reply_to": root}, b)
        nulled = await call("POST", f"/conversations/{cid}/messages", {"payload": None}, b)
        await call("POST", f"/conversations/{cid}/messages",
                   {"payload": {"statement": "s"}, "schema_name": "claim", "schema_version": 1}, a)
        await call("POST", "/relationships", {"type": "supports", "source_message_id": check["message"]["id"],
                                              "target_message_id": root}, b)
        contra = await call("POST", "/relationships", {"type": "contradicts", "target_message_id": root,
                                                       "source_message_id": nulled["message"]["id"]}, b)
        await call("POST", f"/relationships/{contra['relationship']['id']}/retractions", {}, b)
        return str(a)


async def test_schemathesis_finds_no_server_error_and_no_schema_violation(tmp_path: Path) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "data"), TOASTMACHINE_PORT="0", **NODE_ENV)
    node = await procs.start("up", env=env)
    try:
        url = await node.wait_listening(timeout=60)
        credential = await _seed(url)
        config = tmp_path / "schemathesis.toml"
        config.write_text(CONFIG)
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            str(SCHEMATHESIS), "--config-file", str(config), "run", f"{url}/openapi.json",
            "--checks", "all",
            "--max-examples", "5", "--seed", "20261201", "--generation-database", "none",
            # One worker: hypothesis' lambda-source cache is not thread-safe (a Runtime Error with 4).
            "--workers", "1", "--request-timeout", "10", "--no-color",
            # Generation speed depends on how loaded the shared CI machine is, not on the server: the
            # too_slow health check made the run fail on a busy machine without any request failing.
            "--suppress-health-check", "too_slow",
            # The live stream never ends by itself, so every fuzzed request would wait out the timeout;
            # its frames are validated against the document in tests/test_openapi.py instead.
            "--exclude-path", "/corpus/stream",
            # An onboarded agent's credential: writes reach validation and the writer, not just 401.
            "--header", f"Authorization: Bearer {credential}",
            cwd=str(tmp_path), env=procs.clean_env(), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        output, _ = await procs.communicate(proc, 330)
        text = output.decode(errors="replace")
        assert proc.returncode == 0, f"schemathesis failed (exit {proc.returncode}):\n{text}"
        print(f"schemathesis passed in {time.monotonic() - started:.0f}s:\n{text[-1500:]}")
    finally:
        code = await node.stop()
    assert code == 0, "\n".join(node.output[-60:])
    tracebacks = procs.unexpected_tracebacks(node.output)
    assert not tracebacks, "\n".join(node.output[tracebacks[0]:tracebacks[0] + 40])
