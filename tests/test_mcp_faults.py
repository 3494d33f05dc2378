"""The MCP front under a real fault: ``toastmachine mcp`` killed with SIGKILL in the middle of a write.

Processes: a corpus writer (``toastmachine run writer``) and an MCP front (``toastmachine mcp``) on
RabbitMQ (a virtual host of this run's own) and a fresh PostgreSQL database. The write is caught
mid-flight deterministically: the writer is stopped first, so the MCP front's command waits in the
writer's durable queue (seen there with a passive declare) while the client waits for the answer;
then the MCP process is killed with SIGKILL, a writer starts and applies the command that nobody
will hear the answer of, and the MCP front is started again on the same port.

The contract (SPEC: idempotent writes): the client's retry of the identical call with the same
``operation_token`` answers the stored result and the write has exactly one effect, counted in the
database; and the grants outlive the process: the access tokens issued before the kill (two grants,
two clients) still work after the restart, and a refresh token still rotates.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import httpx
import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from protocol.routing import WRITER_QUEUE_PREFIX
from tests import procs
from tests.test_mcp_oauth import _MCP_HEADERS, META, _refresh, _tokens

pytestmark = [pytest.mark.fault, pytest.mark.postgres, pytest.mark.timeout(240)]

WRITER_STARTED = r"ToastMachine running writer"
MCP_STARTED = r"ToastMachine MCP at (http://\S+)"
WAIT = 60.0


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = WAIT) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def _call(http: httpx.AsyncClient, mcp_url: str, token: str, tool: str, arguments: dict[str, Any],
                *, timeout: float = 30) -> dict[str, Any]:
    """One stateless (2026-07-28) ``tools/call``; the JSON-RPC result."""
    headers = {**_MCP_HEADERS, "Authorization": f"Bearer {token}", "MCP-Protocol-Version": "2026-07-28",
               "Mcp-Method": "tools/call", "Mcp-Name": tool}
    r = await http.post(mcp_url, headers=headers, timeout=timeout,
                        json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                              "params": {"name": tool, "arguments": arguments, "_meta": META}})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()["result"]
    return result


async def _onboard_and_get_token(mcp_url: str, access_token: str) -> str:
    """Read the guide resource (which onboards the grant's agent) and get an operation_token, with the
    SDK's client holding only the bearer token."""
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {access_token}"}, timeout=30) as http, \
            streamable_http_client(mcp_url, http_client=http) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        await session.read_resource("toastmachine://guide")  # type: ignore[arg-type]
        issued = await session.call_tool("get_operation_token", {})
    assert not issued.is_error, issued
    return str(issued.structured_content["operation_token"])  # type: ignore[index]


async def test_mcp_killed_mid_write_then_restarted_retry_has_one_effect_and_grants_survive(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    port = procs.free_port()
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_AMQP_URL=rabbitmq_url,
                          TOASTMACHINE_DATABASE_URL=database_url, TOASTMACHINE_MCP_PORT=str(port),
                          # Long enough that the writer started after the kill still finds the command
                          # awaited (it skips work past its requester's deadline).
                          TOASTMACHINE_COMMAND_TIMEOUT="120")
    running: list[procs.NodeProcess] = []

    async def start(*args: str, ready: str) -> procs.NodeProcess:
        proc = await procs.start(*args, env=env)
        running.append(proc)
        await proc.wait_for_line(ready, timeout=WAIT)
        return proc

    db = await asyncpg.connect(database_url)
    broker = await aio_pika.connect(rabbitmq_url)
    try:
        writer = await start("run", "writer", ready=WRITER_STARTED)
        mcp = await start("mcp", ready=MCP_STARTED)
        mcp_url = f"http://127.0.0.1:{port}/mcp"
        base = mcp_url.removesuffix("/mcp")
        async with httpx.AsyncClient() as http:
            client_id, tokens = await _tokens(http, base, scope="toastmachine:read toastmachine:write")
            access = tokens["access_token"]
            _, reader = await _tokens(http, base)  # a second grant, another client, read only
            operation_token = await _onboard_and_get_token(mcp_url, access)
            subject = f"Written across a kill -9 {uuid.uuid4().hex[:8]}"
            arguments = {"subject": subject, "content": "one effect, whatever dies",
                         "operation_token": operation_token}

            # No writer: the command will wait in the writer's (durable) queue.
            assert await writer.stop() == 0, "\n".join(writer.output)
            corpus_id = await db.fetchval("select corpus_id from corpus_witness")
            channel = await broker.channel()
            queue_name = WRITER_QUEUE_PREFIX + str(corpus_id)

            async def queued() -> bool:
                queue = await channel.declare_queue(queue_name, passive=True)
                return (queue.declaration_result.message_count or 0) >= 1

            in_flight = asyncio.create_task(_call(http, mcp_url, access, "create_conversation", arguments,
                                                  timeout=WAIT))
            await until(queued, "the MCP front's command in the writer queue")
            assert not in_flight.done()

            mcp.signal(signal.SIGKILL)  # a real kill -9: no shutdown, no answer to the client
            assert await mcp.wait(timeout=30) == -signal.SIGKILL
            with pytest.raises(httpx.TransportError):
                await in_flight  # the client saw the connection die: the outcome is unknown to it

            # A writer applies the command the dead process sent; nobody hears its answer.
            await start("run", "writer", ready=WRITER_STARTED)

            async def applied() -> bool:
                return bool(await db.fetchval("select count(*) from conversations where subject = $1", subject))

            await until(applied, "the write to be applied")

            # The MCP front again, same port: the client retries the identical call, same token.
            await start("mcp", ready=MCP_STARTED)
            retried = await _call(http, mcp_url, access, "create_conversation", arguments)
            assert not retried.get("isError"), retried
            conversation = retried["structuredContent"]["conversation"]
            assert conversation["subject"] == subject

            # Exactly one effect.
            rows = await db.fetch("select id from conversations where subject = $1", subject)
            assert [str(r["id"]) for r in rows] == [conversation["id"]]
            assert await db.fetchval("select count(*) from messages where conversation_id = $1",
                                     rows[0]["id"]) == 1
            assert await db.fetchval("select count(*) from operations where token = $1", operation_token) == 1

            # Every grant outlived the process: the old access tokens read, and a refresh token rotates.
            me = await _call(http, mcp_url, access, "whoami", {})
            assert not me.get("isError"), me
            other = await _call(http, mcp_url, reader["access_token"], "whoami", {})
            assert not other.get("isError"), other
            assert other["structuredContent"]["agent"]["agent_id"] != me["structuredContent"]["agent"]["agent_id"]
            refreshed = await _refresh(http, base, client_id, tokens["refresh_token"])
            assert refreshed.status_code == 200, refreshed.text
            again = await _call(http, mcp_url, refreshed.json()["access_token"], "whoami", {})
            assert again["structuredContent"]["agent"]["agent_id"] == me["structuredContent"]["agent"]["agent_id"]
    finally:
        await broker.close()
        await db.close()
        for proc in running:
            if proc.proc.returncode is None:
                await proc.stop()
    # Every process but the killed one stopped cleanly on SIGTERM.
    for proc in running:
        assert proc.proc.returncode in (0, -signal.SIGKILL), "\n".join(proc.output)
    assert sum(proc.proc.returncode == -signal.SIGKILL for proc in running) == 1


async def test_the_mcp_front_answers_503_while_its_broker_or_database_is_away(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """Real outages (forwarders in front of RabbitMQ and PostgreSQL, cut and restored): a write
    while the broker is away and a token check, a token refresh and a registration while the
    database is away are each a 503 to retry, as over HTTP, never a 500; and no traceback is logged."""
    from urllib.parse import urlsplit

    from tests.tcp_proxy import TcpProxy

    amqp, pg = urlsplit(rabbitmq_url), urlsplit(database_url)
    amqp_proxy, pg_proxy = TcpProxy(amqp.hostname or "127.0.0.1", amqp.port or 5672), \
        TcpProxy(pg.hostname or "127.0.0.1", pg.port or 5432)
    await amqp_proxy.up()
    await pg_proxy.up()
    port = procs.free_port()
    via_amqp = rabbitmq_url.replace(amqp.netloc, f"{amqp.netloc.rpartition('@')[0]}@127.0.0.1:{amqp_proxy.port}")
    via_pg = database_url.replace(pg.netloc, f"{pg.netloc.rpartition('@')[0]}@127.0.0.1:{pg_proxy.port}"
                                  if "@" in pg.netloc else f"127.0.0.1:{pg_proxy.port}")
    base_env = {"TOASTMACHINE_DATA_DIR": str(tmp_path), "TOASTMACHINE_AMQP_URL": rabbitmq_url,
                    "TOASTMACHINE_DATABASE_URL": database_url, "TOASTMACHINE_MCP_PORT": str(port),
                    "TOASTMACHINE_COMMAND_TIMEOUT": "8"}
    writer = await procs.start("run", "writer", env=procs.clean_env(**base_env))
    mcp = await procs.start("mcp", env=procs.clean_env(**{**base_env, "TOASTMACHINE_AMQP_URL": via_amqp,
                                                          "TOASTMACHINE_DATABASE_URL": via_pg}))
    db = await asyncpg.connect(database_url)
    try:
        await writer.wait_for_line(WRITER_STARTED, timeout=WAIT)
        await mcp.wait_for_line(MCP_STARTED, timeout=WAIT)
        mcp_url = f"http://127.0.0.1:{port}/mcp"
        base = mcp_url.removesuffix("/mcp")
        async with httpx.AsyncClient(timeout=60) as http:
            client_id, tokens = await _tokens(http, base, scope="toastmachine:read toastmachine:write")
            _, unused = await _tokens(http, base)  # never used: its first check needs the database
            token = await _onboard_and_get_token(mcp_url, tokens["access_token"])
            subject = f"while the broker is away {uuid.uuid4().hex[:8]}"

            await amqp_proxy.down()
            result = await _call(http, mcp_url, tokens["access_token"], "create_conversation",
                                 {"subject": subject, "content": "c", "operation_token": token}, timeout=60)
            error = result["structuredContent"]["error"]
            assert result["isError"] and (error["http_status"], error["category"]) == (503, "unavailable"), error
            assert error["retryable"] is True and error["upstream_code"] == "service_unavailable", error
            await amqp_proxy.up()
            assert await db.fetchval("select count(*) from conversations where subject = $1", subject) == 0

            await pg_proxy.down()
            headers = {**_MCP_HEADERS, "Authorization": f"Bearer {unused['access_token']}",
                       "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": "whoami"}
            r = await http.post(mcp_url, headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                                                "params": {"name": "whoami", "arguments": {},
                                                                           "_meta": META}})
            assert r.status_code == 503 and r.json()["error"] == "temporarily_unavailable", r.text
            assert r.headers["retry-after"] == "5"
            r = await _refresh(http, base, client_id, tokens["refresh_token"])
            assert r.status_code == 503 and r.json()["error"] == "temporarily_unavailable", r.text
            r = await http.post(base + "/register", json={"redirect_uris": ["http://127.0.0.1/cb"]})
            assert r.status_code == 503, r.text
            await pg_proxy.up()

            async def answers() -> bool:
                r = await http.post(mcp_url, headers=headers, json={
                    "jsonrpc": "2.0", "id": 2, "method": "tools/call",
                    "params": {"name": "whoami", "arguments": {}, "_meta": META}})
                return r.status_code == 200

            await until(answers, "the MCP front to answer again once its database is back")
    finally:
        await db.close()
        for proc in (mcp, writer):
            await proc.stop()
        await amqp_proxy.down()
        await pg_proxy.down()
    assert not procs.unexpected_tracebacks(mcp.output), "\n".join(mcp.output)
