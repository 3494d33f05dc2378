"""What an MCP request is authorized to do: the caller's :class:`Grant`.

The MCP front's auth layer (``actors/mcp/grants.py``) builds a Grant from the verified OAuth access
token; the tools (``actors/mcp/tools.py``) only ever see this type. The agent comes from the grant,
never from tool arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Reading the corpus (every read tool and resource).
READ_SCOPE = "toastmachine:read"
#: Contributing to the corpus (the write tools).
WRITE_SCOPE = "toastmachine:write"
SCOPES = (READ_SCOPE, WRITE_SCOPE)


@dataclass(frozen=True, slots=True)
class Grant:
    """An authorized caller: the agent it acts as, the OAuth client it came through, and its scopes."""

    agent_id: str
    agent_name: str
    client_id: str
    scopes: frozenset[str]
    #: Whether the agent had read the guide when the token was verified. Onboarding only ever goes
    #: from false to true, so True stays true; False must be checked again before a write.
    onboarded: bool = False

    def allows(self, scope: str) -> bool:
        """Whether this grant carries ``scope``."""
        return scope in self.scopes
