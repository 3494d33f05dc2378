"""The MCP front's server: the SDK's ``MCPServer``, with argument errors in our error contract.

The SDK validates a tool's arguments against the tool's signature before the tool runs; a call whose
arguments do not fit (a string where an integer goes, a required argument missing) or that names no
tool we serve would otherwise get the SDK's plain-text error, which quotes the caller's values and
pydantic's wording. :class:`ToastMachineServer` answers those calls with the same ``isError``
envelope as every other refusal (:mod:`actors.mcp.results`), with fixed text that names only the
argument (a name from the tool's own schema), never the value sent. An argument the tool does not
take is refused too (the SDK would ignore it), quoting its name as the HTTP API quotes an unknown
parameter (bounded, :func:`protocol.errors.quote`).

It also leaves out the SDK's OpenTelemetry middleware (the SDK's documented opt-out: drop it from
the middleware list): ToastMachine installs no tracer, and the span it opens and closes on every
message anyway was a measurable share of a call's CPU (bench/mcp.py).
"""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp_types import CallToolResult, InputRequiredResult
from pydantic import ValidationError

from actors.mcp import results

#: The SDK's built-in tracing middleware (class name; its module is private).
_SDK_TRACING_MIDDLEWARE = "OpenTelemetryMiddleware"


class ToastMachineServer(MCPServer):
    """``MCPServer`` whose argument-validation failures and unknown tools are envelope results."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.middleware[:] = [m for m in self.middleware if type(m).__name__ != _SDK_TRACING_MIDDLEWARE]

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None,
                        ) -> CallToolResult | InputRequiredResult:
        # The SDK's own registry (MCPServer has no public lookup by name; list_tools builds every schema).
        tool = self._tool_manager.get_tool(name)
        if tool is None:
            return results.unknown_tool()
        # The SDK would drop an argument the tool does not take; the HTTP API refuses an unknown
        # parameter or field, and so does a tool (a misspelt filter must not silently widen a read).
        accepted = tool.parameters.get("properties", {})
        unknown = [key for key in arguments if key not in accepted]
        if unknown:
            return results.unknown_arguments(unknown, sorted(accepted))
        try:
            return await super().call_tool(name, arguments, context)
        except UnexpectedToolError:
            raise  # a crash: the SDK logs it and answers its generic text
        except ToolError as exc:
            # Only the SDK's own argument check raises a ToolError caused by a ValidationError: a tool
            # body's ToolError is wrapped again (its cause is that ToolError), its crashes are Unexpected.
            if isinstance(exc.__cause__, ValidationError):
                return results.bad_arguments(exc.__cause__)
            raise
