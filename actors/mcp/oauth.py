"""The MCP front's OAuth 2.1 authorization server: our storage and policy behind the SDK's handlers.

:class:`OAuthStore` implements the SDK's ``OAuthAuthorizationServerProvider`` protocol
(``mcp.server.auth.provider``) on the tables of migration 0006. The SDK's handler classes parse the
requests (authorize, token, register, revoke) and call it; every decision is made here:

- clients: dynamic registration (RFC 7591) accepts only https redirect URIs, or http on a loopback
  address (RFC 8252: there any port matches); anything else matches exactly, byte for byte.
- authorization: PKCE S256 only (the SDK handler refuses ``plain``), ``resource`` (RFC 8707) must be
  our canonical ``<issuer>/mcp`` and defaults to it; an omitted scope grants ``toastmachine:read``.
  The request waits in ``oauth_pending`` for the person's decision on the consent page
  (:mod:`actors.mcp.consent`), which issues the code.
- codes: single use, 5 minutes; the SDK checks redirect URI and PKCE before calling
  :meth:`exchange_authorization_code`, which consumes the code atomically. A second use of a code
  revokes the grant the first use created, and every token of it.
- tokens: opaque random access tokens (1 h) and refresh tokens (30 days), bound to one grant (client,
  agent, scopes, resource). A refresh token rotates on use; reusing a rotated one after
  :data:`REFRESH_GRACE_SECONDS` revokes the whole family; an identical retry within it gets the same
  new pair, re-derived from the presented token (nothing raw is stored).
- fail closed: a record with a missing or invalid field, expired or revoked, reads as absent.

Every secret is stored as its SHA-256 digest only, and none is ever logged.

Authorization requests are rate-limited per client address (:mod:`actors.mcp.admission`).

Expired rows are deleted in bounded batches by the MCP front (:mod:`actors.mcp.cleanup`).

Client ID Metadata Documents: a ``client_id`` that is an https URL is not registered but fetched
(:mod:`actors.mcp.client_documents`); the accepted document is kept in ``oauth_clients`` (metadata
key :data:`DOCUMENT_KEY` holds its expiry) so every node shares it, and is fetched again once stale.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
import uuid
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Any
from urllib.parse import unquote, urlsplit

from mcp.server.auth.middleware.client_auth import AuthenticationError, ClientAuthenticator
from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    AuthorizeError,
    RefreshToken,
    RegistrationError,
    RegistrationErrorCode,
    TokenError,
)
from mcp.shared.auth import InvalidRedirectUriError, OAuthClientInformationFull, OAuthToken
from pydantic import AnyUrl, ValidationError
from starlette.requests import Request

from actors.mcp.client_documents import (
    DocumentFetcher,
    DocumentRefused,
    check_document_url,
    is_document_client_id,
)
from actors.mcp.token_cache import TokenCache
from infra.db.pool import Database
from infra.logs import get_logger
from protocol.corpus import display_problem

log = get_logger("toastmachine.mcp.oauth")
#: An S256 PKCE challenge: the unpadded base64url of a SHA-256 digest (RFC 7636 §4.2).
_S256_CHALLENGE = re.compile(r"[A-Za-z0-9_-]{43}")

SCOPE_READ = "toastmachine:read"
SCOPE_WRITE = "toastmachine:write"
#: Every scope this server grants; ``offline_access`` is deliberately not among them.
SCOPES = (SCOPE_READ, SCOPE_WRITE)
#: What a request that names no scope is granted.
DEFAULT_SCOPES = (SCOPE_READ,)

ACCESS_TOKEN_SECONDS = 3600
REFRESH_TOKEN_SECONDS = 30 * 24 * 3600
CODE_SECONDS = 300
#: How long an authorization request waits for the person on the consent page.
PENDING_SECONDS = 600
#: A rotated refresh token presented again within this many seconds (by the same client, for the
#: same scopes) gets the pair its first use got: clients often refresh twice in parallel.
REFRESH_GRACE_SECONDS = 10.0

_MAX_REDIRECT_URIS = 10
_MAX_URI_CHARS = 2000
_MAX_CLIENT_NAME_CHARS = 200
_LOOPBACK_NAMES = ("localhost",)
_AUTH_METHODS = ("none", "client_secret_post", "client_secret_basic")
_GRANT_TYPES = ("authorization_code", "refresh_token")
#: Key in ``oauth_clients.metadata`` marking a client ID metadata document, with its expiry (epoch).
DOCUMENT_KEY = "tm_document"


def digest(secret: str) -> bytes:
    """The SHA-256 digest stored in place of ``secret`` (all our secrets carry >= 256 random bits)."""
    return hashlib.sha256(secret.encode("utf-8")).digest()


def _new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def _derived_secret(prefix: str, parent: str, salt: bytes, label: bytes) -> str:
    # Only a holder of ``parent`` (a raw refresh token) can compute this; the database keeps the salt.
    mac = hmac.new(parent.encode("utf-8"), salt + label, hashlib.sha256).digest()
    return prefix + base64.urlsafe_b64encode(mac).decode("ascii").rstrip("=")


# --- redirect URI policy ------------------------------------------------------------------------

def is_loopback_host(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``: the hosts on which RFC 8252 lets any port match."""
    if not host:
        return False
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_redirect_uri(uri: str) -> None:
    """Raise ValueError unless ``uri`` may be registered: https, or http on a loopback host; no fragment."""
    if len(uri) > _MAX_URI_CHARS:
        raise ValueError("a redirect URI is longer than 2000 characters")
    parts = urlsplit(uri)
    if parts.fragment or "#" in uri:
        raise ValueError("a redirect URI must not have a fragment")
    if not parts.hostname:
        raise ValueError("a redirect URI must name a host")
    if "@" in parts.netloc:
        # https://trusted.example@other.example/ goes to other.example: never what a person reads.
        raise ValueError("a redirect URI must not carry a user name or password")
    if parts.scheme == "https":
        return
    if parts.scheme == "http" and is_loopback_host(parts.hostname):
        return
    raise ValueError("redirect URIs must be https, or http on a loopback host (127.0.0.1, [::1], localhost)")


def redirect_matches(registered: str, requested: str) -> bool:
    """Exact string match, except that on a loopback host the port may differ (RFC 8252 §7.3)."""
    if registered == requested:
        return True
    a, b = urlsplit(registered), urlsplit(requested)
    if not (a.scheme == b.scheme == "http" and is_loopback_host(a.hostname)):
        return False
    try:
        a.port, b.port  # noqa: B018 - raise for a malformed port
    except ValueError:
        return False
    return (a.hostname == b.hostname and a.path == b.path and a.query == b.query
            and a.username is None and b.username is None and not b.fragment)


def client_problem(client_info: OAuthClientInformationFull) -> tuple[RegistrationErrorCode, str] | None:
    """``(error, description)`` when client metadata breaks our policy; None when acceptable.

    The same rules for dynamic registration and client ID metadata documents.
    """
    uris = [str(u) for u in client_info.redirect_uris or []]
    if not uris or len(uris) > _MAX_REDIRECT_URIS:
        return "invalid_redirect_uri", f"register 1 to {_MAX_REDIRECT_URIS} redirect URIs"
    for uri in uris:
        try:
            check_redirect_uri(uri)
        except ValueError as e:
            return "invalid_redirect_uri", str(e)
    if client_info.token_endpoint_auth_method not in _AUTH_METHODS:
        return ("invalid_client_metadata",
                "token_endpoint_auth_method must be none, client_secret_post or client_secret_basic")
    if not set(client_info.grant_types) <= set(_GRANT_TYPES):
        return "invalid_client_metadata", "grant_types may only be authorization_code and refresh_token"
    if client_info.client_name is not None and len(client_info.client_name) > _MAX_CLIENT_NAME_CHARS:
        return "invalid_client_metadata", "client_name is longer than 200 characters"
    # Metadata is shown on the consent page and by the operator's CLI: nothing that can drive a
    # terminal, reorder the text around it, or that the database cannot store (NUL).
    for name, value in client_info.model_dump(mode="json", exclude_none=True).items():
        for text in value if isinstance(value, list) else [value]:
            problem = display_problem(text) if isinstance(text, str) else None
            if problem is not None:
                return "invalid_client_metadata", f"{name} must not contain {problem}"
    return None


class RegisteredClient(OAuthClientInformationFull):
    """A client as loaded from ``oauth_clients``, with our redirect matching.

    ``client_secret`` is never set (only its digest is kept, in :attr:`secret_digest`); the token
    and revocation endpoints authenticate it with :class:`DigestClientAuthenticator`.
    """

    secret_digest: bytes | None = None

    def validate_redirect_uri(self, redirect_uri: AnyUrl | None) -> AnyUrl:
        uris = [str(u) for u in self.redirect_uris or []]
        if redirect_uri is None:
            if len(uris) == 1:
                return AnyUrl(uris[0])
            raise InvalidRedirectUriError("redirect_uri is required: the client registered several")
        requested = str(redirect_uri)
        if any(redirect_matches(u, requested) for u in uris):
            return redirect_uri
        raise InvalidRedirectUriError("redirect_uri is not one the client registered")


def basic_credentials(request: Request) -> tuple[str, str] | None:
    """The client id and secret of an ``Authorization: Basic`` header (RFC 6749 §2.3.1: each
    form-urlencoded, then joined by a colon and base64-encoded); None without one. A header that
    does not decode is :class:`AuthenticationError`."""
    header = request.headers.get("Authorization", "")
    if not header.startswith("Basic "):
        return None
    try:
        user, _, password = base64.b64decode(header[6:], validate=True).decode("utf-8").partition(":")
    except (ValueError, UnicodeDecodeError):
        raise AuthenticationError("Invalid Basic authentication header") from None
    return unquote(user), unquote(password)


class DigestClientAuthenticator(ClientAuthenticator):
    """The SDK's client authentication, comparing digests: we never hold a client's raw secret."""

    async def authenticate_request(self, request: Request) -> OAuthClientInformationFull:
        form = await request.form()
        client_id = form.get("client_id")
        if not isinstance(client_id, str) or not client_id:
            raise AuthenticationError("Missing client_id")
        client = await self.provider.get_client(client_id)
        if not isinstance(client, RegisteredClient):
            raise AuthenticationError("Invalid client_id")
        presented: str | None = None
        method = client.token_endpoint_auth_method
        if method == "client_secret_basic":
            basic = basic_credentials(request)
            if basic is None:
                raise AuthenticationError("Missing or invalid Basic authentication in Authorization header")
            user, presented = basic
            if user != client_id:
                raise AuthenticationError("Client ID mismatch in Basic auth")
        elif method == "client_secret_post":
            value = form.get("client_secret")
            presented = value if isinstance(value, str) else None
        if method == "none":
            return client
        if client.secret_digest is None or not presented:
            raise AuthenticationError("Client secret is required")
        if not hmac.compare_digest(client.secret_digest, digest(presented)):
            raise AuthenticationError("Invalid client_secret")
        return client


# --- the records the SDK handlers pass back to us -----------------------------------------------

class StoredCode(AuthorizationCode):
    """An authorization code as loaded (``code`` is the raw value the client presented)."""

    grant_id: str


class StoredRefreshToken(RefreshToken):
    """A refresh token as loaded; ``rotated`` when it was already exchanged (within the grace window)."""

    grant_id: str
    rotated: bool = False


class StoredAccessToken(AccessToken):
    """A valid access token: ``subject`` is the agent id, ``claims`` carry ``agent_name``, ``grant_id`` and ``onboarded``."""

    grant_id: str


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """An authorization request waiting on the consent page."""

    client: RegisteredClient
    state: str | None
    scopes: list[str]
    code_challenge: str
    redirect_uri: str
    redirect_uri_explicit: bool
    resource: str


class OAuthStore:
    """Our ``OAuthAuthorizationServerProvider``: policy and PostgreSQL storage (see the module doc)."""

    def __init__(self, db: Database, issuer: str, documents: DocumentFetcher | None = None,
                 tokens: TokenCache[StoredAccessToken] | None = None) -> None:
        self.db = db
        #: Verified access tokens kept in memory (:mod:`actors.mcp.token_cache`); None: none kept.
        self.tokens = tokens
        #: Fetches client ID metadata documents; None refuses every URL client id.
        self.documents = documents
        self.issuer = issuer.rstrip("/")
        #: The canonical protected resource (RFC 8707 / RFC 9728).
        self.resource = self.issuer + "/mcp"

    # -- clients --

    async def get_client(self, client_id: str) -> RegisteredClient | None:
        if len(client_id) > 200 or display_problem(client_id) is not None:
            return None  # (a NUL could not even be looked up: PostgreSQL text holds none)
        if is_document_client_id(client_id):
            return await self._document_client(client_id, first_fetch=False)
        row = await self.db.pool.fetchrow(
            "select client_id, client_secret_hash, metadata from oauth_clients where client_id = $1", client_id)
        if row is None:
            return None
        return self._client_from_row(row)

    def _client_from_row(self, row: Any) -> RegisteredClient | None:
        # Fail closed: every field the policy relies on must be present and valid again on load.
        try:
            meta = row["metadata"]
            if not isinstance(meta, dict):
                raise TypeError("metadata is not an object")
            for field in ("redirect_uris", "token_endpoint_auth_method", "grant_types", "scope"):
                if field not in meta:
                    raise ValueError(f"{field} is missing")
            uris = meta["redirect_uris"]
            if not isinstance(uris, list) or not uris:
                raise ValueError("redirect_uris is empty")
            for uri in uris:
                check_redirect_uri(str(uri))
            if meta["token_endpoint_auth_method"] not in _AUTH_METHODS:
                raise ValueError("unknown token_endpoint_auth_method")
            secret = row["client_secret_hash"]
            if (meta["token_endpoint_auth_method"] != "none") != (secret is not None):
                raise ValueError("client secret digest does not match the auth method")
            if DOCUMENT_KEY in meta:
                check_document_url(row["client_id"])
            fields = {k: v for k, v in meta.items() if k != DOCUMENT_KEY}
            client = RegisteredClient.model_validate({**fields, "client_id": row["client_id"]})
            client.secret_digest = bytes(secret) if secret is not None else None
            return client
        except (ValueError, TypeError, KeyError, ValidationError, DocumentRefused) as e:
            log.warning("oauth.client_record_invalid", client_id=row["client_id"], reason=type(e).__name__)
            return None

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        problem = client_problem(client_info)
        if problem is not None:
            raise RegistrationError(*problem)
        meta = client_info.model_dump(mode="json", exclude={"client_id", "client_secret"}, exclude_none=True)
        meta["redirect_uris"] = [str(u) for u in client_info.redirect_uris or []]
        meta.setdefault("scope", " ".join(SCOPES))
        secret = client_info.client_secret
        await self.db.pool.execute(
            "insert into oauth_clients (client_id, client_secret_hash, metadata) values ($1, $2, $3)",
            client_info.client_id, digest(secret) if secret else None, meta)
        log.info("oauth.client_registered", client_id=client_info.client_id,
                 auth_method=client_info.token_endpoint_auth_method)

    async def prepare_document_client(self, client_id: str) -> str | None:
        """Fetch and keep the document of a URL ``client_id`` not seen before (or stale); the reason
        it was refused (fixed text, for the app's developer: the authorization answer says it), or
        None (kept, fresh, or not a document URL).

        Called only by the authorization endpoint, behind its per-address budget: the other
        endpoints (token, revocation, consent) refresh a stale copy but never fetch a document for a
        client id nobody started an authorization with, so unauthenticated requests cannot make the
        node fetch arbitrary URLs at will."""
        if len(client_id) <= 200 and is_document_client_id(client_id):
            try:
                await self._document_client(client_id, first_fetch=True)
            except DocumentRefused as e:
                return e.reason
        return None

    async def _document_client(self, url: str, *, first_fetch: bool) -> RegisteredClient | None:
        # A client ID metadata document: the copy in oauth_clients while it is fresh, else fetch again.
        row = await self.db.pool.fetchrow(
            "select client_id, client_secret_hash, metadata,"
            " (metadata->'tm_document'->>'expires_at')::float8 > extract(epoch from now()) as fresh"
            " from oauth_clients where client_id = $1", url)
        if row is not None and row["fresh"]:
            return self._client_from_row(row)
        if self.documents is None or (row is None and not first_fetch):
            return None
        try:
            fetched = await self.documents.fetch(url)
            document = {k: v for k, v in fetched.metadata.items() if k != DOCUMENT_KEY}
            if "client_secret" in document or "client_secret_expires_at" in document:
                raise DocumentRefused("client_id document must not carry a client secret")
            document.setdefault("token_endpoint_auth_method", "none")
            if document["token_endpoint_auth_method"] != "none":
                raise DocumentRefused("client_id document clients are public (token_endpoint_auth_method none)")
            try:
                client = OAuthClientInformationFull.model_validate(document)
            except ValidationError:
                raise DocumentRefused("client_id document is not valid client metadata") from None
            problem = client_problem(client)
            if problem is not None:
                raise DocumentRefused("client_id document: " + problem[1])
        except DocumentRefused as e:
            log.warning("oauth.client_document_refused", reason=e.reason)
            if first_fetch:
                raise
            return None
        meta = client.model_dump(mode="json", exclude={"client_id", "client_secret"}, exclude_none=True)
        meta["redirect_uris"] = [str(u) for u in client.redirect_uris or []]
        meta.setdefault("scope", " ".join(SCOPES))
        row = await self.db.pool.fetchrow(
            "insert into oauth_clients (client_id, client_secret_hash, metadata)"
            " values ($1, null, $2::jsonb || jsonb_build_object($3::text, jsonb_build_object("
            "'expires_at', extract(epoch from now()) + $4::float8)))"
            " on conflict (client_id) do update set metadata = excluded.metadata"
            " where oauth_clients.metadata ? $3::text"
            " returning client_id, client_secret_hash, metadata",
            url, meta, DOCUMENT_KEY, float(fetched.max_age))
        log.info("oauth.client_document_fetched", max_age=fetched.max_age)
        return self._client_from_row(row) if row is not None else None

    # -- authorization --

    def canonical_resource(self, resource: str | None) -> str:
        """The resource a request is for: ours when omitted; anything else is ``invalid_target``."""
        if resource is None or resource.rstrip("/") == self.resource:
            return self.resource
        raise AuthorizeError("invalid_target", "resource must be this server's MCP endpoint: " + self.resource)

    async def authorize(self, client: OAuthClientInformationFull, params: AuthorizationParams) -> str:
        # The SDK takes a missing code_challenge_method for S256 (RFC 7636 says plain): a challenge
        # that is not the form of an S256 one is refused here, before consent, not at the token.
        if not _S256_CHALLENGE.fullmatch(params.code_challenge):
            raise AuthorizeError("invalid_request", "code_challenge must be an S256 challenge (43 base64url "
                                 "characters): PKCE S256 only, plain is refused")
        if "\x00" in (params.state or ""):  # kept (in jsonb) to be sent back: PostgreSQL holds no NUL
            raise AuthorizeError("invalid_request", "state must not contain NUL characters")
        resource = self.canonical_resource(params.resource)
        scopes = list(dict.fromkeys(params.scopes or DEFAULT_SCOPES))
        if not scopes or not set(scopes) <= set(SCOPES):
            raise AuthorizeError("invalid_scope", "scopes are toastmachine:read and toastmachine:write")
        handle = _new_secret("tmq_")
        pending = {"state": params.state, "scopes": scopes, "code_challenge": params.code_challenge,
                   "redirect_uri": str(params.redirect_uri),
                   "redirect_uri_explicit": params.redirect_uri_provided_explicitly, "resource": resource}
        await self.db.pool.execute(
            "insert into oauth_pending (request_hash, client_id, params, expires_at)"
            " values ($1, $2, $3, now() + make_interval(secs => $4))",
            digest(handle), client.client_id, pending, float(PENDING_SECONDS))
        return f"{self.issuer}/consent?request={handle}"

    async def load_pending(self, handle: str) -> PendingRequest | None:
        """The pending request behind a consent page handle, or None if unknown, expired or invalid."""
        row = await self.db.pool.fetchrow(
            "select client_id, params from oauth_pending where request_hash = $1 and expires_at > now()",
            digest(handle))
        if row is None:
            return None
        client = await self.get_client(row["client_id"])
        params = row["params"]
        try:
            pending = PendingRequest(
                client=client,  # type: ignore[arg-type]
                state=params.get("state"), scopes=list(params["scopes"]),
                code_challenge=str(params["code_challenge"]), redirect_uri=str(params["redirect_uri"]),
                redirect_uri_explicit=bool(params["redirect_uri_explicit"]), resource=str(params["resource"]))
        except (KeyError, TypeError, AttributeError):
            return None
        if client is None or not pending.scopes or not set(pending.scopes) <= set(SCOPES):
            return None
        return pending

    async def set_csrf(self, handle: str, csrf: str) -> None:
        """Bind the consent page's CSRF token (its digest) to the pending request."""
        await self.db.pool.execute("update oauth_pending set csrf_hash = $2 where request_hash = $1",
                                   digest(handle), digest(csrf))

    async def check_csrf(self, handle: str, csrf: str) -> bool:
        """True when ``csrf`` is the token bound to the pending request (constant-time compare)."""
        stored = await self.db.pool.fetchval(
            "select csrf_hash from oauth_pending where request_hash = $1 and expires_at > now()", digest(handle))
        return stored is not None and hmac.compare_digest(bytes(stored), digest(csrf))

    async def drop_pending(self, handle: str) -> bool:
        """Delete the pending request; False if it was already gone (decided in another tab)."""
        return await self.db.pool.fetchval(
            "with gone as (delete from oauth_pending where request_hash = $1 returning 1)"
            " select exists (select 1 from gone)", digest(handle))

    async def approve(self, handle: str, pending: PendingRequest, agent_id: uuid.UUID) -> str | None:
        """Consume the pending request and issue a code for ``agent_id``; None if already decided."""
        code = _new_secret("tmc_")
        grant_id = uuid.uuid4()
        async with self.db.pool.acquire() as conn, conn.transaction():
            gone = await conn.fetchval("delete from oauth_pending where request_hash = $1 and expires_at > now()"
                                       " returning 1", digest(handle))
            if gone is None:
                return None
            await conn.execute(
                "insert into oauth_grants (grant_id, client_id, agent_id, scopes, resource)"
                " values ($1, $2, $3, $4, $5)",
                grant_id, pending.client.client_id, agent_id, pending.scopes, pending.resource)
            await conn.execute(
                "insert into oauth_codes (code_hash, grant_id, code_challenge, redirect_uri, redirect_uri_explicit,"
                " expires_at) values ($1, $2, $3, $4, $5, now() + make_interval(secs => $6))",
                digest(code), grant_id, pending.code_challenge, pending.redirect_uri,
                pending.redirect_uri_explicit, float(CODE_SECONDS))
        log.info("oauth.grant_approved", grant_id=str(grant_id), client_id=pending.client.client_id,
                 agent_id=str(agent_id), scopes=pending.scopes)
        return code

    # -- codes --

    async def load_authorization_code(self, client: OAuthClientInformationFull, authorization_code: str,
                                      ) -> StoredCode | None:
        row = await self.db.pool.fetchrow(
            "select c.grant_id, c.code_challenge, c.redirect_uri, c.redirect_uri_explicit,"
            " extract(epoch from c.expires_at)::float8 as expires_at, c.used_at, g.client_id, g.scopes,"
            " g.resource, g.agent_id, g.revoked_at"
            " from oauth_codes c join oauth_grants g using (grant_id) where c.code_hash = $1",
            digest(authorization_code))
        if row is None or row["client_id"] != client.client_id:
            return None
        if row["used_at"] is not None:
            # A second use: whoever holds the code now may not be who used it first (RFC 6749 §4.1.2).
            await self.revoke_grant(row["grant_id"], reason="code_reused")
            return None
        if row["revoked_at"] is not None:
            return None
        try:
            return StoredCode(
                code=authorization_code, scopes=list(row["scopes"]), expires_at=row["expires_at"],
                client_id=row["client_id"], code_challenge=row["code_challenge"],
                redirect_uri=AnyUrl(row["redirect_uri"]),
                redirect_uri_provided_explicitly=row["redirect_uri_explicit"], resource=row["resource"],
                subject=str(row["agent_id"]), grant_id=str(row["grant_id"]))
        except (ValidationError, TypeError):
            return None

    async def exchange_authorization_code(self, client: OAuthClientInformationFull,
                                          authorization_code: StoredCode) -> OAuthToken:
        grant_id = uuid.UUID(authorization_code.grant_id)
        async with self.db.pool.acquire() as conn, conn.transaction():
            # Consumed only now, after the SDK checked redirect URI and PKCE: a failed attempt leaves it.
            used = await conn.fetchval(
                "update oauth_codes set used_at = now() where code_hash = $1 and used_at is null"
                " and expires_at > now() returning 1", digest(authorization_code.code))
            if used is None:
                raise TokenError("invalid_grant", "authorization code is not valid")
            pair = await self._issue(conn, grant_id, authorization_code.scopes)
        log.info("oauth.code_exchanged", grant_id=str(grant_id), client_id=client.client_id)
        return pair

    async def _issue(self, conn: Any, grant_id: uuid.UUID, scopes: list[str], *, parent: str | None = None,
                     salt: bytes | None = None) -> OAuthToken:
        if parent is not None and salt is not None:
            access, refresh = (_derived_secret("tma_", parent, salt, b"access"),
                               _derived_secret("tmr_", parent, salt, b"refresh"))
        else:
            access, refresh = _new_secret("tma_"), _new_secret("tmr_")
        await conn.execute(
            "insert into oauth_tokens (token_hash, kind, grant_id, scopes, expires_at) values"
            " ($1, 'access', $3, $4, now() + make_interval(secs => $5)),"
            " ($2, 'refresh', $3, $4, now() + make_interval(secs => $6))"
            " on conflict (token_hash) do nothing",
            digest(access), digest(refresh), grant_id, scopes, float(ACCESS_TOKEN_SECONDS),
            float(REFRESH_TOKEN_SECONDS))
        return OAuthToken(access_token=access, expires_in=ACCESS_TOKEN_SECONDS, scope=" ".join(scopes),
                          refresh_token=refresh)

    # -- refresh tokens --

    async def load_refresh_token(self, client: OAuthClientInformationFull, refresh_token: str,
                                 ) -> StoredRefreshToken | None:
        row = await self.db.pool.fetchrow(
            "select t.grant_id, t.scopes, extract(epoch from t.expires_at)::float8 as expires_at,"
            " t.expires_at > now() as live, t.revoked_at, t.rotated_at,"
            " extract(epoch from now() - t.rotated_at)::float8 as rotated_ago,"
            " g.client_id, g.resource, g.agent_id, g.revoked_at as grant_revoked_at"
            " from oauth_tokens t join oauth_grants g using (grant_id)"
            " where t.token_hash = $1 and t.kind = 'refresh'", digest(refresh_token))
        if row is None or row["client_id"] != client.client_id:
            return None
        if row["revoked_at"] is not None or row["grant_revoked_at"] is not None or not row["live"]:
            return None
        rotated = row["rotated_at"] is not None
        if rotated and row["rotated_ago"] > REFRESH_GRACE_SECONDS:
            # RFC 9700 §4.14.2: a rotated refresh token came back; someone has a copy. End the family.
            await self.revoke_grant(row["grant_id"], reason="refresh_token_reused")
            return None
        return StoredRefreshToken(token=refresh_token, client_id=row["client_id"], scopes=list(row["scopes"]),
                                  expires_at=int(row["expires_at"]), resource=row["resource"],
                                  subject=str(row["agent_id"]), grant_id=str(row["grant_id"]), rotated=rotated)

    async def exchange_refresh_token(self, client: OAuthClientInformationFull, refresh_token: StoredRefreshToken,
                                     scopes: list[str]) -> OAuthToken:
        grant_id = uuid.UUID(refresh_token.grant_id)
        async with self.db.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                "select t.scopes, t.rotated_at, t.rotation_salt, t.revoked_at, g.revoked_at as grant_revoked_at,"
                " extract(epoch from now() - t.rotated_at)::float8 as rotated_ago"
                " from oauth_tokens t join oauth_grants g using (grant_id)"
                " where t.token_hash = $1 and t.kind = 'refresh' for update of t",
                digest(refresh_token.token))
            if row is None or row["revoked_at"] is not None or row["grant_revoked_at"] is not None:
                raise TokenError("invalid_grant", "refresh token is not valid")
            if row["rotated_at"] is None:
                salt = secrets.token_bytes(16)
                await conn.execute(
                    "update oauth_tokens set rotated_at = now(), rotation_salt = $2 where token_hash = $1",
                    digest(refresh_token.token), salt)
            elif row["rotated_ago"] <= REFRESH_GRACE_SECONDS and row["rotation_salt"] is not None:
                salt = bytes(row["rotation_salt"])
                # The identical retry gets the same pair again: the scopes asked then, which the pair
                # it derives was stored with (not the old token's: a first exchange may have narrowed
                # them, and the pair would then be answered labelled with scopes it does not carry).
                issued = await conn.fetchval(
                    "select scopes from oauth_tokens where token_hash = $1 and kind = 'refresh'",
                    digest(_derived_secret("tmr_", refresh_token.token, salt, b"refresh")))
                if issued is None or sorted(scopes) != sorted(issued):
                    raise TokenError("invalid_grant", "refresh token was already used")
            else:
                raise TokenError("invalid_grant", "refresh token was already used")
            # A narrower scope is allowed (the SDK checked it is a subset); the family keeps its grant.
            return await self._issue(conn, grant_id, list(scopes), parent=refresh_token.token, salt=salt)

    # -- access tokens --

    async def load_access_token(self, token: str) -> StoredAccessToken | None:
        if not token or len(token) > 512:
            return None
        key = digest(token)
        cache = self.tokens
        if cache is not None and (kept := await cache.lookup(key)) is not None:
            return kept
        generation = cache.generation() if cache is not None else 0
        sent = time.monotonic()
        row = await self.db.pool.fetchrow(
            "select t.grant_id, t.scopes, extract(epoch from t.expires_at)::float8 as expires_at,"
            " extract(epoch from t.expires_at - now())::float8 as remaining,"
            " g.client_id, g.resource, g.agent_id, a.name as agent_name, g.scopes as grant_scopes,"
            " a.onboarded_at is not null as onboarded"
            " from oauth_tokens t join oauth_grants g using (grant_id) join oauth_clients c using (client_id)"
            " join agents a on a.agent_id = g.agent_id"
            " where t.token_hash = $1 and t.kind = 'access' and t.expires_at > now()"
            " and t.revoked_at is null and g.revoked_at is null", key)
        if row is None:
            return None
        scopes = list(row["scopes"] or [])
        # Fail closed: a token can never carry more than its grant, nor a scope we do not know.
        if (not scopes or not set(scopes) <= set(row["grant_scopes"] or []) or not set(scopes) <= set(SCOPES)
                or row["resource"] != self.resource):
            log.warning("oauth.token_record_invalid", grant_id=str(row["grant_id"]))
            return None
        stored = StoredAccessToken(token=token, client_id=row["client_id"], scopes=scopes,
                                   expires_at=int(row["expires_at"]), resource=row["resource"],
                                   subject=str(row["agent_id"]),
                                   claims={"iss": self.issuer, "agent_name": row["agent_name"],
                                           "grant_id": str(row["grant_id"]), "onboarded": bool(row["onboarded"])},
                                   grant_id=str(row["grant_id"]))
        if cache is not None:
            # Until the database's own expiry at the latest, counted from before the query was sent.
            cache.put(key, stored, grant_id=stored.grant_id, generation=generation, sent=sent,
                      remaining=float(row["remaining"]))
        return stored

    # -- revocation --

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        """RFC 7009: revoking either token of a family revokes the grant and so every token of it."""
        grant_id = getattr(token, "grant_id", None)
        if grant_id is not None:
            await self.revoke_grant(uuid.UUID(grant_id), reason="revoked_by_client")

    async def revoke_grant(self, grant_id: uuid.UUID | str, *, reason: str) -> bool:
        """Revoke a grant (and with it every code and token of its family); False if it was not live."""
        key = grant_id if isinstance(grant_id, uuid.UUID) else uuid.UUID(grant_id)
        done = await self.db.pool.fetchval(
            "with g as (update oauth_grants set revoked_at = now() where grant_id = $1 and revoked_at is null"
            " returning 1) select exists (select 1 from g)", key)
        if done:
            log.warning("oauth.grant_revoked", grant_id=str(key), reason=reason)
        return bool(done)

    async def exchange_identity_assertion(self, client: OAuthClientInformationFull, params: Any) -> OAuthToken:
        raise TokenError("unsupported_grant_type", "only authorization_code and refresh_token are supported")

