"""The MCP SDK internals the front relies on, checked once when the app is built.

The SDK offers no public way to count an agent's open sessions, to tell whether a session (or its
standalone GET stream) is still there, or to end every session at shutdown, so the front reads its
session manager's tables (:mod:`actors.mcp.app`, :mod:`actors.mcp.notify`, :mod:`actors.mcp.front`);
nor to look a tool up by name, or to answer the input-schema hook cheaply (:mod:`actors.mcp.server`).
The dependency range lets pip install a later SDK release that may rename them; without this check
that would surface as an ``AttributeError`` in the middle of a client's request (a 500, a
notification silently lost). With it, the process refuses to start and says which SDK version
lacks what, so the operator pins the release the tests ran against.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from mcp.server.lowlevel import Server as LowLevelServer
from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http import StreamableHTTPServerTransport

from protocol.errors import ConfigError

#: The SDK release line the tests run against (pyproject.toml allows later 2.x releases: this check
#: is what refuses one that reshaped these internals).
TESTED = "2.3"


def missing_internals(server: Any) -> list[str]:
    """What of the SDK internals the front uses ``server`` (an ``MCPServer`` whose Streamable HTTP
    app is built) and the SDK's classes lack, by name; empty when all are there in the expected shape."""
    missing: list[str] = []
    session_manager = getattr(server, "session_manager", None)
    for name in ("_server_instances", "_session_owners"):
        if not isinstance(getattr(session_manager, name, None), dict):
            missing.append(f"StreamableHTTPSessionManager.{name} (a dict)")
    transport = StreamableHTTPServerTransport(mcp_session_id=None)
    if not isinstance(getattr(transport, "_request_streams", None), dict):
        missing.append("StreamableHTTPServerTransport._request_streams (a dict)")
    if not callable(getattr(transport, "terminate", None)) or not hasattr(transport, "is_terminated"):
        missing.append("StreamableHTTPServerTransport.terminate() and .is_terminated")
    if not callable(getattr(getattr(server, "_tool_manager", None), "get_tool", None)):
        missing.append("MCPServer._tool_manager.get_tool()")
    if not callable(getattr(MCPServer, "_tool_input_schema", None)):
        # actors/mcp/server.py overrides it: under another name the override would be skipped silently.
        missing.append("MCPServer._tool_input_schema()")
    if not isinstance(getattr(server, "_lowlevel_server", None), LowLevelServer):
        missing.append("MCPServer._lowlevel_server (a lowlevel.Server)")
    if not callable(getattr(LowLevelServer, "add_request_handler", None)):
        missing.append("lowlevel.Server.add_request_handler()")
    return missing


def check_internals(server: Any) -> None:
    """Raise :class:`ConfigError` naming the installed SDK version and what it lacks, if anything."""
    missing = missing_internals(server)
    if missing:
        version = importlib.metadata.version("mcp")
        raise ConfigError(
            f"the installed MCP SDK (mcp {version}) lacks what the MCP front uses: {', '.join(missing)}. "
            f"Install the release line it is tested with: pip install 'mcp>={TESTED},<{_next(TESTED)}'.")


def _next(line: str) -> str:
    major, minor = line.split(".")
    return f"{major}.{int(minor) + 1}"
