"""Deleting the OAuth rows that can no longer be used, in bounded batches (run by the MCP front).

What goes, once past its expiry plus :data:`KEEP_SECONDS`: consent requests, authorization codes
and tokens. Until then an expired row is still refused on use (every check also compares the
expiry), and a reused code or rotated refresh token is still recognised and revokes its family.
Grants stay (they are the record of who approved what; ``toastmachine oauth grants list --all``).
So does every registered client, except the cached copy of a Client ID Metadata Document that went
stale that long ago and that no grant refers to (it is fetched again if the client comes back).

Each statement deletes at most ``batch`` rows of one table, chosen by the expiry index, and only rows
whose own expiry is in the past: a failure part-way leaves live rows untouched by construction.
"""

from __future__ import annotations

from actors.mcp.oauth import DOCUMENT_KEY
from infra.db.pool import Database

#: Seconds an expired row is kept, so that a late reuse of a code or refresh token is still seen.
KEEP_SECONDS = 24 * 3600
#: Rows one statement deletes at most.
BATCH = 500

_TABLES = {
    "oauth_pending": "request_hash",
    "oauth_codes": "code_hash",
    "oauth_tokens": "token_hash",
}


async def delete_expired(db: Database, *, batch: int = BATCH, keep_seconds: float = KEEP_SECONDS) -> int:
    """One pass: at most ``batch`` expired rows per table deleted; returns how many in all."""
    total = 0
    for table, key in _TABLES.items():
        total += int(await db.pool.fetchval(
            f"with gone as (delete from {table} where {key} = any(array("
            f"select {key} from {table} where expires_at < now() - make_interval(secs => $1)"
            f" order by expires_at limit $2 for update skip locked)) returning 1)"
            f" select count(*) from gone", float(keep_seconds), batch))
    total += int(await db.pool.fetchval(
        "with gone as (delete from oauth_clients where client_id = any(array("
        "select c.client_id from oauth_clients c where c.metadata ? $3"
        " and (c.metadata->$3->>'expires_at')::float8 < extract(epoch from now()) - $1"
        " and not exists (select 1 from oauth_grants g where g.client_id = c.client_id)"
        " limit $2 for update skip locked)) returning 1) select count(*) from gone",
        float(keep_seconds), batch, DOCUMENT_KEY))
    return total
