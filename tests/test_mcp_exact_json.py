"""MCP writes keep JSON exactly, as HTTP writes do (docs/contract.md §3): the SDK's own parser would
keep the last of a repeated key, round numbers to doubles and read NaN, Infinity and 1e400 (which
then reached the history as null), so the MCP front reads a ``tools/call`` body as the HTTP API
reads one and the tool refuses what that refuses. Against the Procfile's ``writer`` and ``mcp``
processes on RabbitMQ and PostgreSQL, with raw JSON-RPC bodies (no client library writes them).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from tests import procs
from tests.test_mcp_faults import MCP_STARTED, WAIT, WRITER_STARTED, _onboard_and_get_token
from tests.test_mcp_oauth import _MCP_HEADERS, META, _tokens

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(240)]

#: (payload text as sent, the code it is refused with, the pointer into the arguments).
REFUSED = [
    ('{"v": 1e400}', "number_not_exact", "/payload/v"),
    ('{"v": 1e-400}', "number_not_exact", "/payload/v"),
    ('{"v": 0.12345678901234567890}', "number_not_exact", "/payload/v"),
    ('{"v": 123456789012345678901234567890}', "number_not_exact", "/payload/v"),
    ('{"v": 1, "v": 2}', "duplicate_key", "/payload/v"),
    ('{"v": 1, "\\u0076": 2}', "duplicate_key", "/payload/v"),
    ('{"v": NaN}', "invalid_json", None),
    ('{"v": -Infinity}', "invalid_json", None),
]


def _body(subject: str, token: str, payload: str) -> bytes:
    return (f'{{"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {{"name": "create_conversation", '
            f'"arguments": {{"subject": {orjson.dumps(subject).decode()}, "content": "exact", '
            f'"operation_token": "{token}", "payload": {payload}}}, "_meta": {orjson.dumps(META).decode()}}}}}').encode()


async def test_mcp_writes_refuse_what_http_writes_refuse_and_store_the_rest_exactly(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    port = procs.free_port()
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_AMQP_URL=rabbitmq_url,
                          TOASTMACHINE_DATABASE_URL=database_url, TOASTMACHINE_MCP_PORT=str(port))
    running: list[procs.NodeProcess] = []
    db = await asyncpg.connect(database_url)
    try:
        for args, ready in ((("run", "writer"), WRITER_STARTED), (("mcp",), MCP_STARTED)):
            proc = await procs.start(*args, env=env)
            running.append(proc)
            await proc.wait_for_line(ready, timeout=WAIT)
        mcp_url = f"http://127.0.0.1:{port}/mcp"
        async with httpx.AsyncClient(timeout=30) as http:
            _, tokens = await _tokens(http, mcp_url.removesuffix("/mcp"), scope="toastmachine:read toastmachine:write")
            access = tokens["access_token"]
            await _onboard_and_get_token(mcp_url, access)
            headers = {**_MCP_HEADERS, "Authorization": f"Bearer {access}", "MCP-Protocol-Version": "2026-07-28",
                       "Mcp-Method": "tools/call", "Mcp-Name": "create_conversation"}

            async def call(subject: str, payload: str) -> dict[str, Any]:
                r = await http.post(mcp_url, headers=headers, content=_body(subject, str(uuid.uuid4()), payload))
                assert r.status_code == 200, r.text
                result: dict[str, Any] = r.json()["result"]
                return result

            for payload, code, pointer in REFUSED:
                subject = f"refused {uuid.uuid4().hex[:8]}"
                result = await call(subject, payload)
                error = result["structuredContent"]["error"]
                assert result["isError"] is True and error["upstream_code"] == code, (payload, result)
                assert error["outcome"] == "not_applied" and error.get("pointer") == pointer, (payload, error)
                assert await db.fetchval("select count(*) from conversations where subject = $1", subject) == 0

            # What HTTP accepts, MCP stores as HTTP does: big integers as written, doubles canonical.
            subject = f"kept {uuid.uuid4().hex[:8]}"
            result = await call(subject, '{"big": 18446744073709551615, "low": -9223372036854775808, "d": 1.50}')
            assert result["isError"] is False, result
            stored = await db.fetchval("select payload::text from messages m join conversations c "
                                       "on c.id = m.conversation_id where c.subject = $1", subject)
            assert orjson.loads(stored) == {"big": 18446744073709551615, "low": -9223372036854775808, "d": 1.5}
    finally:
        await db.close()
        for proc in running:
            await proc.stop()
    for proc in running:  # a refusal is an answer, not a crash
        assert not procs.unexpected_tracebacks(proc.output), "\n".join(proc.output)
