"""Who is calling a tool: the grant behind the request's access token, and the per-tool scope check.

The HTTP layer (the SDK's bearer middleware in :mod:`actors.mcp.app`) has already refused any
request without a valid token for this resource with 401 before a tool runs. Tools then:

- call :func:`current_grant` for the agent they act as (tool arguments never carry identities or
  credentials), and
- declare their scope at registration with :func:`declare_tool_scope`: the app's scope gate answers a
  ``tools/call`` for a tool whose scope the token lacks with HTTP 403 and the ``insufficient_scope``
  challenge (naming the scope) before the tool runs, and
- call :func:`require_scope` first thing in the tool: it returns the :class:`Grant`, and raises
  :class:`InsufficientScope` (a tool error, nothing done) should the gate ever be bypassed (a tool
  whose scope was not declared). The 403 itself can only come from the gate: once a tool runs, the
  HTTP status is no longer ours to choose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.mcpserver.exceptions import ToolError

from actors.mcp.grant_types import Grant
from actors.mcp.oauth import SCOPES

F = TypeVar("F", bound=Callable[..., object])

#: Tool name -> the scope it needs, filled by :func:`declare_tool_scope` and read by the scope gate.
_TOOL_SCOPES: dict[str, str] = {}


class InsufficientScope(ToolError):
    """A tool ran for a token without its scope (the scope gate should have refused it first)."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        super().__init__(f"This tool needs the OAuth scope {scope}; authorize the app again with it.")


class NoGrant(ToolError):
    """A tool ran without an authenticated request (never expected behind the bearer middleware)."""


def current_grant() -> Grant:
    """The grant of the request being handled; raises :class:`NoGrant` outside an authenticated request."""
    token = get_access_token()
    claims = token.claims if token is not None else None
    if token is None or not token.subject or not claims or not claims.get("agent_name"):
        raise NoGrant("This request carries no valid authorization.")
    return Grant(agent_id=token.subject, agent_name=str(claims["agent_name"]), client_id=token.client_id,
                 scopes=frozenset(token.scopes), onboarded=claims.get("onboarded") is True)


def declare_tool_scope(tool_name: str, scope: str) -> None:
    """Declare that tool ``tool_name`` needs ``scope``: the HTTP scope gate enforces it with a 403."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")
    _TOOL_SCOPES[tool_name] = scope


def require_scope(scope: str) -> Grant:
    """The current grant if it has ``scope``; :class:`InsufficientScope` otherwise (call first in a tool)."""
    grant = current_grant()
    if not grant.allows(scope):
        raise InsufficientScope(scope)
    return grant


def tool_scopes() -> Mapping[str, str]:
    """The declared scope of every tool (read by the scope gate)."""
    return _TOOL_SCOPES
