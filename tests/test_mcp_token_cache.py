"""The MCP front's cache of verified access tokens (actors/mcp/token_cache.py).

The cache's own rules with the real class: it answers only through a barrier that passed (and
after the notifications that barrier let through), never past a token's expiry as the database
counted it, never keeps a read that raced a notification, and is bounded. Then against real MCP
fronts on one database (both backends): a token answered from memory on one node and revoked
through another is refused at once on the first, many times over (the barrier makes it so, not
timing); a change made by hand in the database is seen at once; when the LISTEN connection is cut,
everything kept is dropped and tokens verify against the database until a new LISTEN is up.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx
import pytest

from actors.mcp.token_cache import TokenCache, TokenCacheListener
from infra.db.pool import Database
from tests.oauth_flow import tokens as _tokens
from tests.test_mcp_oauth import _INIT, _MCP_HEADERS, Front, _free_port, serve

# --- the cache itself ------------------------------------------------------------------------------------


async def _passed() -> bool:
    return True


async def _failed() -> bool:
    return False


def _live_cache(ttl: float = 60) -> TokenCache[str]:
    cache: TokenCache[str] = TokenCache(ttl=ttl)
    cache.resume(_passed)
    return cache


def _put(cache: TokenCache[Any], key: bytes, value: Any, grant: str = "g", *, sent: float | None = None,
         remaining: float = 60, generation: int | None = None) -> None:
    cache.put(key, value, grant_id=grant, generation=cache.generation() if generation is None else generation,
              sent=time.monotonic() if sent is None else sent, remaining=remaining)


async def test_a_kept_token_is_answered_only_through_a_barrier_that_passed() -> None:
    cache = _live_cache()
    _put(cache, b"k", "token")
    assert await cache.lookup(b"k") == "token"
    cache.barrier = _failed  # the barrier could not be confirmed: the database decides
    assert await cache.lookup(b"k") is None
    cache.suspend()  # the LISTEN is gone: nothing kept, nothing answered, nothing taken in
    assert cache.barrier is None and len(cache) == 0
    _put(cache, b"k", "token")
    assert len(cache) == 0 and await cache.lookup(b"k") is None


async def test_a_notification_the_barrier_lets_through_is_applied_before_the_answer() -> None:
    cache = _live_cache()
    _put(cache, b"k", "token", "g1")

    async def revoked_meanwhile() -> bool:
        cache.forget("g1")  # what the LISTEN received before the barrier's answer
        return True

    cache.barrier = revoked_meanwhile
    assert await cache.lookup(b"k") is None


async def test_expiry_is_counted_from_before_the_query_on_the_databases_clock() -> None:
    cache = _live_cache()
    # The query went out 5 s ago and the database said 5 s were left: expired now, not kept.
    _put(cache, b"a", "a", sent=time.monotonic() - 5, remaining=5)
    assert len(cache) == 0 and await cache.lookup(b"a") is None
    # Not kept past the TTL either, however long the token lives.
    short = _live_cache(ttl=2)
    _put(short, b"b", "b", sent=time.monotonic() - 2, remaining=3600)
    assert await short.lookup(b"b") is None


async def test_a_read_that_raced_a_notification_is_not_kept_and_notifications_forget() -> None:
    cache = _live_cache()
    before = cache.generation()
    cache.forget("some-other-grant")  # any notification while the read was in flight
    _put(cache, b"k", "token", generation=before)
    assert len(cache) == 0
    for key, grant in ((b"1", "g1"), (b"2", "g1"), (b"3", "g2")):
        _put(cache, key, key.decode(), grant)
    cache.forget("g1")
    assert await cache.lookup(b"1") is None and await cache.lookup(b"2") is None
    assert await cache.lookup(b"3") == "3"
    cache.forget("*")
    assert len(cache) == 0


def test_a_read_begun_before_the_listen_was_up_is_not_kept() -> None:
    cache: TokenCache[str] = TokenCache(ttl=60)
    before = cache.generation()  # a verification's read starts while no LISTEN is up ...
    cache.resume(_passed)  # ... the LISTEN comes up (it would not hear of a change before it) ...
    _put(cache, b"k", "token", generation=before)  # ... and the read's answer arrives
    assert len(cache) == 0
    _put(cache, b"k", "token")
    assert len(cache) == 1


def test_the_cache_is_bounded() -> None:
    cache: TokenCache[int] = TokenCache(ttl=60, max_entries=3)
    cache.resume(_passed)
    for i in range(10):
        _put(cache, bytes([i]), i, f"g{i}")
    assert len(cache) == 3 and bytes([9]) in cache._entries and bytes([0]) not in cache._entries
    assert len(cache._by_grant) == 3  # the index forgets a grant with its last token


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
        for _ in range(10):  # the revoke's commit and the next call as close together as a client gets them
            client_id, tokens = await _tokens(http, a.base)
            assert await _call(http, b, tokens["access_token"]) == 200
            assert await _call(http, b, tokens["access_token"]) == 200
            assert await _cache(b).lookup(hashlib.sha256(tokens["access_token"].encode()).digest()) is not None
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
            # This database's listener only: another test (another xdist worker) on the same
            # server has a listener of the same name in its own database.
            " where application_name = $1 and datname = current_database() and pid <> pg_backend_pid()) t",
            listener.application_name)
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
