"""actors/mcp/wire.py and the SDK internal it wraps: it must still be there, shaped as
assumed, and the body written must be the same JSON as the SDK's own ``_write`` writes.

Both writers run as ASGI apps and their answers (status, headers, body) are compared; the SDK's
function is the one ``handle_modern_request`` calls, looked up by its module name as the SDK does.
"""

from __future__ import annotations

import inspect
from typing import Any

import orjson
import pytest
from mcp.server import _streamable_http_modern as modern
from mcp_types import ErrorData, JSONRPCError, JSONRPCResponse

from actors.mcp import wire
from actors.mcp.app import build_app
from infra.config import Settings


def _sdk_write() -> Any:
    return getattr(modern._write, "__wrapped__", modern._write)


def test_the_sdk_internal_is_still_what_wire_assumes() -> None:
    write = _sdk_write()
    assert inspect.iscoroutinefunction(write)
    assert list(inspect.signature(write).parameters) == ["msg", "scope", "receive", "send"]
    # The SDK calls it by its module-level name (so that wrapping the name reaches every call) ...
    assert "_write" in modern.handle_modern_request.__code__.co_names
    # ... and serialises it as wire.py reproduces: a model_dump in JSON mode, then json.dumps.
    source = inspect.getsource(write)
    assert 'msg.model_dump(mode="json", by_alias=True, exclude_none=True)' in source
    assert "json.dumps(body" in source
    assert tuple(JSONRPCResponse.model_fields) == wire.RESPONSE_FIELDS
    assert JSONRPCResponse.model_config.get("extra") in (None, "ignore")


def test_install_wraps_once_and_build_app_installs_it() -> None:
    build_app(Settings(), db=None)  # type: ignore[arg-type] # nothing touches the database at build time
    installed = modern._write
    assert getattr(installed, "__wrapped__", None) is _sdk_write()
    wire.install()
    assert modern._write is installed


async def _answer(write: Any, msg: Any) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await write(msg, {"type": "http", "method": "POST", "path": "/mcp", "headers": []}, receive, send)
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body


_TEXT = orjson.dumps({"items": [{"content": 'quote " backslash \\ é ✓ \u2028', "n": 1.5}], "next": None}).decode()
RESULTS = [
    {"content": [{"type": "text", "text": _TEXT}], "structuredContent": orjson.loads(_TEXT), "isError": False,
     "resultType": "complete", "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "t", "version": "1"}}},
    {"nested": {"empty": {}, "list": [], "none": None, "big": 2**53 + 1, "neg": -0.0, "f": 1e-7}},
    {"huge": 2**70},  # past orjson's 64 bits: left to the SDK
    {},
]


@pytest.mark.parametrize("result", RESULTS)
@pytest.mark.parametrize("request_id", [7, "req-1"])
async def test_the_same_answer_as_the_sdks_own_write(result: dict[str, Any], request_id: int | str) -> None:
    msg = JSONRPCResponse(jsonrpc="2.0", id=request_id, result=result)
    ours = await _answer(wire.fast_write(_sdk_write()), msg)
    theirs = await _answer(_sdk_write(), msg)
    assert ours[0] == theirs[0] == 200
    assert ours[1] == {**theirs[1], b"content-length": str(len(ours[2])).encode()}
    assert orjson.loads(ours[2]) == orjson.loads(theirs[2]) if "huge" not in result else ours == theirs


async def test_errors_are_left_to_the_sdk() -> None:
    for msg in (JSONRPCError(jsonrpc="2.0", id=None, error=ErrorData(code=-32600, message="bad")),
                JSONRPCError(jsonrpc="2.0", id=3, error=ErrorData(code=-32602, message="bad params"))):
        assert wire.encode_response(msg) is None  # type: ignore[arg-type]
        assert await _answer(wire.fast_write(_sdk_write()), msg) == await _answer(_sdk_write(), msg)
