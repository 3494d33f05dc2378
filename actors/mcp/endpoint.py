"""``/mcp`` as one ASGI layer in front of the SDK's Streamable HTTP session manager.

Every MCP call goes through here, so it does in one pass (one coroutine, one ``send`` wrapper) what
used to be five nested middlewares and a second Starlette app:

1. the bearer check: the SDK's :class:`BearerAuthBackend` (token lookup, expiry, audience) decides;
   a request without a valid token gets 401 with ``WWW-Authenticate: Bearer resource_metadata=…,
   scope=…`` (RFC 9728, and the scopes to ask for) before anything else runs;
2. the authenticated user is put where the SDK looks for it: ``scope["user"]``/``scope["auth"]``
   (the session manager ties a 2025-11-25 session to its credential) and the SDK's auth context
   variable (``get_access_token()``, read by :func:`actors.mcp.grants.current_grant`);
3. the scope gate: a ``tools/call`` for a tool whose declared scope the token lacks gets 403
   ``insufficient_scope`` (naming the scope), the tool never runs; and the exact-JSON check: the
   SDK's parser keeps the last of a key named twice, rounds numbers to doubles and reads ``NaN``,
   ``Infinity`` and ``1e400`` (stored as null), so a ``tools/call`` is read here as the HTTP API
   reads a body (:func:`protocol.validation.decode_json_body`, pointers relative to its
   ``arguments``) and what that refuses is handed to the call as :data:`BODY_REFUSAL`: the tool
   answers that refusal (``duplicate_key``, ``number_not_exact``, ``invalid_json``) and never runs;
4. ``Server: ToastMachine`` and ``Cache-Control: no-store`` on every answer;
5. a 2025-11-25 session's GET stream answered: ``stream_opened(session_id)`` (so that notifications
   held while the session had no stream are sent now: :class:`actors.mcp.notify.LegacySubscriptions`);
   and a request that would open a 2025-11-25 session refused (429) when its agent already holds
   ``sessions_per_agent`` on this node (:class:`SessionBound`), so that one agent cannot take every
   session the SDK keeps;
6. the SDK's session manager (``handle_request``, its public entry: body limit, DNS-rebinding
   checks, both protocol revisions).

Token verification may be answered from the process's token cache (:mod:`actors.mcp.token_cache`),
but only behind a barrier that makes a revoked grant stop working at once on every MCP process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import orjson
from mcp.server.auth.middleware.auth_context import auth_context_var
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, BearerAuthBackend
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infra.http import SERVER_HEADER as WEB_SERVER_HEADER
from infra.logs import get_logger
from infra.outages import DB_UNAVAILABLE_ERRORS, RETRY_AFTER
from protocol.errors import (
    ApiError,
    Forbidden,
    MethodNotAllowed,
    NotAcceptable,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from protocol.validation import decode_json_body

#: Seconds a client refused a new session is told to wait (Retry-After).
SESSION_RETRY_AFTER = 30
#: Largest JSON-RPC body the scope gate reads to find tool calls (the transport's own limit).
GATE_MAX_BYTES = 4 * 1024 * 1024

#: The ``Server`` header of every answer of the MCP front: the web front's (no framework or version).
SERVER_HEADER = (b"server", WEB_SERVER_HEADER.encode())
#: Headers every answer of /mcp carries: that, and no caching of anything token-gated.
_MCP_HEADERS = (SERVER_HEADER, (b"cache-control", b"no-store"))

Headers = tuple[tuple[bytes, bytes], ...]

log = get_logger("toastmachine.mcp.endpoint")

#: What the exact-JSON check refuses in the current request, a lone ``tools/call`` (its pointers
#: relative to the call's ``arguments``), or None. Set by :class:`McpEndpoint` for the request; the
#: SDK hands the sender's context variables to the call it dispatches, as it hands on its own auth
#: context.
BODY_REFUSAL: ContextVar[ApiError | None] = ContextVar("toastmachine_mcp_body_refusal", default=None)
_ARGUMENTS = "/params/arguments"


def setting_headers(send: Send, headers: Headers) -> Send:
    """``send`` with ``headers`` (lower-case names) set on the response, replacing any value they had."""
    names = frozenset(name for name, _ in headers)

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in names]
            message = {**message, "headers": [*kept, *headers]}
        await send(message)

    return sending


#: The SDK's own refusals, plain text or bodyless (transport security, body limit, the 2026-07-28
#: transport's method and Accept checks), as the JSON error envelope every other answer of this
#: origin uses. Their reason is known from the status alone: nothing of the request is echoed.
_PLAIN_REFUSALS: dict[int, ApiError] = {
    400: UnsupportedMediaType("MCP messages must be sent as application/json.",
                              how_to_proceed="POST JSON-RPC with 'Content-Type: application/json'.",
                              status=400, code="invalid_content_type"),
    403: Forbidden("The Origin header names a site this MCP server does not serve (DNS-rebinding protection).",
                   code="origin_not_allowed",
                   how_to_proceed="Connect from this server's own origin, or without an Origin header."),
    405: MethodNotAllowed("/mcp does not take this method.",
                          how_to_proceed="Send one of the methods in the Allow header."),
    406: NotAcceptable("/mcp answers application/json and text/event-stream only.",
                       how_to_proceed="Send 'Accept: application/json, text/event-stream'."),
    413: PayloadTooLarge("The request body is too large for this MCP route.",
                         how_to_proceed="Send a smaller body."),
    421: ApiError("The Host header does not name this MCP server (DNS-rebinding protection).",
                  status=421, code="misdirected_request",
                  how_to_proceed="Connect through the server's public URL (TOASTMACHINE_MCP_PUBLIC_URL)."),
}


#: The same for the OAuth routes: only the body limit's plain 413 (their other answers are the
#: SDK's OAuth JSON; a plain 400 there is Starlette's, for a form it could not read, whose reason
#: these fixed texts would not tell).
OAUTH_PLAIN_REFUSALS = {413: _PLAIN_REFUSALS[413]}


def json_refusals(send: Send, method: str, refusals: Mapping[int, ApiError] = _PLAIN_REFUSALS) -> Send:
    """``send`` with a plain-text or bodyless 4xx whose status ``refusals`` names turned into the JSON
    error envelope (the status and the other headers kept). Other statuses, answers that are
    already JSON (or HTML: the consent page), and every answer to HEAD pass as they are."""
    replacing: bytes | None = None

    async def sending(message: Message) -> None:
        nonlocal replacing
        if message["type"] == "http.response.start":
            status = message.get("status", 200)
            headers = message.get("headers", ())
            content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
            if 400 <= status < 500 and method != "HEAD" and (not content_type or content_type.startswith(b"text/plain")):
                error = refusals.get(status)
            else:
                error = None
            if error is not None:
                log.info("mcp.transport_refused", status=status, code=error.code)
                replacing = orjson.dumps(error.envelope())
                kept = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
                message = {**message, "headers": [*kept, (b"content-type", b"application/json"),
                                                  (b"content-length", str(len(replacing)).encode())]}
        elif message["type"] == "http.response.body" and replacing is not None:
            if message.get("more_body", False):
                return  # the plain text is dropped; the envelope goes with its last part
            message, replacing = {"type": "http.response.body", "body": replacing}, None
        await send(message)

    return sending


class SetHeaders:
    """ASGI middleware: :func:`setting_headers` on every answer of ``app``."""

    def __init__(self, app: ASGIApp, headers: Headers) -> None:
        self.app = app
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, setting_headers(send, self.headers))


def challenge(resource_metadata: str, *, error: str | None, description: str, scope: str) -> str:
    """The ``WWW-Authenticate`` value of a 401/403: the error, where the metadata is, what scope to ask for.

    ``error`` None: a request that carried no credentials at all, to which RFC 6750 (section 3.1)
    gives no error code, only where to get one.
    """
    found = f'error="{error}", error_description="{description}", ' if error is not None else ""
    return f'Bearer {found}resource_metadata="{resource_metadata}", scope="{scope}"'


class SessionBound:
    """At most ``per_agent`` open 2025-11-25 sessions per agent on this node.

    ``open_sessions(agent_id)`` counts the agent's live sessions (the SDK's session manager knows
    who opened each); the requests opening a session for an agent right now count too, so that
    concurrent ones cannot all pass the same count."""

    def __init__(self, per_agent: int, open_sessions: Callable[[str], int]) -> None:
        self.per_agent = per_agent
        self.open_sessions = open_sessions
        self._opening: collections.Counter[str] = collections.Counter()

    @staticmethod
    def opens_session(scope: Scope) -> bool:
        """Whether the session manager would open a session for this request: a POST with no session
        id, under no protocol version or a handshake one (the stateless revision opens none)."""
        if scope["method"] != "POST":
            return False
        headers = dict(scope.get("headers", ()))
        if b"mcp-session-id" in headers:
            return False
        version = headers.get(b"mcp-protocol-version")
        return version is None or version.decode("latin-1") in HANDSHAKE_PROTOCOL_VERSIONS

    def full(self, agent_id: str) -> bool:
        return self.open_sessions(agent_id) + self._opening[agent_id] >= self.per_agent

    @contextlib.contextmanager
    def opening(self, agent_id: str) -> Iterator[None]:
        self._opening[agent_id] += 1
        try:
            yield
        finally:
            self._opening[agent_id] -= 1
            if not self._opening[agent_id]:
                del self._opening[agent_id]


class McpEndpoint:
    """The ASGI app of ``/mcp``: bearer check, scope gate and fixed headers around ``handler``.

    ``handler`` is the SDK session manager's ``handle_request``; ``backend`` the SDK's bearer backend
    over our token store; ``scopes()`` the declared scope of every tool; ``all_scopes`` the scopes a
    401 tells a client to ask for.
    """

    def __init__(self, handler: ASGIApp, backend: BearerAuthBackend, *, resource_metadata: str,
                 scopes: Callable[[], Mapping[str, str]], all_scopes: str,
                 stream_opened: Callable[[str], None] | None = None,
                 sessions: SessionBound | None = None) -> None:
        self.handler = handler
        self.backend = backend
        self.resource_metadata = resource_metadata
        self.scopes = scopes
        self.all_scopes = all_scopes
        self.stream_opened = stream_opened
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = setting_headers(json_refusals(send, scope["method"]), _MCP_HEADERS)
        if sum(1 for k, _ in scope.get("headers", ()) if k.lower() == b"authorization") > 1:
            # Which of two bearer tokens the client meant is not ours to guess (the SDK takes the
            # first): refused as the HTTP API refuses a repeated credential (RFC 6750 §3.1).
            await _send_json(sending, 400, {"error": "invalid_request",
                                            "error_description": "Authorization was sent more than once"})
            return
        try:
            authenticated = await self.backend.authenticate(HTTPConnection(scope))
        except DB_UNAVAILABLE_ERRORS as e:  # the token could not be looked up: retry, not a 500
            log.warning("mcp.database_unavailable", error=repr(e))
            await send_unavailable(sending)
            return
        if authenticated is None:
            presented = any(k.lower() == b"authorization" for k, _ in scope.get("headers", ()))
            await self._refuse(sending, 401, "invalid_token", "Authentication required", self.all_scopes,
                               challenged=presented)
            return
        credentials, user = authenticated
        assert isinstance(user, AuthenticatedUser)
        scope["auth"], scope["user"] = credentials, user

        refusal = None
        if scope["method"] == "POST":
            body, more = await _read_body(receive)
            calls, refusal = ([], None) if more else _read_calls(body)
            missing = self._missing_scope(calls, set(credentials.scopes))
            if missing is not None:
                await self._refuse(sending, 403, "insufficient_scope", f"Required scope: {missing}", missing)
                return
            receive = _replay(body, more, receive)
        elif scope["method"] == "GET" and self.stream_opened is not None:
            session_id = HTTPConnection(scope).headers.get("mcp-session-id")
            if session_id:
                sending = _on_event_stream(sending, session_id, self.stream_opened)

        opening: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        agent_id = user.access_token.subject
        if self.sessions is not None and agent_id is not None and SessionBound.opens_session(scope):
            if self.sessions.full(agent_id):
                await _too_many_sessions(sending, self.sessions.per_agent)
                return
            opening = self.sessions.opening(agent_id)
        context, refusal_context = auth_context_var.set(user), BODY_REFUSAL.set(refusal)
        try:
            with opening:
                await self.handler(scope, receive, sending)
        finally:
            BODY_REFUSAL.reset(refusal_context)
            auth_context_var.reset(context)

    def _missing_scope(self, calls: list[dict[str, Any]], granted: set[str]) -> str | None:
        """The scope one of the ``tools/call`` messages ``calls`` needs and ``granted`` lacks; None
        when nothing is missing."""
        needed = self.scopes()
        for call in calls:
            params = call.get("params")
            name = params.get("name") if isinstance(params, dict) else None
            want = needed.get(name) if isinstance(name, str) else None
            if want is not None and want not in granted:
                return want
        return None

    async def _refuse(self, send: Send, status: int, error: str, description: str, scope: str, *,
                      challenged: bool = True) -> None:
        """Answer ``status`` with the JSON error and its ``WWW-Authenticate`` challenge; ``challenged``
        False (no credentials were sent): the challenge names no error."""
        header = challenge(self.resource_metadata, error=error if challenged else None, description=description,
                           scope=scope)
        await _send_json(send, status, {"error": error, "error_description": description},
                         (b"www-authenticate", header.encode()))


def _read_calls(body: bytes) -> tuple[list[dict[str, Any]], ApiError | None]:
    """The ``tools/call`` messages of a request body (a message or a batch of them), and what the
    exact-JSON check refuses in it when it is one ``tools/call``.

    A body the check refuses is read again leniently (Python's parser: a repeated key's last value,
    NaN, numbers of any size), as the SDK will read it, so that the scope gate still sees its calls.
    A nesting refusal is left to the tool, which bounds its arguments as the HTTP API bounds a body
    (the JSON-RPC envelope adds levels of its own). A body no parser reads is the SDK's -32700.
    """
    try:
        decoded: Any = decode_json_body(body, within=_ARGUMENTS)
        refusal = None
    except ApiError as e:
        refusal = None if e.code == "json_too_deep" else e
        try:
            decoded = json.loads(body)
        except (ValueError, RecursionError, UnicodeDecodeError):
            return [], None
    messages = decoded if isinstance(decoded, list) else [decoded]
    calls = [m for m in messages if isinstance(m, dict) and m.get("method") == "tools/call"]
    if isinstance(decoded, list) or len(calls) != 1:
        refusal = None  # a batch (which the revisions served here do not accept) is the SDK's to answer
    return calls, refusal


async def _too_many_sessions(send: Send, per_agent: int) -> None:
    """Answer 429 (JSON-RPC error body, as the SDK answers its own session refusals, and
    ``Retry-After``): the agent holds its share of this node's sessions."""
    await _send_json(send, 429, {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32000, "message": f"This agent already has {per_agent} open sessions on this MCP node: end one "
                                   "(DELETE with its Mcp-Session-Id) or wait for an idle one to expire, then retry."}},
                     (b"retry-after", str(SESSION_RETRY_AFTER).encode()))


async def send_unavailable(send: Send) -> None:
    """Answer 503 ``temporarily_unavailable`` (JSON, ``Retry-After``): the database is down."""
    await _send_json(send, 503, {"error": "temporarily_unavailable",
                                 "error_description": "The database is unavailable; retry in a few seconds."},
                     (b"retry-after", str(RETRY_AFTER).encode()))


async def _send_json(send: Send, status: int, document: Any, *headers: tuple[bytes, bytes]) -> None:
    """Answer ``status`` with ``document`` as JSON and ``headers`` besides its type and length."""
    body = orjson.dumps(document)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def _on_event_stream(send: Send, session_id: str, opened: Callable[[str], None]) -> Send:
    """``send`` that, once it sent a 200 event-stream head, calls ``opened(session_id)`` on the next
    loop turn (the SDK registers the stream in a task that runs by then)."""

    async def sending(message: Message) -> None:
        await send(message)
        if message["type"] == "http.response.start" and message.get("status") == 200 and any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message.get("headers", ())):
            asyncio.get_running_loop().call_soon(opened, session_id)

    return sending


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The request body, read up to :data:`GATE_MAX_BYTES`; and whether more of it is left unread."""
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
        more = message.get("more_body", False)
        if size > GATE_MAX_BYTES:
            break
    return b"".join(chunks), more


def _replay(body: bytes, more: bool, receive: Receive) -> Receive:
    """A ``receive`` that first hands back what the gate read, then the rest of the request."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replay
