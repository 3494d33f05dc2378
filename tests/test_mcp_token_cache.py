"""The MCP front's cache of verified access tokens (actors/mcp/token_cache.py).

The cache's own rules with the real class: it answers only while its LISTEN is confirmed, never past
a token's expiry as the database counted it, and never keeps a read that raced a notification.
Then against real MCP fronts on one database (both backends): a token verified on one node and
revoked through another is refused at once on the first; a change made by hand in the database
is seen at once; when the LISTEN connection is cut, everything kept is dropped and the cache is
bypassed until a new LISTEN is up, and tokens keep verifying meanwhile (from the database).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from actors.mcp.token_cache import TokenCache, TokenCacheListener
from infra.db.pool import Database
from tests.oauth_flow import tokens as _tokens
from tests.test_mcp_oauth import _INIT, _MCP_HEADERS, Front, _free_port, serve

# --- the cache itself ------------------------------------------------------------------------------------


def _live_cache() -> TokenCache[str]:
    cache: TokenCache[str] = TokenCache(ttl=60)
    cache.confirm_alive(time.monotonic() + 3600)
    return cache


def test_a_kept_token_is_answered_only_while_the_listen_is_confirmed() -> None:
    cache = _live_cache()
    cache.put(b"k", "token", grant_id="g", generation=cache.generation(), sent=time.monotonic(), remaining=60)
    assert cache.get(b"k") == "token"
    cache.suspend()
    assert cache.get(b"k") is None and len(cache) == 0
    # Not live: nothing is kept either, until the listener confirms the LISTEN again.
    cache.put(b"k", "token", grant_id="g", generation=cache.generation(), sent=time.monotonic(), remaining=60)
    assert len(cache) == 0
    cache.confirm_alive(time.monotonic() - 1)  # a confirmation already past is no confirmation
    cache.put(b"k", "token", grant_id="g", generation=cache.generation(), sent=time.monotonic(), remaining=60)
    assert cache.get(b"k") is None


def test_expiry_is_counted_from_before_the_query_on_the_databases_clock() -> None:
    cache = _live_cache()
    # The query went out 5 s ago and the database said 5 s were left: expired now, not kept.
    cache.put(b"a", "a", grant_id="g", generation=cache.generation(), sent=time.monotonic() - 5, remaining=5)
    assert cache.get(b"a") is None and len(cache) == 0
    # Not kept past the TTL either, however long the token lives.
    short: TokenCache[str] = TokenCache(ttl=2)
    short.confirm_alive(time.monotonic() + 3600)
    short.put(b"b", "b", grant_id="g", generation=short.generation(), sent=time.monotonic() - 2, remaining=3600)
    assert short.get(b"b") is None


def test_a_read_that_raced_a_notification_is_not_kept_and_notifications_forget() -> None:
    cache = _live_cache()
    before = cache.generation()
    cache.forget("some-other-grant")  # any notification while the read was in flight
    cache.put(b"k", "token", grant_id="g", generation=before, sent=time.monotonic(), remaining=60)
    assert cache.get(b"k") is None
    for key, grant in ((b"1", "g1"), (b"2", "g1"), (b"3", "g2")):
        cache.put(key, key.decode(), grant_id=grant, generation=cache.generation(), sent=time.monotonic(),
                  remaining=60)
    cache.forget("g1")
    assert cache.get(b"1") is None and cache.get(b"2") is None and cache.get(b"3") == "3"
    cache.forget("*")
    assert len(cache) == 0


def test_the_cache_is_bounded() -> None:
    cache: TokenCache[int] = TokenCache(ttl=60, max_entries=3)
    cache.confirm_alive(time.monotonic() + 3600)
    for i in range(10):
        cache.put(bytes([i]), i, grant_id=f"g{i}", generation=cache.generation(), sent=time.monotonic(),
                  remaining=60)
    assert len(cache) == 3 and cache.get(bytes([9])) == 9 and cache.get(bytes([0])) is None
    cache.forget("g0")  # a grant forgotten with its last token leaves no index behind
    assert len(cache._by_grant) == 3


# --- against real fronts -------------------------------------------------------------------------------


def _cache(front: Front) -> TokenCache[Any]:
    cache: TokenCache[Any] = front.app.state.token_cache
    return cache


def _listener(front: Front) -> TokenCacheListener:
    listener: TokenCacheListener = front.app.state.token_listener
    return listener


async def _call(http: httpx.AsyncClient, front: Front, access_token: str) -> int:
    headers = {**_MCP_HEADERS, "Authorization": f"Bearer {access_token}"}
    return (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code


async def test_a_revoke_on_one_node_is_refused_at_once_on_another(db: Database) -> None:
    # Two nodes of one deployment: one public origin (the issuer and resource a token is bound to).
    port_a = _free_port()
    public = {"mcp_public_url": f"http://127.0.0.1:{port_a}"}
    async with serve(db, port_a, **public) as a, serve(db, _free_port(), **public) as b, \
            httpx.AsyncClient() as http:
        await _listener(b).wait_for_session(1)
        client_id, tokens = await _tokens(http, a.base)
        assert await _call(http, b, tokens["access_token"]) == 200
        assert len(_cache(b)) == 1  # B now answers this token from memory
        r = await http.post(a.base + "/revoke", data={"token": tokens["access_token"], "client_id": client_id})
        assert r.status_code == 200
        assert await _call(http, b, tokens["access_token"]) == 401
        assert await _call(http, a, tokens["access_token"]) == 401


async def test_a_change_by_hand_is_seen_at_once(db: Database) -> None:
    async with serve(db, _free_port()) as front, httpx.AsyncClient() as http:
        await _listener(front).wait_for_session(1)
        _, tokens = await _tokens(http, front.base)
        assert await _call(http, front, tokens["access_token"]) == 200
        assert len(_cache(front)) == 1
        # The grant revoked in SQL, as an operator would (no call of ours involved).
        await db.pool.execute("update oauth_grants set revoked_at = now()")
        assert await _call(http, front, tokens["access_token"]) == 401


async def test_a_lost_listen_drops_everything_and_bypasses_until_it_is_back(db: Database) -> None:
    async with serve(db, _free_port()) as front, httpx.AsyncClient() as http:
        listener = _listener(front)
        await listener.wait_for_session(1)
        _, tokens = await _tokens(http, front.base)
        assert await _call(http, front, tokens["access_token"]) == 200
        assert len(_cache(front)) == 1
        killed = await db.pool.fetchval(
            "select count(*) from (select pg_terminate_backend(pid) from pg_stat_activity"
            " where application_name = $1 and pid <> pg_backend_pid()) t", listener.application_name)
        assert killed == 1
        await listener.wait_for_session(2)
        # What was kept before the cut may have missed a notification: it is gone.
        assert len(_cache(front)) == 0
        assert await _call(http, front, tokens["access_token"]) == 200
        await db.pool.execute("update oauth_tokens set revoked_at = now() where kind = 'access'")
        assert await _call(http, front, tokens["access_token"]) == 401


@pytest.mark.parametrize("change", [
    "update oauth_tokens set expires_at = now() - interval '1 second' where kind = 'access'",
    "delete from oauth_tokens where kind = 'access'",
    "update oauth_grants set scopes = array['toastmachine:write']",  # the token's read no longer in it
])
async def test_every_change_to_a_verified_row_is_seen_at_once(db: Database, change: str) -> None:
    async with serve(db, _free_port()) as front, httpx.AsyncClient() as http:
        await _listener(front).wait_for_session(1)
        _, tokens = await _tokens(http, front.base)  # the read scope
        assert await _call(http, front, tokens["access_token"]) == 200
        await db.pool.execute(change)
        assert await _call(http, front, tokens["access_token"]) == 401
