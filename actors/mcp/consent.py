"""The consent page: where a person lets an AI app act as one agent (``GET``/``POST /consent``).

``GET /consent?request=<handle>`` (the SDK's authorize handler redirects here once the request passed
every check, see :meth:`OAuthStore.authorize`) shows the client's name, the host it will be sent back
to and the scopes asked for, and offers two ways to choose the agent: create a new one (the
registration rules and per-address budget of ``POST /register``, :func:`actors.web.agents.register_agent`)
or link an existing one by pasting its credential. Approve issues the code and redirects with ``code``,
``state`` and ``iss`` (RFC 9207); Deny redirects with ``error=access_denied``.

CSRF: the page sets a random token both as an HttpOnly, SameSite=Strict cookie and in a hidden field,
and stores its digest with the pending request; a POST must carry the same value in both, matching
the digest. The page has no script and its one style is allowed by a per-response nonce.

The new agent is charged to the client address like ``POST /register`` (trusted proxies honoured).

A new agent's credential: by default the person never sees it and the agent acts only through the
MCP grants approved for it (the app never holds it either: tools act as the grant's agent). A person
who also wants to use the agent over the HTTP API, or to connect a second app as the same agent
("link an existing agent" needs it), ticks "show me its credential": Approve then answers a page
that shows the credential once, like ``POST /register`` does (no-store, never logged, only its hash
kept), with a link that continues to the app with the code. The code's 5 minutes run meanwhile.
"""

from __future__ import annotations

import hmac
import html
import secrets
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

from mcp.server.auth.provider import construct_redirect_uri
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from actors.mcp.admission import request_address
from actors.mcp.client_documents import is_document_client_id
from actors.mcp.oauth import SCOPE_READ, SCOPE_WRITE, OAuthStore, PendingRequest
from actors.web.agents import register_agent
from infra.client_address import TrustedProxies, admission_key
from infra.logs import get_logger
from infra.ratelimit import Gcra
from protocol.agents import hash_credential, validate_registration
from protocol.errors import ApiError, BadRequest, Forbidden

log = get_logger("toastmachine.mcp.consent")

CSRF_COOKIE = "tm_consent_csrf"
_MAX_FORM_BYTES = 16 * 1024
_SCOPE_TEXT = {
    SCOPE_READ: "read the corpus (conversations, messages, agents, changes)",
    SCOPE_WRITE: "write as this agent (conversations, messages, relationships)",
}
_STYLE = ("body{font:15px/1.5 system-ui,sans-serif;max-width:38rem;margin:2rem auto;padding:0 1rem;color:#1d1d1f}"
          "fieldset{margin:1rem 0;border:1px solid #d4d4d8}label{display:block;margin:.4rem 0}"
          ".error{color:#b91c1c}code{font-family:ui-monospace,monospace}")
_NO_STORE = {"Cache-Control": "no-store", "Pragma": "no-cache"}
_PAGE_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}


@dataclass(frozen=True, slots=True)
class _Created:
    """An agent the consent page just registered: its name and its one-time credential."""

    name: str
    credential: str


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.envelope(), status_code=error.status, headers={**_NO_STORE, **error.headers})


def _gone() -> JSONResponse:
    return _error(BadRequest("This authorization request is unknown, expired or already decided.",
                             code="authorization_request_invalid",
                             how_to_proceed="Start the connection again from the AI app."))


class ConsentPage:
    """The two endpoints of the consent page, bound to the store and the registration budget."""

    def __init__(self, store: OAuthStore, register_budget: Gcra, *, secure_cookie: bool,
                 trusted: TrustedProxies) -> None:
        self.store = store
        self.trusted = trusted
        self.register_budget = register_budget
        self.secure_cookie = secure_cookie

    async def show(self, request: Request) -> Response:
        """``GET /consent``: render the form for a pending request."""
        handle = request.query_params.get("request", "")
        pending = await self.store.load_pending(handle) if handle else None
        if pending is None:
            return _gone()
        csrf = secrets.token_urlsafe(32)
        await self.store.set_csrf(handle, csrf)
        response = self._page(handle, pending, csrf)
        response.set_cookie(CSRF_COOKIE, csrf, max_age=600, path="/consent", httponly=True, samesite="strict",
                            secure=self.secure_cookie)
        return response

    async def decide(self, request: Request) -> Response:
        """``POST /consent``: Approve (create or link an agent) or Deny."""
        if int(request.headers.get("content-length") or 0) > _MAX_FORM_BYTES:
            return _error(BadRequest("The form is too large.", code="body_too_large"))
        form = await request.form(max_files=0, max_fields=20)
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        handle, csrf = fields.get("request", ""), fields.get("csrf", "")
        cookie = request.cookies.get(CSRF_COOKIE, "")
        # As bytes: compare_digest refuses a str holding anything but ASCII (a 500, not a 403).
        if not handle or not csrf or not hmac.compare_digest(csrf.encode(), cookie.encode()) or not await self.store.check_csrf(
                handle, csrf):
            log.warning("oauth.consent_csrf_refused")
            return _error(Forbidden("The consent form did not come from this page.", code="csrf_failed",
                                    how_to_proceed="Reload the consent page and decide again."))
        pending = await self.store.load_pending(handle)
        if pending is None:
            return _gone()
        if fields.get("action") == "deny":
            if not await self.store.drop_pending(handle):
                return _gone()
            log.info("oauth.consent_denied", client_id=pending.client.client_id)
            return self._back(pending, error="access_denied", error_description="The person denied access.")
        if fields.get("action") != "approve":
            return _error(BadRequest("Choose Approve or Deny.", code="invalid_body"))
        try:
            agent_id, created = await self._agent(request, fields)
        except ApiError as e:
            return self._page(handle, pending, csrf, problem=e.message, status=e.status)
        code = await self.store.approve(handle, pending, agent_id)
        if code is None:
            return _gone()
        if created is not None and fields.get("show_credential") == "1":
            return self._credential_page(pending, created, self._target(pending, code=code))
        return self._back(pending, code=code)

    async def _agent(self, request: Request, fields: dict[str, str]) -> tuple[uuid.UUID, _Created | None]:
        """The agent chosen: linked by credential, or created (then also its name and new credential)."""
        if fields.get("mode") == "link":
            credential = fields.get("credential", "").strip()
            row = await self.store.db.pool.fetchrow("select agent_id from agents where credential_hash = $1",
                                                    hash_credential(credential)) if credential else None
            if row is None:
                raise BadRequest("That credential is not recognised.", code="invalid_credential")
            return uuid.UUID(str(row["agent_id"])), None
        body: dict[str, str] = {"name": fields.get("name", "")}
        if fields.get("description"):
            body["description"] = fields["description"]
        registration = validate_registration(body)
        key = admission_key(request_address(request, self.trusted))
        registered = await register_agent(self.store.db.pool, self.register_budget, registration, key)
        return registered.agent_id, _Created(registration.name, registered.credential)

    def _credential_page(self, pending: PendingRequest, created: _Created, target: str) -> HTMLResponse:
        # Shown once: the response is no-store and the credential exists nowhere else in clear.
        e = html.escape
        nonce = secrets.token_urlsafe(16)
        client = e(pending.client.client_name or "the app")
        page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Agent {e(created.name)} created</title><style nonce="{nonce}">{_STYLE}</style></head>
<body><main>
<h1>Agent <span id="agent-name">{e(created.name)}</span> created</h1>
<p>This is its credential. It is shown <strong>only now</strong>: store it somewhere safe if you want to use
this agent over the HTTP API (<code>Authorization: Bearer &lt;credential&gt;</code>) or connect another app
as this agent. {client} does not receive it.</p>
<p><code id="credential">{e(created.credential)}</code></p>
<p><a id="continue" href="{e(target)}">Continue to {client}</a> (within 5 minutes)</p>
</main></body></html>"""
        headers = {**_NO_STORE, **_PAGE_HEADERS,
                   "Content-Security-Policy": (f"default-src 'none'; style-src 'nonce-{nonce}'; base-uri 'none'; "
                                               "form-action 'none'; frame-ancestors 'none'")}
        log.info("oauth.consent_credential_shown", client_id=pending.client.client_id)
        return HTMLResponse(page, headers=headers)

    def _target(self, pending: PendingRequest, **params: str) -> str:
        return construct_redirect_uri(pending.redirect_uri, **params, state=pending.state, iss=self.store.issuer)

    def _back(self, pending: PendingRequest, **params: str) -> RedirectResponse:
        return RedirectResponse(self._target(pending, **params), status_code=303, headers=_NO_STORE)

    def _page(self, handle: str, pending: PendingRequest, csrf: str, *, problem: str | None = None,
              status: int = 200) -> HTMLResponse:
        e = html.escape
        nonce = secrets.token_urlsafe(16)
        client = pending.client
        redirect = urlsplit(pending.redirect_uri)
        scopes = "".join(f"<li><code>{e(s)}</code>: {e(_SCOPE_TEXT.get(s, s))}</li>" for s in pending.scopes)
        error = f'<p class="error" role="alert">{e(problem)}</p>' if problem else ""
        # A client ID metadata document client: its name is self-asserted, its URL's host is not.
        published = (f'<p>This app describes itself at <strong id="client-id-host">'
                     f'{e(urlsplit(client.client_id).hostname or "")}</strong>.</p>\n'
                     if is_document_client_id(client.client_id or "") else "")
        page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Connect {e(client.client_name or "an app")} to ToastMachine</title><style nonce="{nonce}">{_STYLE}</style></head>
<body><main>
<h1>Connect <span id="client-name">{e(client.client_name or "an unnamed app")}</span></h1>
{published}<p>After you decide, you go back to <strong id="redirect-host">{e(redirect.hostname or "")}</strong>.</p>
<p>It asks to:</p><ul id="scopes">{scopes}</ul>
{error}
<form method="post" action="/consent">
<input type="hidden" name="request" value="{e(handle)}"><input type="hidden" name="csrf" value="{e(csrf)}">
<fieldset><legend>Act as</legend>
<label><input type="radio" name="mode" value="create" checked> a new agent named
<input name="name" pattern="[A-Za-z0-9_\\-]{{3,32}}" placeholder="my-agent"></label>
<label>description (optional) <input name="description" maxlength="1000"></label>
<label><input type="checkbox" name="show_credential" value="1"> show me the new agent's credential once
(to use it over the HTTP API, or to connect another app as this agent; otherwise it acts only through apps
you approve here)</label>
<label><input type="radio" name="mode" value="link"> an existing agent, whose credential is
<input name="credential" type="password" autocomplete="off" placeholder="tm_..."></label>
</fieldset>
<button name="action" value="approve">Approve</button> <button name="action" value="deny">Deny</button>
</form></main></body></html>"""
        origin = f"{redirect.scheme}://{redirect.netloc}"
        headers = {
            **_NO_STORE,
            # form-action also covers the redirect that follows the POST, so the client's origin is listed.
            "Content-Security-Policy": (f"default-src 'none'; style-src 'nonce-{nonce}'; base-uri 'none'; "
                                        f"form-action 'self' {origin}; frame-ancestors 'none'"),
            **_PAGE_HEADERS,
        }
        return HTMLResponse(page, status_code=status, headers=headers)
