"""Operator views of the MCP front's OAuth state, for ``toastmachine oauth …`` (no HTTP route shows them).

Nothing secret is ever read: the tables hold only digests, and these queries select none of them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from infra.db.pool import Database
from protocol.representations import format_time


@dataclass(frozen=True, slots=True)
class ClientRow:
    """One registered client, with how many live grants it holds."""

    client_id: str
    client_name: str
    auth_method: str
    redirect_uris: list[str]
    created_at: datetime
    live_grants: int


@dataclass(frozen=True, slots=True)
class GrantRow:
    """One grant (consent): who it lets act as whom, and whether it is still live."""

    grant_id: uuid.UUID
    client_id: str
    client_name: str
    agent_name: str
    scopes: list[str]
    created_at: datetime
    revoked_at: datetime | None

    def line(self) -> str:
        """A tab-separated line for the CLI."""
        state = "revoked " + format_time(self.revoked_at) if self.revoked_at else "live"
        return "\t".join([str(self.grant_id), self.client_id, self.client_name or "-", self.agent_name,
                          " ".join(self.scopes), format_time(self.created_at), state])


async def list_clients(db: Database) -> list[ClientRow]:
    """Every registered client, newest first."""
    rows = await db.pool.fetch(
        "select c.client_id, coalesce(c.metadata->>'client_name', '') as client_name,"
        " coalesce(c.metadata->>'token_endpoint_auth_method', '?') as auth_method,"
        " coalesce(c.metadata->'redirect_uris', '[]'::jsonb) as redirect_uris, c.created_at,"
        " (select count(*) from oauth_grants g where g.client_id = c.client_id and g.revoked_at is null) as live"
        " from oauth_clients c order by c.created_at desc, c.client_id")
    return [ClientRow(r["client_id"], r["client_name"], r["auth_method"], [str(u) for u in r["redirect_uris"]],
                      r["created_at"], r["live"]) for r in rows]


async def list_grants(db: Database, *, include_revoked: bool = False) -> list[GrantRow]:
    """Grants, newest first; live ones only unless ``include_revoked``."""
    rows = await db.pool.fetch(
        "select g.grant_id, g.client_id, coalesce(c.metadata->>'client_name', '') as client_name,"
        " a.name as agent_name, g.scopes, g.created_at, g.revoked_at"
        " from oauth_grants g join oauth_clients c using (client_id) join agents a on a.agent_id = g.agent_id"
        " where $1 or g.revoked_at is null order by g.created_at desc, g.grant_id", include_revoked)
    return [GrantRow(r["grant_id"], r["client_id"], r["client_name"], r["agent_name"], list(r["scopes"]),
                     r["created_at"], r["revoked_at"]) for r in rows]


async def revoke(db: Database, target: str) -> int:
    """Revoke grant ``target`` (a grant id), or every live grant of client ``target``; return how many."""
    try:
        grant_id: uuid.UUID | None = uuid.UUID(target)
    except ValueError:
        grant_id = None
    return int(await db.pool.fetchval(
        "with done as (update oauth_grants set revoked_at = now() where revoked_at is null"
        " and (grant_id = $1 or client_id = $2) returning 1) select count(*) from done", grant_id, target))
