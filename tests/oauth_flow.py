"""The MCP front's OAuth flow as a client and the person at the consent page drive it, over real HTTP.

Shared by the OAuth tests (tests/test_mcp_oauth.py, tests/test_mcp_process.py) and the MCP benchmark
(bench/mcp.py): dynamic registration of a public client, ``/authorize`` with PKCE S256, the consent
form (create a new agent, or link an existing one by its credential), and the code exchange; and the
SDK's own OAuth client provider (``mcp.client.auth``) with a person who approves the consent page.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import secrets
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
from mcp.client.auth import OAuthClientProvider, TokenStorage
from mcp.shared.auth import (
    AuthorizationCodeResult,
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthToken,
)

#: The redirect URI every client here registers (a loopback one: any port matches, RFC 8252).
REDIRECT = "http://127.0.0.1:53682/callback"


class FlowError(AssertionError):
    """A step of the flow got an answer other than the one a successful flow gets."""


def _expect(response: httpx.Response, status: int, step: str) -> None:
    if response.status_code != status:
        raise FlowError(f"{step} answered {response.status_code}, not {status}: {response.text[:500]}")


def pkce() -> tuple[str, str]:
    """A fresh PKCE (verifier, S256 challenge) pair."""
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")
    return verifier, challenge


async def consent(http: httpx.AsyncClient, consent_url: str, *, name: str | None = None,
                  action: str = "approve", credential: str | None = None, show_credential: bool = False,
                  ) -> httpx.Response:
    """Open the consent page and submit it: ``action`` approve or deny, for a new agent called ``name``
    (a random one when None; ``show_credential`` ticks the box that shows its credential once), or for
    the existing agent whose credential is ``credential``."""
    page = await http.get(consent_url)
    _expect(page, 200, "GET /consent")
    if "nonce-" not in page.headers.get("content-security-policy", ""):
        raise FlowError("the consent page has no nonce CSP")
    fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page.text))
    form = {**fields, "action": action}
    if credential is not None:
        form.update(mode="link", credential=credential)
    else:
        form.update(mode="create", name=name or f"app-{secrets.token_hex(4)}")
        if show_credential:
            form["show_credential"] = "1"
    return await http.post(consent_url.split("?")[0], data=form)


async def register(http: httpx.AsyncClient, base: str, **extra: object) -> dict[str, Any]:
    """Register a public client (``token_endpoint_auth_method: none``) redirecting to :data:`REDIRECT`."""
    body = {"redirect_uris": [REDIRECT], "client_name": "Test app", "token_endpoint_auth_method": "none", **extra}
    r = await http.post(base + "/register", json=body)
    _expect(r, 201, "POST /register")
    answer: dict[str, Any] = r.json()
    return answer


async def authorize(http: httpx.AsyncClient, base: str, client_id: str, challenge: str, **extra: str,
                    ) -> httpx.Response:
    """``GET /authorize`` for ``client_id`` with ``state=st-1`` (``extra`` adds or overrides parameters)."""
    params = {"response_type": "code", "client_id": client_id, "redirect_uri": REDIRECT,
              "code_challenge": challenge, "code_challenge_method": "S256", "state": "st-1", **extra}
    return await http.get(base + "/authorize", params=params)


async def code(http: httpx.AsyncClient, base: str, client_id: str, challenge: str, *,
               credential: str | None = None, **extra: str) -> str:
    """An authorization code: authorize, approve on the consent page (a new agent, or the agent of
    ``credential``), and check the redirect carries ``state`` and ``iss`` (RFC 9207)."""
    r = await authorize(http, base, client_id, challenge, **extra)
    _expect(r, 302, "GET /authorize")
    back = await consent(http, r.headers["location"], credential=credential)
    _expect(back, 303, "POST /consent")
    query = parse_qs(urlsplit(back.headers["location"]).query)
    if query.get("state") != ["st-1"] or query.get("iss") != [base]:
        raise FlowError(f"the redirect lacks state or iss: {back.headers['location']}")
    return query["code"][0]


async def exchange(http: httpx.AsyncClient, base: str, client_id: str, code: str, verifier: str,
                   **extra: str) -> httpx.Response:
    """``POST /token`` exchanging ``code`` (grant type authorization_code)."""
    return await http.post(base + "/token", data={"grant_type": "authorization_code", "code": code,
                                                  "redirect_uri": REDIRECT, "client_id": client_id,
                                                  "code_verifier": verifier, **extra})


async def tokens(http: httpx.AsyncClient, base: str, scope: str | None = None, *, client_id: str | None = None,
                 credential: str | None = None) -> tuple[str, dict[str, Any]]:
    """(client_id, token response) through the whole flow: registration (unless ``client_id`` is given),
    authorization, consent (a new agent, or the agent of ``credential``) and the code exchange."""
    if client_id is None:
        client_id = (await register(http, base))["client_id"]
    verifier, challenge = pkce()
    got = await code(http, base, client_id, challenge, credential=credential, **({"scope": scope} if scope else {}))
    r = await exchange(http, base, client_id, got, verifier)
    _expect(r, 200, "POST /token")
    answer: dict[str, Any] = r.json()
    return client_id, answer


class MemoryStorage(TokenStorage):
    """The SDK client's token and client storage, in memory."""

    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


def sdk_oauth_client(mcp_url: str, *, agent_name: str, scope: str | None = None,
                     client_name: str = "SDK test client", client_metadata_url: str | None = None,
                     ) -> tuple[OAuthClientProvider, MemoryStorage]:
    """The SDK's own OAuth client provider for ``mcp_url``, with a person who approves the consent
    page by creating agent ``agent_name``; and the storage where it keeps its tokens.

    With ``client_metadata_url`` the client uses that URL as its client id (a Client ID Metadata
    Document) instead of registering."""
    redirected: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def redirect_handler(url: str) -> None:
        # The person's browser: follow /authorize to the consent page and approve a new agent.
        async with httpx.AsyncClient() as browser:
            r = await browser.get(url)
            _expect(r, 302, "GET /authorize")
            back = await consent(browser, r.headers["location"], name=agent_name)
            _expect(back, 303, "POST /consent")
            redirected.set_result(back.headers["location"])

    async def callback_handler() -> AuthorizationCodeResult:
        query = parse_qs(urlsplit(await redirected).query)
        return AuthorizationCodeResult(code=query["code"][0], state=query.get("state", [None])[0],
                                       iss=query.get("iss", [None])[0])

    storage = MemoryStorage()
    metadata = OAuthClientMetadata(redirect_uris=[REDIRECT], client_name=client_name, scope=scope)  # type: ignore[list-item]
    return OAuthClientProvider(mcp_url, metadata, storage, redirect_handler=redirect_handler,
                               callback_handler=callback_handler, client_metadata_url=client_metadata_url), storage
