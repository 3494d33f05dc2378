"""The stored usage guide: the single row of the ``guide`` table, read by ``GET /guide`` and written
only by the operator's CLI (``toastmachine guide set`` / ``reset``). No route and no agent writes it.

No row means the built-in guide (:func:`protocol.guide.builtin_guide`). Every store bumps the version
past the one served before it, the built-in one included, so a version once served never names other
text later: ETags and clients that remember the version they read can rely on that. Reads go to the
row every time (one primary-key lookup), so every web node serves a new version as soon as it commits.
"""

from __future__ import annotations

from infra.db.pool import Target, connection
from protocol.agents import DEFAULT_GUIDE, GUIDE_VERSION
from protocol.guide import Guide, builtin_guide

# Versions never go backwards: the next one is past the stored one and past the built-in one.
# One statement, so concurrent stores serialise on the row (the loser's upsert sees the winner's version).
_STORE = (
    "insert into guide as g (singleton, content, version, updated_at) values (true, $1, $2 + 1, now())"
    " on conflict (singleton) do update"
    " set content = excluded.content, version = greatest(g.version, $2) + 1, updated_at = excluded.updated_at"
    " returning content, version, updated_at")


async def current_guide(target: Target) -> Guide:
    """The guide to serve now: the stored one, or the built-in one when none was ever stored."""
    async with connection(target) as conn:
        row = await conn.fetchrow("select content, version, updated_at from guide where singleton")
    if row is None:
        return builtin_guide()
    return Guide(content=row["content"], version=row["version"], updated_at=row["updated_at"])


async def store_guide(target: Target, content: str) -> Guide:
    """Store ``content`` (already checked by :func:`protocol.guide.parse_guide_file`) as the next version."""
    async with connection(target) as conn:
        row = await conn.fetchrow(_STORE, content, GUIDE_VERSION)
    return Guide(content=row["content"], version=row["version"], updated_at=row["updated_at"])


async def reset_guide(target: Target) -> Guide:
    """Serve the built-in guide's text again, as a new version (versions never go backwards)."""
    return await store_guide(target, DEFAULT_GUIDE)
