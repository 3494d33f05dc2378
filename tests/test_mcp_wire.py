"""The SDK seams on the MCP front's call path: actors/mcp/server.py's ``get_tool_input_schema``
answer, and actors/mcp/wire.py with the SDK internal it wraps, which must still be there, shaped as
assumed, and the body written must be the same JSON as the SDK's own ``_write`` writes.

Both writers run as ASGI apps and their answers (status, headers, body) are compared; the SDK's
function is the one ``handle_modern_request`` calls, looked up by its module name as the SDK does.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Annotated, Any

import orjson
import pytest
from mcp.server import _streamable_http_modern as modern
from mcp.shared.inbound import X_MCP_HEADER_KEY, validate_mcp_param_headers
from mcp_types import ErrorData, JSONRPCError, JSONRPCResponse
from pydantic import Field

from actors.mcp import sdk_internals, wire
from actors.mcp.app import build_app
from actors.mcp.server import ToastMachineServer, declares_header
from actors.mcp.tools import ToolDeps, register_tools
from infra.config import Settings
from protocol.errors import ConfigError


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


# --- the get_tool_input_schema hook (actors/mcp/server.py) ---------------------------------------------


def _served() -> ToastMachineServer:
    server = ToastMachineServer("hooks-test")
    deps = ToolDeps(db=None, bus=None, settings=Settings(), identity=None, identity_error=None,  # type: ignore[arg-type]
                    grant=lambda: None)  # type: ignore[arg-type,return-value]
    register_tools(server, deps)  # registration touches neither the database nor the bus
    return server


def test_the_sdk_asks_our_hook_for_header_schemas() -> None:
    server = _served()
    hook = server._lowlevel_server.get_tool_input_schema
    assert getattr(hook, "__func__", None) is ToastMachineServer._tool_input_schema


def test_no_tool_declares_a_header_so_the_hook_answers_none_and_the_sdk_would_find_nothing() -> None:
    server = _served()
    tools = server._tool_manager.list_tools()
    assert len(tools) == 18
    headers = {"mcp-param-conversation": "x", "mcp-param-limit": "5", "mcp-method": "tools/call"}
    for tool in tools:
        assert not declares_header(tool.parameters), tool.name
        assert server._tool_input_schema(tool.name) is None
        # What the SDK's check says against the real schema: nothing, for any headers.
        arguments = {name: "x" for name in tool.parameters.get("properties", {})}
        assert validate_mcp_param_headers(tool.parameters, arguments, headers) is None
    assert server._tool_input_schema("no_such_tool") is None


def test_a_tool_that_declares_a_header_gets_its_schema_and_the_sdks_check() -> None:
    server = ToastMachineServer("hooks-test")

    @server.tool(name="routed")
    async def routed(region: Annotated[str, Field(json_schema_extra={X_MCP_HEADER_KEY: "Region"})]) -> str:
        return region

    schema = server._tool_input_schema("routed")
    assert schema is not None and declares_header(schema)
    rejection = validate_mcp_param_headers(schema, {"region": "eu"}, {"mcp-param-region": "us"})
    assert rejection is not None
    assert validate_mcp_param_headers(schema, {"region": "eu"}, {"mcp-param-region": "eu"}) is None


def test_the_session_manager_internals_the_front_reads_are_there() -> None:
    """The installed SDK has every internal actors/mcp/sdk_internals.py lists (the session tables,
    the transport's stream table, the low-level server): the app builds."""
    server = ToastMachineServer(name="toastmachine")
    server.streamable_http_app(json_response=True)
    assert sdk_internals.missing_internals(server) == []
    sdk_internals.check_internals(server)


def test_an_sdk_without_them_is_refused_when_the_app_is_built_naming_the_version() -> None:
    """An SDK release whose session manager no longer keeps the owners table is refused at build time
    with the installed version and the release line to install, not met as an AttributeError
    inside a client's request."""
    server = ToastMachineServer(name="toastmachine")
    server.streamable_http_app(json_response=True)
    del server.session_manager._session_owners  # as a release that renamed it would have it
    with pytest.raises(ConfigError) as refused:
        sdk_internals.check_internals(server)
    message = str(refused.value)
    assert "StreamableHTTPSessionManager._session_owners" in message
    assert f"mcp {importlib.metadata.version('mcp')}" in message
    assert f"'mcp>={sdk_internals.TESTED},<" in message
    assert "_server_instances" not in message  # only what is missing
