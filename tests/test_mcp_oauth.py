"""The MCP front's OAuth 2.1 authorization server, end to end over real HTTP (uvicorn in-process).

The SDK's own client (``mcp.client.auth.OAuthClientProvider``) discovers the metadata, registers,
goes through the consent form (driven over HTTP by the redirect handler), exchanges the code and
calls ``whoami``; the negative cases talk to the endpoints directly. Runs on both database backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import httpx2
import orjson
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from actors.mcp.app import build_app
from actors.mcp.front import make_server
from infra.config import Settings
from infra.db.pool import Database
from tests import procs
from tests.oauth_flow import REDIRECT, sdk_oauth_client
from tests.oauth_flow import authorize as _authorize
from tests.oauth_flow import code as _code
from tests.oauth_flow import consent as _consent
from tests.oauth_flow import exchange as _exchange
from tests.oauth_flow import pkce as _pkce
from tests.oauth_flow import register as _register
from tests.oauth_flow import tokens as _tokens


def _free_port() -> int:
    return procs.free_port()


@dataclass
class Front:
    base: str
    db: Database
    app: Any = None


@contextlib.asynccontextmanager
async def serve(db: Database, port: int, **settings_kw: Any) -> AsyncIterator[Front]:
    settings = Settings(mcp_host="127.0.0.1", mcp_port=port, **settings_kw)  # type: ignore[arg-type]
    app = build_app(settings, db)
    server = make_server(app, host="127.0.0.1", port=port)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(20):
        while not server.started:
            assert not task.done(), "uvicorn stopped while starting"
            await asyncio.sleep(0.02)
    try:
        yield Front(base=f"http://127.0.0.1:{port}", db=db, app=app)
    finally:
        server.should_exit = True
        async with asyncio.timeout(20):
            await task


@pytest.fixture
async def front(db: Database) -> AsyncIterator[Front]:
    async with serve(db, _free_port()) as f:
        yield f


_INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
         "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                    "clientInfo": {"name": "t", "version": "1"}}}
_MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


# --- the whole chain with the SDK's own client ---------------------------------------------------

async def test_sdk_client_registers_consents_and_calls_whoami(front: Front) -> None:
    auth, storage = sdk_oauth_client(front.base + "/mcp", agent_name="sdk-agent")
    async with httpx2.AsyncClient(auth=auth, timeout=30) as http, \
            streamable_http_client(front.base + "/mcp", http_client=http) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        tools = await session.list_tools()
        assert [t.name for t in tools.tools] == ["whoami"]
        result = await session.call_tool("whoami", {})
    assert not result.is_error, result
    agent = result.structured_content["agent"]  # type: ignore[index]
    assert agent["name"] == "sdk-agent" and agent["activity"]["message_count"] == 0
    assert storage.tokens is not None and storage.tokens.refresh_token
    # Nothing raw is stored: the token's digest is, the token is not.
    assert await front.db.pool.fetchval("select count(*) from oauth_tokens where token_hash = $1",
                                        hashlib.sha256(storage.tokens.access_token.encode()).digest()) == 1


# --- metadata and the 401 layer ---------------------------------------------------------------------

async def test_metadata_and_401_challenge(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        asm = (await http.get(front.base + "/.well-known/oauth-authorization-server")).json()
        assert asm["issuer"] == front.base and asm["code_challenge_methods_supported"] == ["S256"]
        assert "none" in asm["token_endpoint_auth_methods_supported"]
        assert asm["authorization_response_iss_parameter_supported"] is True
        assert "offline_access" not in asm["scopes_supported"]
        for path in ("/.well-known/oauth-protected-resource/mcp", "/.well-known/oauth-protected-resource"):
            prm = (await http.get(front.base + path)).json()
            assert prm["resource"] == front.base + "/mcp" and prm["authorization_servers"] == [front.base]
        r = await http.post(front.base + "/mcp", json=_INIT, headers=_MCP_HEADERS)
        assert r.status_code == 401
        challenge = r.headers["www-authenticate"]
        assert f'resource_metadata="{front.base}/.well-known/oauth-protected-resource/mcp"' in challenge
        assert 'scope="toastmachine:read toastmachine:write"' in challenge
        # No credentials sent: where to get them, and no error code (RFC 6750, section 3.1).
        assert challenge.startswith("Bearer resource_metadata=") and "error=" not in challenge
        for bad in ("tma_" + secrets.token_urlsafe(32), "garbage"):
            r = await http.post(front.base + "/mcp", json=_INIT, headers={**_MCP_HEADERS,
                                                                         "Authorization": f"Bearer {bad}"})
            assert r.status_code == 401
            assert r.headers["www-authenticate"].startswith('Bearer error="invalid_token"')
            assert r.json()["error"] == "invalid_token"


async def test_an_unknown_route_or_method_is_a_json_envelope(front: Front) -> None:
    """Starlette answers them in plain text; the MCP front answers JSON like everything else."""
    async with httpx.AsyncClient() as http:
        missing = await http.get(front.base + "/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        wrong = await http.delete(front.base + "/token")
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
        assert "POST" in wrong.headers["allow"]


async def test_a_repeated_authorization_header_is_refused(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        _, tokens = await _tokens(http, front.base)
        bearer = f"Bearer {tokens['access_token']}"
        twice = httpx.Headers([*_MCP_HEADERS.items(), ("Authorization", bearer), ("Authorization", "Bearer other")])
        r = await http.post(front.base + "/mcp", json=_INIT, headers=twice)
        assert r.status_code == 400 and r.json()["error"] == "invalid_request", r.text
        once = await http.post(front.base + "/mcp", json=_INIT, headers={**_MCP_HEADERS, "Authorization": bearer})
        assert once.status_code == 200


async def test_client_registration_reads_json_as_the_http_api_does(front: Front) -> None:
    """A registration body that is not application/json, or names a key twice, or holds NaN, is
    refused (400 invalid_client_metadata) and registers nothing; the SDK took them all."""
    async with httpx.AsyncClient() as http:
        before = await front.db.pool.fetchval("select count(*) from oauth_clients")
        body = b'{"redirect_uris": ["http://127.0.0.1:9/cb"], "token_endpoint_auth_method": "none"'
        for content, kind in ((body + b"}", "text/plain"), (body + b"}", None),
                              (body + b', "client_name": "x", "client_name": "y"}', "application/json"),
                              (body + b', "x": NaN}', "application/json")):
            headers = {"content-type": kind} if kind else {}
            r = await http.post(front.base + "/register", content=content, headers=headers)
            assert r.status_code == 400 and r.json()["error"] == "invalid_client_metadata", (kind, r.text)
        assert await front.db.pool.fetchval("select count(*) from oauth_clients") == before
        ok = await http.post(front.base + "/register", content=body + b"}",
                             headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 201, ok.text


async def test_bad_origin_is_403(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        _, tokens = await _tokens(http, front.base)
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        ok = await http.post(front.base + "/mcp", json=_INIT, headers={**headers, "Origin": front.base})
        assert ok.status_code == 200, ok.text
        r = await http.post(front.base + "/mcp", json=_INIT, headers={**headers, "Origin": "https://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
        assert "evil.example" not in r.text
        # The SDK's other transport refusals come as the same JSON envelope, not its plain text.
        r = await http.post(front.base + "/mcp", json=_INIT, headers={**headers, "Host": "rebind.example"})
        assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request", r.text
        assert r.headers["content-type"] == "application/json" and "rebind.example" not in r.text
        r = await http.post(front.base + "/mcp", content=orjson.dumps(_INIT),
                            headers={**headers, "Content-Type": "text/plain"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type", r.text
        r = await http.post(front.base + "/mcp", content=b"[" * (5 << 20), headers=headers)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
        assert r.headers["server"] == "ToastMachine" and r.headers["cache-control"] == "no-store"


# --- PKCE, redirect and resource rules ----------------------------------------------------------------

async def test_pkce_wrong_verifier_is_refused_and_leaves_the_code_usable(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        verifier, challenge = _pkce()
        code = await _code(http, front.base, client["client_id"], challenge)
        r = await _exchange(http, front.base, client["client_id"], code, verifier + "x")
        assert r.status_code == 400 and r.json()["error"] == "invalid_grant"
        assert (await _exchange(http, front.base, client["client_id"], code, verifier)).status_code == 200


async def test_a_plain_options_request_has_no_effect(front: Front) -> None:
    """OPTIONS without CORS preflight headers, carrying the body a POST would: 204 with Allow and
    nothing done (the CORS layer passed it on and the handler took it as a POST: a client was
    registered, a code redeemed, a grant revoked). A real preflight is still answered for CORS."""
    async with httpx.AsyncClient() as http:
        clients = await front.db.pool.fetchval("select count(*) from oauth_clients")
        body = {"redirect_uris": ["http://127.0.0.1:9999/cb"], "token_endpoint_auth_method": "none"}
        r = await http.request("OPTIONS", front.base + "/register", json=body)
        assert r.status_code == 204 and r.headers["allow"] == "POST, OPTIONS" and not r.content
        assert await front.db.pool.fetchval("select count(*) from oauth_clients") == clients
        client = await _register(http, front.base)
        verifier, challenge = _pkce()
        code = await _code(http, front.base, client["client_id"], challenge)
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": REDIRECT,
                "client_id": client["client_id"], "code_verifier": verifier}
        r = await http.request("OPTIONS", front.base + "/token", data=form)
        assert r.status_code == 204 and "access_token" not in r.text
        issued = await _exchange(http, front.base, client["client_id"], code, verifier)
        assert issued.status_code == 200  # the code was not spent by the OPTIONS
        refresh = issued.json()["refresh_token"]
        r = await http.request("OPTIONS", front.base + "/revoke", data={"token": refresh, "client_id": client["client_id"]})
        assert r.status_code == 204
        assert (await _refresh(http, front.base, client["client_id"], refresh)).status_code == 200  # not revoked
        r = await http.request("OPTIONS", front.base + "/.well-known/oauth-authorization-server")
        assert r.status_code == 204 and r.headers["allow"] == "GET, OPTIONS"
        preflight = await http.request("OPTIONS", front.base + "/token", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 200 and "POST" in preflight.headers["access-control-allow-methods"]


async def test_pkce_plain_and_missing_are_refused(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        verifier, _ = _pkce()
        r = await _authorize(http, front.base, client["client_id"], verifier, code_challenge_method="plain")
        assert r.status_code == 302 and "error=invalid_request" in r.headers["location"]
        # RFC 9207: an error response names the issuer too, so a client can tell which server answered.
        back = parse_qs(urlsplit(r.headers["location"]).query)
        assert back["iss"] == [front.base] and back["state"] == ["st-1"], back
        params = {"response_type": "code", "client_id": client["client_id"], "redirect_uri": REDIRECT}
        r = await http.get(front.base + "/authorize", params=params)
        assert r.status_code == 302 and "error=invalid_request" in r.headers["location"]
        # No method named (RFC 7636: plain) with a plain challenge, or a challenge no S256 digest
        # encodes to: refused at once, not after the consent page.
        plain = params | {"code_challenge": verifier, "state": "st-1"}
        r = await http.get(front.base + "/authorize", params=plain)
        assert r.status_code == 302 and "error=invalid_request" in r.headers["location"], r.headers
        for challenge in ("short", "a" * 42 + "=", "a" * 44):
            r = await _authorize(http, front.base, client["client_id"], challenge)
            assert r.status_code == 302 and "error=invalid_request" in r.headers["location"], challenge
    assert await front.db.pool.fetchval("select count(*) from oauth_pending") == 0


async def test_a_database_lost_in_the_middle_of_authorize_is_a_503_not_a_server_error_redirect(
        front: Front, caplog: pytest.LogCaptureFixture) -> None:
    """The client is found and the budget charged, then the connection recording the pending request
    dies (its backend terminated from inside the statement: a real fault at that exact point): the
    answer is the 503 every OAuth route gives a database outage, not the SDK's ``server_error``
    redirect, and no traceback is logged; the next request, on a fresh connection, goes through."""
    await front.db.pool.execute("""
        create function tm_test_cut() returns trigger language plpgsql as $$
        begin perform pg_terminate_backend(pg_backend_pid()); return new; end $$;
        create trigger tm_test_cut before insert on oauth_pending for each row execute function tm_test_cut()""")
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        _, challenge = _pkce()
        r = await _authorize(http, front.base, client["client_id"], challenge)
        assert r.status_code == 503, (r.status_code, r.headers, r.text)
        assert r.json()["error"] == "temporarily_unavailable" and r.headers["Retry-After"]
        assert not any(rec.exc_info for rec in caplog.records), [rec.getMessage() for rec in caplog.records]
        await front.db.pool.execute("drop trigger tm_test_cut on oauth_pending; drop function tm_test_cut()")
        r = await _authorize(http, front.base, client["client_id"], challenge)
        assert r.status_code == 302 and "/consent?" in r.headers["location"]


@pytest.mark.parametrize("redirect", [REDIRECT + "/", "http://127.0.0.1:53682/other"])
async def test_redirect_mismatch_is_refused(front: Front, redirect: str) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        _, challenge = _pkce()
        r = await _authorize(http, front.base, client["client_id"], challenge, redirect_uri=redirect)
        assert r.status_code == 400 and r.json()["error"] == "invalid_request"


async def test_redirect_port_matters_off_loopback_but_not_on_it(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.post(front.base + "/register", json={"redirect_uris": ["http://app.example/cb"],
                                                            "token_endpoint_auth_method": "none"})
        assert r.status_code == 400 and r.json()["error"] == "invalid_redirect_uri"
        remote = await _register(http, front.base, redirect_uris=["https://app.example:8443/cb"])
        _, challenge = _pkce()
        r = await _authorize(http, front.base, remote["client_id"], challenge, redirect_uri="https://app.example:9443/cb")
        assert r.status_code == 400
        loop = await _register(http, front.base)
        r = await _authorize(http, front.base, loop["client_id"], challenge, redirect_uri="http://127.0.0.1:4000/callback")
        assert r.status_code == 302 and "/consent?" in r.headers["location"]


async def test_redirect_uris_with_userinfo_and_oversized_oauth_bodies_are_refused(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.post(front.base + "/register", json={
            "redirect_uris": ["https://trusted.example@app.example/cb"], "token_endpoint_auth_method": "none"})
        assert r.status_code == 400 and r.json()["error"] == "invalid_redirect_uri", r.text
        # localhost is a loopback host, as the refusal's wording says.
        r = await http.post(front.base + "/register", json={"redirect_uris": ["http://app.example/cb"]})
        assert "localhost" in r.json()["error_description"], r.text
        assert (await _register(http, front.base, redirect_uris=["http://localhost:9/cb"]))["client_id"]
        before = await front.db.pool.fetchval("select count(*) from oauth_clients")
        big = b'{"redirect_uris": ["' + b"https://app.example/" + b"a" * (80 << 10) + b'"]}'
        for path in ("/register", "/token", "/revoke"):
            r = await http.post(front.base + path, content=big, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", (path, r.text[:200])

        async def chunks() -> Any:  # no Content-Length: counted as it arrives
            for i in range(0, len(big), 8192):
                yield big[i:i + 8192]

        r = await http.post(front.base + "/register", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, (r.status_code, r.text[:200])
        assert await front.db.pool.fetchval("select count(*) from oauth_clients") == before


async def test_an_oversized_authorization_parameter_is_refused_without_being_quoted(front: Front) -> None:
    """A 7,000-character client id or scope was quoted whole by the SDK's errors (the page, or a
    redirect's error_description); past 2,048 characters it is refused with a fixed description."""
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        _, challenge = _pkce()
        for extra in ({"client_id": "Z" * 7000}, {"scope": "toastmachine:read " + "Y" * 7000}):
            r = await _authorize(http, front.base, extra.get("client_id", client["client_id"]), challenge,
                                 **{k: v for k, v in extra.items() if k != "client_id"})
            assert r.status_code == 400 and r.json() == {
                "error": "invalid_request",
                "error_description": f"{next(iter(extra))} is longer than 2048 characters"}, r.text[:300]
            assert "ZZZZ" not in r.text and "YYYY" not in r.text and "location" not in r.headers
        assert (await _authorize(http, front.base, client["client_id"], challenge)).status_code == 302


async def test_wrong_resource_is_refused(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        verifier, challenge = _pkce()
        r = await _authorize(http, front.base, client["client_id"], challenge, resource="https://other.example/mcp")
        assert r.status_code == 302 and "error=invalid_target" in r.headers["location"]
        # Foreign: this origin, but not its MCP endpoint.
        r = await _authorize(http, front.base, client["client_id"], challenge, resource=front.base + "/")
        assert r.status_code == 302 and "error=invalid_target" in r.headers["location"]
        code = await _code(http, front.base, client["client_id"], challenge)
        for resource in ("https://other.example/mcp", front.base + "/mcp/other"):
            r = await _exchange(http, front.base, client["client_id"], code, verifier, resource=resource)
            assert r.status_code == 400 and r.json()["error"] == "invalid_target"
        # No effect: the code is still good for the right resource.
        r = await _exchange(http, front.base, client["client_id"], code, verifier, resource=front.base + "/mcp")
        assert r.status_code == 200, r.text


# --- codes, tokens, refresh ----------------------------------------------------------------------------

async def test_code_reuse_revokes_what_the_first_use_issued(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        verifier, challenge = _pkce()
        code = await _code(http, front.base, client["client_id"], challenge)
        first = await _exchange(http, front.base, client["client_id"], code, verifier)
        assert first.status_code == 200
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {first.json()['access_token']}"}
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 200
        again = await _exchange(http, front.base, client["client_id"], code, verifier)
        assert again.status_code == 400 and again.json()["error"] == "invalid_grant"
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 401


async def _refresh(http: httpx.AsyncClient, base: str, client_id: str, refresh: str, **extra: str,
                   ) -> httpx.Response:
    return await http.post(base + "/token", data={"grant_type": "refresh_token", "refresh_token": refresh,
                                                  "client_id": client_id, **extra})


async def test_a_client_secret_basic_client_may_send_its_id_in_the_header_alone(front: Front) -> None:
    """RFC 6749 §2.3.1: a ``client_secret_basic`` client authenticates with the Basic header, its id
    form-urlencoded there, and need not repeat it in the body: the code exchange, a refresh and a
    revocation all work that way (the SDK's request models require ``client_id`` in the form). A
    wrong secret is still refused, and so is the code for another client named in the body."""
    import base64
    from urllib.parse import quote

    def basic(client_id: str, secret: str) -> dict[str, str]:
        raw = f"{quote(client_id, safe='')}:{quote(secret, safe='')}".encode()
        return {"Authorization": "Basic " + base64.b64encode(raw).decode()}

    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base, token_endpoint_auth_method="client_secret_basic")
        cid, secret = client["client_id"], client["client_secret"]
        other = await _register(http, front.base)
        verifier, challenge = _pkce()
        code = await _code(http, front.base, cid, challenge)
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": REDIRECT, "code_verifier": verifier}
        r = await http.post(front.base + "/token", data=form, headers=basic(cid, secret + "x"))
        assert r.status_code == 401 and r.json()["error"] == "invalid_client"
        # The body's id wins over the header's: that (public) client is not the code's.
        r = await http.post(front.base + "/token", data={**form, "client_id": other["client_id"]},
                            headers=basic(cid, secret))
        assert r.status_code == 400 and r.json()["error"] == "invalid_grant"
        r = await http.post(front.base + "/token", data=form, headers=basic(cid, secret))
        assert r.status_code == 200, r.text
        tokens = r.json()
        r = await http.post(front.base + "/token", headers=basic(cid, secret),
                            data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})
        assert r.status_code == 200, r.text
        rotated = r.json()
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {rotated['access_token']}"}
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 200
        r = await http.post(front.base + "/revoke", data={"token": rotated["access_token"]}, headers=basic(cid, secret))
        assert r.status_code == 200, r.text
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 401


async def test_one_agent_cannot_take_every_session_of_a_node(db: Database) -> None:
    """2025-11-25 sessions are bounded per agent (``MCP_SESSIONS_PER_AGENT``), across its tokens (a
    refreshed one counts with the first): past its share a new session is refused 429 with
    ``Retry-After`` and nothing opened, another agent still opens one, and an ended session (DELETE)
    gives its place back. The stateless revision opens no session and is never refused."""
    async with serve(db, _free_port(), mcp_sessions_per_agent=2) as f, httpx.AsyncClient() as http:
        client_id, first = await _tokens(http, f.base)
        r = await _refresh(http, f.base, client_id, first["refresh_token"])
        assert r.status_code == 200, r.text
        second = r.json()
        _, other = await _tokens(http, f.base)

        def auth(tokens: dict[str, Any]) -> dict[str, str]:
            return {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}

        opened = [await http.post(f.base + "/mcp", json=_INIT, headers=auth(t)) for t in (first, second)]
        assert [r.status_code for r in opened] == [200, 200] and all("mcp-session-id" in r.headers for r in opened)
        refused = await http.post(f.base + "/mcp", json=_INIT, headers=auth(second))
        assert refused.status_code == 429 and refused.headers["Retry-After"], refused.text
        assert "already has 2 open sessions" in refused.json()["error"]["message"]
        assert "mcp-session-id" not in refused.headers
        assert (await http.post(f.base + "/mcp", json=_INIT, headers=auth(other))).status_code == 200
        stateless = {**auth(second), "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/list"}
        r = await http.post(f.base + "/mcp", headers=stateless,
                            json={"jsonrpc": "2.0", "id": 3, "method": "tools/list", "params": {"_meta": META}})
        assert r.status_code == 200 and r.json()["result"]["tools"], r.text
        ended = await http.delete(f.base + "/mcp", headers={**auth(first), "MCP-Protocol-Version": "2025-11-25",
                                                             "Mcp-Session-Id": opened[0].headers["mcp-session-id"]})
        assert ended.status_code == 200, ended.text
        assert (await http.post(f.base + "/mcp", json=_INIT, headers=auth(second))).status_code == 200


async def test_refresh_negatives_are_refused_with_no_effect(front: Front) -> None:
    """Another client's refresh token, a token of the wrong kind, a wider scope, a foreign resource,
    an expired refresh token: each refused; none rotates or revokes the family."""
    async with httpx.AsyncClient() as http:
        client_id, tokens = await _tokens(http, front.base)  # read only
        other = await _register(http, front.base)
        refresh = tokens["refresh_token"]
        refusals = [
            (await _refresh(http, front.base, other["client_id"], refresh), "invalid_grant"),
            (await _refresh(http, front.base, client_id, tokens["access_token"]), "invalid_grant"),
            (await _refresh(http, front.base, client_id, refresh, scope="toastmachine:read toastmachine:write"),
             "invalid_scope"),
            (await _refresh(http, front.base, client_id, refresh, resource="https://other.example/mcp"),
             "invalid_target"),
            (await _refresh(http, front.base, client_id, refresh, resource=front.base + "/other"), "invalid_target"),
        ]
        for response, error in refusals:
            assert response.status_code == 400 and response.json()["error"] == error, response.text
        # A refresh token is no bearer token.
        bearer = {**_MCP_HEADERS, "Authorization": f"Bearer {refresh}"}
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=bearer)).status_code == 401
        # No effect: the token was never rotated and the family is live.
        assert await front.db.pool.fetchval("select count(*) from oauth_tokens where rotated_at is not null") == 0
        assert await front.db.pool.fetchval("select count(*) from oauth_grants where revoked_at is not null") == 0
        ok = await _refresh(http, front.base, client_id, refresh)
        assert ok.status_code == 200, ok.text
        # An expired refresh token is refused too.
        await front.db.pool.execute("update oauth_tokens set expires_at = now() - interval '1 second'"
                                    " where kind = 'refresh'")
        expired = await _refresh(http, front.base, client_id, ok.json()["refresh_token"])
        assert expired.status_code == 400 and expired.json()["error"] == "invalid_grant"


async def test_refresh_rotates_grace_retry_gets_same_pair_and_late_reuse_revokes_family(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client_id, tokens = await _tokens(http, front.base)
        first, second = await asyncio.gather(_refresh(http, front.base, client_id, tokens["refresh_token"]),
                                             _refresh(http, front.base, client_id, tokens["refresh_token"]))
        assert first.status_code == second.status_code == 200
        assert first.json() == second.json()  # the identical concurrent retry: one new pair
        new = first.json()
        assert new["refresh_token"] != tokens["refresh_token"]
        # Past the grace window, the rotated token coming back is a theft signal.
        await front.db.pool.execute("update oauth_tokens set rotated_at = now() - interval '1 hour'"
                                    " where rotated_at is not null")
        late = await _refresh(http, front.base, client_id, tokens["refresh_token"])
        assert late.status_code == 400 and late.json()["error"] == "invalid_grant"
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {new['access_token']}"}
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 401
        assert (await _refresh(http, front.base, client_id, new["refresh_token"])).status_code == 400


async def test_a_retry_within_the_grace_window_must_ask_the_scopes_the_first_exchange_got(front: Front) -> None:
    """A refresh narrowed to read, then the old token presented again within the grace window asking
    read and write: refused, not answered with the same pair labelled with a scope it does not
    carry; the identical retry (read) still gets that pair."""
    both = "toastmachine:read toastmachine:write"
    async with httpx.AsyncClient() as http:
        client_id, tokens = await _tokens(http, front.base, both)
        assert tokens["scope"] == both
        narrowed = await _refresh(http, front.base, client_id, tokens["refresh_token"], scope="toastmachine:read")
        assert narrowed.status_code == 200 and narrowed.json()["scope"] == "toastmachine:read"
        widened = await _refresh(http, front.base, client_id, tokens["refresh_token"], scope=both)
        assert widened.status_code == 400 and widened.json()["error"] == "invalid_grant", widened.text
        unscoped = await _refresh(http, front.base, client_id, tokens["refresh_token"])  # the old token's scopes
        assert unscoped.status_code == 400 and unscoped.json()["error"] == "invalid_grant", unscoped.text
        again = await _refresh(http, front.base, client_id, tokens["refresh_token"], scope="toastmachine:read")
        assert again.status_code == 200 and again.json() == narrowed.json()


async def test_revoked_and_expired_tokens_are_401(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client_id, tokens = await _tokens(http, front.base)
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        tampered = {**headers, "Authorization": f"Bearer {tokens['access_token'][:-2]}xx"}
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=tampered)).status_code == 401
        await front.db.pool.execute("update oauth_tokens set expires_at = now() - interval '1 second'"
                                    " where kind = 'access'")
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 401
        client_id, tokens = await _tokens(http, front.base)
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 200
        r = await http.post(front.base + "/revoke", data={"token": tokens["refresh_token"], "client_id": client_id})
        assert r.status_code == 200
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 401


async def test_read_only_token_calling_write_scoped_tool_gets_403_challenge(db: Database) -> None:
    from actors.mcp.app import ToolDeps, register_tools
    from actors.mcp.grants import declare_tool_scope, require_scope

    calls: list[str] = []

    def tools(server, deps: ToolDeps) -> None:  # type: ignore[no-untyped-def]
        register_tools(server, deps)
        declare_tool_scope("probe_write", "toastmachine:write")

        @server.tool(name="probe_write")
        async def probe_write() -> dict:
            require_scope("toastmachine:write")
            calls.append("ran")
            return {"ok": True}

    port = _free_port()
    settings = Settings(mcp_host="127.0.0.1", mcp_port=port)
    server = make_server(build_app(settings, db, tools=tools), host="127.0.0.1", port=port)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(20):
            while not server.started:
                await asyncio.sleep(0.02)
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as http:
            _, tokens = await _tokens(http, base)  # no scope asked: read only
            assert tokens["scope"] == "toastmachine:read"
            headers = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}",
                       "MCP-Protocol-Version": "2025-11-25"}
            init = await http.post(base + "/mcp", json=_INIT, headers=headers)
            assert init.status_code == 200
            if "mcp-session-id" in init.headers:
                headers["Mcp-Session-Id"] = init.headers["mcp-session-id"]
            call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "probe_write",
                                                                                    "arguments": {}}}
            r = await http.post(base + "/mcp", json=call, headers=headers)
            assert r.status_code == 403
            assert 'error="insufficient_scope"' in r.headers["www-authenticate"]
            assert 'scope="toastmachine:write"' in r.headers["www-authenticate"]
        assert calls == []
    finally:
        server.should_exit = True
        await task


# --- consent, fail closed, restart ----------------------------------------------------------------------

async def test_consent_csrf_and_deny(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        _, challenge = _pkce()
        r = await _authorize(http, front.base, client["client_id"], challenge)
        consent_url = r.headers["location"]
        page = await http.get(consent_url)
        fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page.text))
        # A cross-site POST has the form fields but not the cookie.
        async with httpx.AsyncClient() as attacker:
            forged = await attacker.post(front.base + "/consent", data={**fields, "action": "approve",
                                                                         "mode": "create", "name": "forged"})
        assert forged.status_code == 403 and forged.json()["error"]["code"] == "csrf_failed"
        # A token that is not ASCII is refused the same way (it once reached compare_digest as a
        # str, which raises on anything but ASCII: a 500), with the cookie or without it.
        for cookies in ({}, {"tm_consent_csrf": "x"}):
            async with httpx.AsyncClient(cookies=cookies) as attacker:
                odd = await attacker.post(front.base + "/consent", data={**fields, "csrf": "é", "action": "approve",
                                                                         "mode": "create", "name": "forged"})
            assert odd.status_code == 403 and odd.json()["error"]["code"] == "csrf_failed", odd.text
        assert await front.db.pool.fetchval("select count(*) from agents where name = 'forged'") == 0
        denied = await http.post(front.base + "/consent", data={**fields, "action": "deny"})
        assert denied.status_code == 303
        query = parse_qs(urlsplit(denied.headers["location"]).query)
        assert query["error"] == ["access_denied"] and query["state"] == ["st-1"]


async def test_link_existing_agent_by_credential(front: Front) -> None:
    from actors.web.agents import register_agent
    from infra.ratelimit import registration_budget
    from protocol.agents import Registration

    agent = await register_agent(front.db.pool, registration_budget(20), Registration(name="linked-one"), "10.0.0.1")
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        _, challenge = _pkce()
        r = await _authorize(http, front.base, client["client_id"], challenge)
        wrong = await _consent(http, r.headers["location"], credential="tm_wrong")
        assert wrong.status_code == 400
        back = await _consent(http, r.headers["location"], credential=agent.credential)
        assert back.status_code == 303
    grant_agent = await front.db.pool.fetchval("select agent_id from oauth_grants")
    assert grant_agent == agent.agent_id


async def test_a_new_agents_credential_is_shown_once_when_asked_and_links_a_second_app(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        verifier, challenge = _pkce()
        r = await _authorize(http, front.base, client["client_id"], challenge)
        page = await _consent(http, r.headers["location"], name="shown-once", show_credential=True)
        assert page.status_code == 200, page.text
        assert page.headers["cache-control"] == "no-store" and "form-action 'none'" in page.headers[
            "content-security-policy"]
        found = re.search(r'<code id="credential">(tm_[A-Za-z0-9_-]{43})</code>', page.text)
        assert found is not None
        credential = found.group(1)
        # Only its hash is kept, on the agent the grant acts as.
        row = await front.db.pool.fetchrow(
            "select a.name from agents a join oauth_grants g using (agent_id) where a.credential_hash = $1",
            hashlib.sha256(credential.encode()).digest())
        assert row is not None and row["name"] == "shown-once"
        # Continue goes back to the app with the code, which exchanges as usual.
        link = re.search(r'<a id="continue" href="([^"]+)"', page.text)
        assert link is not None
        query = parse_qs(urlsplit(link.group(1).replace("&amp;", "&")).query)
        assert query["state"] == ["st-1"] and query["iss"] == [front.base]
        assert (await _exchange(http, front.base, client["client_id"], query["code"][0], verifier)).status_code == 200
        # The credential connects a second app as the same agent.
        other = await _register(http, front.base, client_name="Second app")
        r = await _authorize(http, front.base, other["client_id"], challenge)
        assert (await _consent(http, r.headers["location"], credential=credential)).status_code == 303
        # Without the box ticked nobody sees a credential: straight back to the app.
        r = await _authorize(http, front.base, client["client_id"], challenge)
        back = await _consent(http, r.headers["location"], name="never-shown")
        assert back.status_code == 303 and "tm_" not in back.text
    agents = await front.db.pool.fetch("select distinct a.name from oauth_grants g join agents a using (agent_id)")
    assert sorted(r["name"] for r in agents) == ["never-shown", "shown-once"]


async def test_client_record_with_a_field_removed_is_refused(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        await front.db.pool.execute("update oauth_clients set metadata = metadata - 'token_endpoint_auth_method'")
        _, challenge = _pkce()
        r = await _authorize(http, front.base, client["client_id"], challenge)
        assert r.status_code == 400 and r.json()["error"] == "invalid_request"


async def test_restart_keeps_grants_working(db: Database) -> None:
    port = _free_port()
    async with serve(db, port) as f, httpx.AsyncClient() as http:
        client_id, tokens = await _tokens(http, f.base)
    async with serve(db, port) as f, httpx.AsyncClient() as http:
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        assert (await http.post(f.base + "/mcp", json=_INIT, headers=headers)).status_code == 200
        assert (await _refresh(http, f.base, client_id, tokens["refresh_token"])).status_code == 200


# --- the operator's CLI ---------------------------------------------------------------------------------

async def _cli(dsn: str, *args: str) -> tuple[int, str]:
    from tests import procs

    proc = await procs.start(*args, env=procs.clean_env(TOASTMACHINE_DATABASE_URL=dsn))
    code = await proc.wait()
    return code, "\n".join(proc.output)


async def test_nul_and_control_characters_in_oauth_input_are_refused_not_a_500(front: Front, database_dsn: str) -> None:
    async with httpx.AsyncClient() as http:
        before = await front.db.pool.fetchval("select count(*) from oauth_clients")
        for name in ("\u0000", "\x1b[31mRED\x1b[0m\x1b]0;pwned\x07 ok", "look \u202egnp.exe", "a\u0085b"):
            r = await http.post(front.base + "/register", json={"redirect_uris": ["http://127.0.0.1/cb"],
                                                                 "client_name": name})
            assert r.status_code == 400 and r.json()["error"] == "invalid_client_metadata", (name, r.text)
        assert await front.db.pool.fetchval("select count(*) from oauth_clients") == before
        # An unknown (and unstorable) client id is an unknown client, never a 500.
        _, challenge = _pkce()
        r = await _authorize(http, front.base, "\x00", challenge)
        assert r.status_code == 400 and "error" in r.json(), r.text
        for path in ("/token", "/revoke"):
            r = await http.post(front.base + path, data={"client_id": "\x00", "grant_type": "authorization_code",
                                                         "code": "x", "token": "x"})
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        # A state the node cannot keep is the client's error, sent back as one.
        client = await _register(http, front.base)
        r = await _authorize(http, front.base, client["client_id"], challenge, state="a\x00b")
        assert r.status_code == 302, r.text
        assert parse_qs(urlsplit(r.headers["location"]).query)["error"] == ["invalid_request"], r.headers["location"]
        # A name stored before these checks reaches the operator's terminal as escapes, not as control codes.
        await front.db.pool.execute("update oauth_clients set metadata = jsonb_set(metadata, '{client_name}', "
                                    "to_jsonb($2::text)) where client_id = $1", client["client_id"],
                                    "\x1b]0;pwned\x07\u202eevil")
        code, out = await _cli(database_dsn, "oauth", "clients", "list")
        assert code == 0 and "\\x1b]0;pwned\\x07\\u202eevil" in out, out
        assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out


async def test_operator_cli_lists_clients_and_grants_and_revokes(front: Front, database_dsn: str) -> None:
    async with httpx.AsyncClient() as http:
        client_id, tokens = await _tokens(http, front.base)
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        code, out = await _cli(database_dsn, "oauth", "clients", "list")
        assert code == 0 and client_id in out and "Test app" in out and "1 live grants" in out, out
        code, out = await _cli(database_dsn, "oauth", "grants", "list")
        grant_id = str(await front.db.pool.fetchval("select grant_id from oauth_grants"))
        assert code == 0 and grant_id in out and "toastmachine:read" in out and "\tlive" in out, out
        assert tokens["access_token"] not in out and tokens["refresh_token"] not in out
        code, out = await _cli(database_dsn, "oauth", "revoke", grant_id)
        assert code == 0 and "revoked 1 grant" in out, out
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 401
        assert (await _refresh(http, front.base, client_id, tokens["refresh_token"])).status_code == 400
        code, out = await _cli(database_dsn, "oauth", "revoke", grant_id)
        assert code == 1 and "no live grant" in out, out
        code, out = await _cli(database_dsn, "oauth", "grants", "list")
        assert grant_id not in out


META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}


async def test_a_tool_call_naming_an_argument_twice_is_refused_as_the_http_api_refuses_it(front: Front) -> None:
    """The SDK's JSON parser keeps the last of two values silently; the front refuses the call with
    422 duplicate_key and the pointer into the arguments, on both revisions, before the tool runs."""
    async with httpx.AsyncClient() as http:
        _, tokens = await _tokens(http, front.base)
        auth = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        modern = {**auth, "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": "whoami"}
        meta = orjson.dumps(META).decode()

        async def call(arguments: str, **headers: str) -> httpx.Response:
            body = ('{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "whoami", '
                    f'"arguments": {arguments}, "_meta": {meta}}}}}')
            return await http.post(front.base + "/mcp", content=body.encode(), headers=headers)

        for arguments, pointer in (('{"q": "retry", "q": "timeout"}', "/q"),
                                   ('{"q": "retry", "kinds": ["claim"], "author": "a", "author": "b"}', "/author")):
            r = await call(arguments, **modern)
            assert r.status_code == 200, r.text
            result = r.json()["result"]
            error = result["structuredContent"]["error"]
            assert result["isError"] is True and error["upstream_code"] == "duplicate_key", result
            assert (error["http_status"], error["pointer"], error["category"]) == (422, pointer, "invalid_argument")
            assert "timeout" not in r.text  # neither value is echoed
        # (whoami takes no argument: each would be refused as unknown, after the duplicate.)
        r = await call('{"q": "retry"}', **modern)
        assert r.json()["result"]["structuredContent"]["error"]["upstream_code"] == "unknown_argument", r.text
        r = await call("{}", **modern)
        assert r.status_code == 200 and r.json()["result"]["isError"] is False, r.text
        assert r.json()["result"]["structuredContent"]["agent"]["agent_id"]
        # The 2025-11-25 revision, in a session.
        legacy = {**auth, "MCP-Protocol-Version": "2025-11-25"}
        init = await http.post(front.base + "/mcp", json=_INIT, headers=legacy)
        assert init.status_code == 200, init.text
        if "mcp-session-id" in init.headers:
            legacy["Mcp-Session-Id"] = init.headers["mcp-session-id"]
        r = await http.post(front.base + "/mcp", headers=legacy, content=b'{"jsonrpc": "2.0", "id": 8, '
                            b'"method": "tools/call", "params": {"name": "whoami", "arguments": '
                            b'{"limit": 5, "q": "x", "limit": 6}}}')
        assert r.status_code == 200, r.text
        text = r.text if r.headers["content-type"].startswith("application/json") else \
            next(line[5:] for line in r.text.splitlines() if line.startswith("data:"))
        error = orjson.loads(text)["result"]["structuredContent"]["error"]
        assert (error["upstream_code"], error["pointer"]) == ("duplicate_key", "/limit"), error


async def test_both_protocol_revisions_on_one_endpoint(front: Front) -> None:
    """2026-07-28 (stateless: server/discover, then a call with the routing headers) and 2025-11-25
    (initialize) from the same /mcp; whoami answers from the grant either way; answers are no-store."""
    async with httpx.AsyncClient() as http:
        _, tokens = await _tokens(http, front.base)
        auth = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        modern = {**auth, "MCP-Protocol-Version": "2026-07-28"}
        r = await http.post(front.base + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "server/discover",
                                                       "params": {"_meta": META}},
                            headers={**modern, "Mcp-Method": "server/discover"})
        assert r.status_code == 200, r.text
        assert "2026-07-28" in r.json()["result"]["supportedVersions"]
        assert r.headers["cache-control"] == "no-store" and r.headers["server"] == "ToastMachine"
        r = await http.post(front.base + "/mcp", json={"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                                       "params": {"name": "whoami", "arguments": {}, "_meta": META}},
                            headers={**modern, "Mcp-Method": "tools/call", "Mcp-Name": "whoami"})
        assert r.status_code == 200, r.text
        # A call is answered with one JSON body (no SSE stream per call), with the fixed headers.
        assert r.headers["content-type"].startswith("application/json")
        assert r.headers["cache-control"] == "no-store" and r.headers["server"] == "ToastMachine"
        agent = r.json()["result"]["structuredContent"]["agent"]
        grant_agent = await front.db.pool.fetchval("select agent_id from oauth_grants")
        assert agent["agent_id"] == str(grant_agent)
        # Only exactly /mcp is the endpoint: /mcp/ redirects to it, and the redirect still needs the token.
        r = await http.post(front.base + "/mcp/", json=_INIT, headers=_MCP_HEADERS)
        assert r.status_code == 307 and r.headers["location"].endswith("/mcp")
        r = await http.post(r.headers["location"], json=_INIT, headers=_MCP_HEADERS)
        assert r.status_code == 401 and r.headers["server"] == "ToastMachine"
        r = await http.post(front.base + "/mcp", json=_INIT, headers=auth)
        assert r.status_code == 200, r.text
        assert "2025-11-25" in r.text and r.headers["cache-control"] == "no-store"


async def test_expired_code_and_another_clients_code_are_refused(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        other = await _register(http, front.base)
        verifier, challenge = _pkce()
        code = await _code(http, front.base, client["client_id"], challenge)
        r = await _exchange(http, front.base, other["client_id"], code, verifier)
        assert r.status_code == 400 and r.json()["error"] == "invalid_grant"
        await front.db.pool.execute("update oauth_codes set expires_at = now() - interval '1 second'")
        r = await _exchange(http, front.base, client["client_id"], code, verifier)
        assert r.status_code == 400 and r.json()["error"] == "invalid_grant"
    assert await front.db.pool.fetchval("select count(*) from oauth_tokens") == 0


async def test_token_for_another_audience_is_401(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        _, tokens = await _tokens(http, front.base)
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 200
        await front.db.pool.execute("update oauth_grants set resource = 'https://other.example/mcp'")
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 401


async def test_no_secret_is_ever_logged(db: Database, capsys: pytest.CaptureFixture[str],
                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    secrets_seen: list[str] = []
    async with serve(db, _free_port()) as f, httpx.AsyncClient() as http:
        client = await _register(http, f.base, token_endpoint_auth_method="client_secret_post")
        secrets_seen.append(client["client_secret"])
        verifier, challenge = _pkce()
        r = await _authorize(http, f.base, client["client_id"], challenge)
        consent_url = r.headers["location"]
        secrets_seen.append(parse_qs(urlsplit(consent_url).query)["request"][0])
        back = await _consent(http, consent_url)
        code = parse_qs(urlsplit(back.headers["location"]).query)["code"][0]
        secrets_seen += [code, http.cookies["tm_consent_csrf"]]
        r = await _exchange(http, f.base, client["client_id"], code, verifier, client_secret=client["client_secret"])
        assert r.status_code == 200, r.text
        tokens = r.json()
        secrets_seen += [tokens["access_token"], tokens["refresh_token"]]
        await _exchange(http, f.base, client["client_id"], code, verifier, client_secret=client["client_secret"])
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}x"}
        await http.post(f.base + "/mcp", json=_INIT, headers=headers)
    # Everything the server side logged (the test's own HTTP client logs its URLs: not ours).
    server_records = "\n".join(f"{r.name} {r.getMessage()} {r.args}" for r in caplog.records
                               if not r.name.startswith(("httpx", "httpcore")))
    captured = capsys.readouterr()
    logged = captured.out + captured.err + server_records
    assert "oauth.code_exchanged" in logged  # the logs are there ...
    for secret in secrets_seen:
        assert secret not in logged  # ... without any secret in them
    stored = await db.pool.fetch("select metadata::text as m from oauth_clients")
    assert all(client["client_secret"] not in row["m"] for row in stored)


async def test_authorization_requests_are_rate_limited_per_address(db: Database) -> None:
    async with serve(db, _free_port(), mcp_authorize_per_minute=4) as f, httpx.AsyncClient() as http:
        client = await _register(http, f.base)  # registrations draw on the same budget
        _, challenge = _pkce()
        for _ in range(3):
            assert (await _authorize(http, f.base, client["client_id"], challenge)).status_code == 302
        # A forwarding header from an untrusted peer names no other client: still the same budget.
        http.headers["X-Forwarded-For"] = "203.0.113.9"
        r = await _authorize(http, f.base, client["client_id"], challenge)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limited"
        r = await http.post(f.base + "/register", json={"redirect_uris": ["http://127.0.0.1/cb"]})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
    assert await db.pool.fetchval("select count(*) from oauth_pending") == 3
    assert await db.pool.fetchval("select count(*) from oauth_clients") == 1


async def test_cleanup_deletes_only_rows_long_expired_in_bounded_batches(front: Front) -> None:
    from actors.mcp.cleanup import delete_expired

    async with httpx.AsyncClient() as http:
        for _ in range(3):
            await _tokens(http, front.base)
    pool = front.db.pool
    # Two token pairs long expired, one just expired (kept for reuse detection), one pair live.
    await pool.execute("update oauth_tokens set expires_at = now() - interval '2 days' where grant_id in"
                       " (select grant_id from oauth_grants order by created_at limit 2)")
    await pool.execute("update oauth_tokens set expires_at = now() - interval '1 minute' where grant_id ="
                       " (select grant_id from oauth_grants order by created_at offset 2 limit 1) and kind = 'access'")
    await pool.execute("update oauth_codes set expires_at = now() - interval '2 days'")
    assert await delete_expired(front.db, batch=1) == 2  # one code, one token: bounded per table
    assert await delete_expired(front.db, batch=100) == 2 + 3
    assert await delete_expired(front.db, batch=100) == 0
    left = await pool.fetch("select kind, expires_at > now() as live from oauth_tokens order by kind")
    assert [(r["kind"], r["live"]) for r in left] == [("access", False), ("refresh", True)]
    assert await pool.fetchval("select count(*) from oauth_grants") == 3


async def test_corrupted_pending_request_and_token_records_are_refused(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        client = await _register(http, front.base)
        _, challenge = _pkce()
        r = await _authorize(http, front.base, client["client_id"], challenge)
        await front.db.pool.execute("update oauth_pending set params = params - 'code_challenge'")
        page = await http.get(r.headers["location"])
        assert page.status_code == 400 and page.json()["error"]["code"] == "authorization_request_invalid"
        # A read-only grant whose token row was widened to write: the token is refused outright.
        _, tokens = await _tokens(http, front.base)
        headers = {**_MCP_HEADERS, "Authorization": f"Bearer {tokens['access_token']}"}
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 200
        await front.db.pool.execute("update oauth_tokens set scopes = array['toastmachine:read', 'toastmachine:write']")
        assert (await http.post(front.base + "/mcp", json=_INIT, headers=headers)).status_code == 401
