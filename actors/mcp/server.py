"""The MCP front's server: the SDK's ``MCPServer``, with argument errors in our error contract.

The SDK validates a tool's arguments against the tool's signature before the tool runs; a call whose
arguments do not fit (a string where an integer goes, a required argument missing) or that names no
tool we serve would otherwise get the SDK's plain-text error, which quotes the caller's values and
pydantic's wording. :class:`ToastMachineServer` answers those calls with the same ``isError``
envelope as every other refusal (:mod:`actors.mcp.results`), with fixed text that names only the
argument (a name from the tool's own schema), never the value sent. An argument the tool does not
take is refused too (the SDK would ignore it), quoting its name as the HTTP API quotes an unknown
parameter (bounded, :func:`protocol.errors.quote`).

It answers the low-level server's ``get_tool_input_schema`` hook (the schema ``Mcp-Param-*``
headers are checked against, before the call is dispatched) with None for a tool whose input
schema declares no ``x-mcp-header``: against such a schema the SDK's check can find nothing, and
getting there walked the whole schema twice on every call (about 4% of the front's CPU per
``get_messages``, bench/mcp.py). A tool that declares one gets its schema, and the SDK's check.

It also leaves out the SDK's OpenTelemetry middleware (the SDK's documented opt-out: drop it from
the middleware list): ToastMachine installs no tracer, and the span it opens and closes on every
message anyway was a measurable share of a call's CPU (bench/mcp.py).
"""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.shared.inbound import X_MCP_HEADER_KEY
from mcp_types import CallToolResult, InputRequiredResult
from pydantic import ValidationError

from actors.mcp import results
from actors.mcp.endpoint import BODY_REFUSAL

#: The SDK's built-in tracing middleware (class name; its module is private).
_SDK_TRACING_MIDDLEWARE = "OpenTelemetryMiddleware"


def declares_header(schema: Any) -> bool:
    """Whether ``x-mcp-header`` is a key anywhere in ``schema`` (a superset of where the SDK looks)."""
    if isinstance(schema, dict):
        return X_MCP_HEADER_KEY in schema or any(declares_header(v) for v in schema.values())
    if isinstance(schema, list):
        return any(declares_header(v) for v in schema)
    return False


class ToastMachineServer(MCPServer):
    """``MCPServer`` whose argument-validation failures and unknown tools are envelope results."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Tool name -> (its input schema, whether that schema declares an x-mcp-header anywhere).
        self._declares_headers: dict[str, tuple[dict[str, Any], bool]] = {}
        super().__init__(*args, **kwargs)
        self.middleware[:] = [m for m in self.middleware if type(m).__name__ != _SDK_TRACING_MIDDLEWARE]

    def _tool_input_schema(self, name: str) -> dict[str, Any] | None:
        # MCPServer hands this method to the low-level server as its get_tool_input_schema hook.
        tool = self._tool_manager.get_tool(name)
        if tool is None:
            return None
        schema = tool.parameters
        known = self._declares_headers.get(name)
        if known is None or known[0] is not schema:
            known = self._declares_headers[name] = (schema, declares_header(schema))
        return schema if known[1] else None

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None,
                        ) -> CallToolResult | InputRequiredResult:
        refusal = BODY_REFUSAL.get()
        if refusal is not None:  # the SDK's reading of the request changed what the client sent
            return results.from_api_error(refusal)
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
