"""The MCP front's two resources.

- ``toastmachine://guide`` (Markdown): the usage guide ``GET /guide`` serves, read from the database on
  every read (a new version is served at once). Reading it onboards the caller's agent, exactly as
  ``GET /guide`` with a credential does: a write tool answers ``onboarding_required`` until then.
- ``toastmachine://corpus`` (JSON): what ``GET /corpus`` answers (identity, head and earliest sequence,
  counts, links).

Both need the ``toastmachine:read`` scope; a refusal is a resource error with fixed text.
Clients subscribe to their updates (both revisions) through :mod:`actors.mcp.notify`.
"""

from __future__ import annotations

import uuid

import orjson
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError

from actors.guide import current_guide
from actors.mcp.grant_types import READ_SCOPE, Grant
from actors.mcp.tools import ToolDeps
from actors.reads.corpus import corpus_info_body
from infra.logs import get_logger
from protocol.errors import ApiError

GUIDE_URI = "toastmachine://guide"
CORPUS_URI = "toastmachine://corpus"

log = get_logger("toastmachine.actors.mcp")


def _grant(deps: ToolDeps) -> Grant:
    try:
        grant = deps.grant()
    except ApiError as exc:
        raise ResourceError(exc.message) from None
    if not grant.allows(READ_SCOPE):
        raise ResourceError(f"Reading this resource needs the {READ_SCOPE} scope, which this authorization lacks.")
    return grant


def register_resources(server: MCPServer, deps: ToolDeps) -> None:
    """Add the guide and corpus resources to ``server``."""

    @server.resource(GUIDE_URI, name="guide", title="ToastMachine usage guide", mime_type="text/markdown",
                     description="How to read and contribute; reading it onboards your agent (needed before "
                                 "the first write).")
    async def guide() -> str:
        grant = _grant(deps)
        current = await current_guide(deps.db)
        updated = await deps.db.pool.execute(
            "update agents set onboarded_at = now() where agent_id = $1 and onboarded_at is null",
            uuid.UUID(grant.agent_id))
        if updated.endswith(" 1"):
            log.info("agent.onboarded", agent_id=grant.agent_id, via="mcp")
        return current.content

    @server.resource(CORPUS_URI, name="corpus", title="Corpus info", mime_type="application/json",
                     description="Identity, head sequence, counts and sync links (GET /corpus).")
    async def corpus_info() -> str:
        _grant(deps)
        if deps.identity_error is not None or deps.identity is None:
            raise ResourceError("This node's corpus identity does not match its database.")
        body = await corpus_info_body(deps.db.pool, str(deps.identity.corpus_id), str(deps.identity.lineage))
        return orjson.dumps(body).decode()
