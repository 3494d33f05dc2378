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
   ``insufficient_scope`` (naming the scope), the tool never runs; and the duplicate-key check: the
   SDK's JSON parser keeps the last of a key named twice, so the first repeated key of a
   ``tools/call`` is found here, in the request's own bytes, and handed to the tool call as
   :data:`REPEATED_KEY` (the call is refused with 422 ``duplicate_key``, as the HTTP API refuses it);
4. ``Server: ToastMachine`` and ``Cache-Control: no-store`` on every answer;
5. a 2025-11-25 session's GET stream answered: ``stream_opened(session_id)`` (so that notifications
   held while the session had no stream are sent now: :class:`actors.mcp.notify.LegacySubscriptions`);
6. the SDK's session manager (``handle_request``, its public entry: body limit, DNS-rebinding
   checks, both protocol revisions).

Token verification may be answered from the process's token cache (:mod:`actors.mcp.token_cache`),
but only behind a barrier that makes a revoked grant stop working at once on every MCP process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

import orjson
from mcp.server.auth.middleware.auth_context import auth_context_var
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, BearerAuthBackend
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol.validation import repeated_key

#: Largest JSON-RPC body the scope gate reads to find tool calls (the transport's own limit).
GATE_MAX_BYTES = 4 * 1024 * 1024

#: The ``Server`` header of every answer of the MCP front (like the web front: no framework or version).
SERVER_HEADER = (b"server", b"ToastMachine")
#: Headers every answer of /mcp carries: that, and no caching of anything token-gated.
_MCP_HEADERS = (SERVER_HEADER, (b"cache-control", b"no-store"))

Headers = tuple[tuple[bytes, bytes], ...]

#: The JSON Pointer of the first key the current ``tools/call`` request names twice in one object
#: (relative to its ``arguments`` when it is in them), or None. Set by :class:`McpEndpoint` for
#: the request; the SDK hands the sender's context variables to the call it dispatches, as it
#: hands on its own auth context.
REPEATED_KEY: ContextVar[str | None] = ContextVar("toastmachine_mcp_repeated_key", default=None)
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


class McpEndpoint:
    """The ASGI app of ``/mcp``: bearer check, scope gate and fixed headers around ``handler``.

    ``handler`` is the SDK session manager's ``handle_request``; ``backend`` the SDK's bearer backend
    over our token store; ``scopes()`` the declared scope of every tool; ``all_scopes`` the scopes a
    401 tells a client to ask for.
    """

    def __init__(self, handler: ASGIApp, backend: BearerAuthBackend, *, resource_metadata: str,
                 scopes: Callable[[], Mapping[str, str]], all_scopes: str,
                 stream_opened: Callable[[str], None] | None = None) -> None:
        self.handler = handler
        self.backend = backend
        self.resource_metadata = resource_metadata
        self.scopes = scopes
        self.all_scopes = all_scopes
        self.stream_opened = stream_opened

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = setting_headers(send, _MCP_HEADERS)
        authenticated = await self.backend.authenticate(HTTPConnection(scope))
        if authenticated is None:
            presented = any(k.lower() == b"authorization" for k, _ in scope.get("headers", ()))
            await self._refuse(sending, 401, "invalid_token", "Authentication required", self.all_scopes,
                               challenged=presented)
            return
        credentials, user = authenticated
        assert isinstance(user, AuthenticatedUser)
        scope["auth"], scope["user"] = credentials, user

        repeated = None
        if scope["method"] == "POST":
            body, more = await _read_body(receive)
            calls = [] if more else _tool_calls(body)
            missing = self._missing_scope(calls, set(credentials.scopes))
            if missing is not None:
                await self._refuse(sending, 403, "insufficient_scope", f"Required scope: {missing}", missing)
                return
            if calls:
                repeated = _repeated_in_call(body, calls)
            receive = _replay(body, more, receive)
        elif scope["method"] == "GET" and self.stream_opened is not None:
            session_id = HTTPConnection(scope).headers.get("mcp-session-id")
            if session_id:
                sending = _on_event_stream(sending, session_id, self.stream_opened)

        context, repeated_context = auth_context_var.set(user), REPEATED_KEY.set(repeated)
        try:
            await self.handler(scope, receive, sending)
        finally:
            REPEATED_KEY.reset(repeated_context)
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
        body = orjson.dumps({"error": error, "error_description": description})
        header = challenge(self.resource_metadata, error=error if challenged else None, description=description,
                           scope=scope)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", header.encode())]})
        await send({"type": "http.response.body", "body": body})


def _tool_calls(body: bytes) -> list[dict[str, Any]]:
    """The ``tools/call`` messages of a request body (a message or a batch of them); none when the
    body is not JSON (the transport answers the parse error)."""
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    messages = decoded if isinstance(decoded, list) else [decoded]
    return [m for m in messages if isinstance(m, dict) and m.get("method") == "tools/call"]


def _repeated_in_call(body: bytes, calls: list[dict[str, Any]]) -> str | None:
    """:data:`REPEATED_KEY`'s value for a request of one ``tools/call`` (a batch is left to the SDK,
    which the revisions served here do not accept)."""
    if len(calls) != 1 or body.lstrip()[:1] == b"[":
        return None
    pointer = repeated_key(body, calls[0])
    if pointer is not None and pointer.startswith(_ARGUMENTS + "/"):
        return pointer.removeprefix(_ARGUMENTS)
    return pointer


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
