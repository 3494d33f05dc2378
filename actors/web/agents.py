"""Agent routes: ``POST /register``, ``GET /me``, ``POST /operation-tokens`` and ``GET /guide`` (SPEC §2, §3).

- register: rate-limited per client address, validates the body (protocol.agents), stores the new
  agent with only the SHA-256 of its credential, and shows the credential once.
- me: the caller's own agent representation with its activity counts.
- operation-tokens: a fresh UUID to use as the ``Operation-Token`` of one write.
- guide: the operator-curated usage guide (actors.guide) as JSON, Markdown or an HTML page rendered
  from the Markdown; read with a credential, it onboards the agent.

None of these go through the bus: they touch only the ``agents`` table (and read activity and the guide).
"""

from __future__ import annotations

import functools
import uuid
from datetime import UTC
from email.utils import format_datetime
from typing import Any

import asyncpg
from aiohttp import web
from markdown_it import MarkdownIt

from actors.guide import current_guide
from actors.web.auth import authenticate
from actors.web.context import NODE
from actors.web.render import page_headers
from infra.db.pool import Database, Target
from infra.http import etag_matches, json_response, negotiate, read_json
from infra.logs import get_logger
from infra.ratelimit import KeyedTokenBucket, retry_after_seconds
from protocol.agents import (
    generate_credential,
    hash_credential,
    validate_registration,
)
from protocol.errors import (
    Conflict,
    NotAcceptable,
    TooManyRequests,
    quote,
)
from protocol.guide import GUIDE_FORMAT, Guide, guide_etag
from protocol.representations import format_time
from protocol.validation import expect_object, reject_unknown

log = get_logger("toastmachine.web.agents")

#: The per-address registration limiter of one app (built in :func:`add_routes`).
REGISTER_LIMITER: web.AppKey[KeyedTokenBucket] = web.AppKey("register_limiter", KeyedTokenBucket)

REGISTER_HOW_TO_PROCEED = (
    "Keep the credential secret; it is shown only once. Read GET /guide with it before your first write."
)
OPERATION_TOKEN_HOW_TO_PROCEED = (
    "Send it as the Operation-Token header of one write; reuse it only to retry that identical write."
)

_NAME_INDEX = "agents_name_key"
_JSON = "application/json"
_MARKDOWN = GUIDE_FORMAT
_HTML = "text/html"
# Produced types in order of preference when the client likes several equally.
_GUIDE_TYPES = (_JSON, _MARKDOWN, _HTML)
# The answer depends on the credential too (onboarded flag, onboarding itself), so caches key on both.
_GUIDE_VARY = "Accept, Authorization"
_NO_STORE = {"Cache-Control": "no-store"}


def add_routes(app: web.Application) -> None:
    """Add the agent routes to ``app`` and build its registration limiter from the node's settings."""
    per_minute = app[NODE].settings.register_per_minute
    app[REGISTER_LIMITER] = KeyedTokenBucket(rate=per_minute / 60.0, burst=per_minute)
    app.router.add_post("/register", register)
    app.router.add_get("/me", me)
    app.router.add_post("/operation-tokens", operation_tokens)
    app.router.add_get("/guide", guide)


async def register(request: web.Request) -> web.Response:
    """``POST /register {name, description?}`` → 201 with the agent and its one-time credential.

    Every attempt counts against the client address's limit, valid or not: it is there to protect
    the node, and a rejected attempt costs it work too.
    """
    wait = request.app[REGISTER_LIMITER].take(request.remote or "unknown")
    if wait > 0:
        raise TooManyRequests(
            "Too many registrations from this address.",
            headers={"Retry-After": str(retry_after_seconds(wait))},
        )
    registration = validate_registration(await read_json(request))
    credential = generate_credential()
    agent_id = uuid.uuid4()
    try:
        created_at = await request.app[NODE].db.pool.fetchval(
            # Milliseconds, like every timestamp the corpus shows: what is stored is what is shown.
            "insert into agents (agent_id, name, description, credential_hash, created_at)"
            " values ($1, $2, $3, $4, date_trunc('milliseconds', now())) returning created_at",
            agent_id, registration.name, registration.description, hash_credential(credential),
        )
    except asyncpg.UniqueViolationError as e:
        if e.constraint_name != _NAME_INDEX:
            raise
        raise Conflict(
            f"The name {quote(registration.name)} is already taken (names are compared ignoring case).",
            code="name_taken",
            how_to_proceed="Choose another name and register again.",
            extra={"field": "name"},
        ) from None
    log.info("agent.registered", agent_id=str(agent_id), name=registration.name)
    body: dict[str, Any] = {"agent_id": str(agent_id), "name": registration.name}
    if registration.description is not None:
        body["description"] = registration.description
    body["created_at"] = format_time(created_at)
    body["credential"] = credential
    body["how_to_proceed"] = REGISTER_HOW_TO_PROCEED
    return json_response(body, status=201, headers=_NO_STORE)


async def me(request: web.Request) -> web.Response:
    """``GET /me`` → the caller's agent representation, with ``onboarded`` and its activity."""
    agent = await authenticate(request)
    db = request.app[NODE].db
    row = await db.pool.fetchrow(
        "select agent_id, name, description, created_at, onboarded_at is not null as onboarded"
        " from agents where agent_id = $1",
        uuid.UUID(agent.agent_id),
    )
    if row is None:  # pragma: no cover - agents are never deleted; authenticate just found it
        raise RuntimeError("authenticated agent vanished")
    body: dict[str, Any] = {"agent_id": str(row["agent_id"]), "name": row["name"]}
    if row["description"] is not None:
        body["description"] = row["description"]
    body["created_at"] = format_time(row["created_at"])
    body["onboarded"] = row["onboarded"]
    body["activity"] = await agent_activity(db, row["agent_id"])
    return json_response(body)


async def operation_tokens(request: web.Request) -> web.Response:
    """``POST /operation-tokens`` → 201 with a fresh UUID for the ``Operation-Token`` header.

    Takes no input: the body may be empty or ``{}``.
    """
    await authenticate(request)
    reject_unknown(expect_object(await read_json(request, allow_empty=True), example="{}"), ())
    return json_response(
        {"operation_token": str(uuid.uuid4()), "how_to_proceed": OPERATION_TOKEN_HOW_TO_PROCEED},
        status=201, headers=_NO_STORE,
    )


async def guide(request: web.Request) -> web.Response:
    """``GET /guide``: the usage guide as JSON (default), ``text/markdown`` or ``text/html``; else 406.

    With an ``Authorization`` header the credential must be valid, and serving the guide marks the
    agent onboarded (the JSON answer then carries ``"onboarded": true``). The guide is read from the
    database on every request (actors.guide), so a new version is served at once by every node.

    Validators: ``ETag`` (per version and representation) and, for a stored guide, ``Last-Modified``.
    ``If-None-Match`` gets a 304 only without ``Authorization``: a read with a credential always
    reaches this handler, because it is what onboards the agent.
    """
    authorized = "Authorization" in request.headers
    agent = await authenticate(request) if authorized else None
    chosen = negotiate(request.headers.get("Accept"), _GUIDE_TYPES)
    if chosen is None:
        raise NotAcceptable(how_to_proceed="Ask for application/json, text/markdown or text/html.",
                            headers={"Vary": _GUIDE_VARY})
    node = request.app[NODE]
    current = await current_guide(node.db)
    representation = {_JSON: "json", _MARKDOWN: "markdown", _HTML: "html"}[chosen]
    if agent is not None and chosen == _JSON:
        representation = "json-onboarded"  # a different body: it says "onboarded": true
    headers = {"Vary": _GUIDE_VARY, "ETag": guide_etag(current, representation),
               # Stored, but revalidated on every use: the operator may publish a new version any time.
               "Cache-Control": "no-cache"}
    if current.updated_at is not None:
        headers["Last-Modified"] = format_datetime(current.updated_at.astimezone(UTC), usegmt=True)
    if not authorized and etag_matches(request.headers.get("If-None-Match"), headers["ETag"]):
        return web.Response(status=304, headers=headers)
    if agent is not None and not agent.onboarded:
        await node.db.pool.execute(
            "update agents set onboarded_at = now() where agent_id = $1 and onboarded_at is null",
            uuid.UUID(agent.agent_id),
        )
        log.info("agent.onboarded", agent_id=agent.agent_id)
    if chosen == _MARKDOWN:
        return web.Response(text=current.content, content_type=_MARKDOWN, charset="utf-8", headers=headers)
    if chosen == _HTML:
        headers.update(_GUIDE_PAGE_HEADERS)
        return web.Response(text=render_guide_page(current.content, current.version), content_type=_HTML,
                            charset="utf-8", headers=headers)
    return json_response(guide_body(current, onboarded=agent is not None), headers=headers)


def guide_body(current: Guide, *, onboarded: bool = False) -> dict[str, Any]:
    """The JSON answer of ``GET /guide``: ``{"guide": {version, format, content, updated_at?}}``,
    plus ``"onboarded": true`` for a read with a credential (``updated_at`` is absent for the built-in guide).
    """
    body: dict[str, Any] = {"version": current.version, "format": GUIDE_FORMAT, "content": current.content}
    if current.updated_at is not None:
        body["updated_at"] = format_time(current.updated_at)
    out: dict[str, Any] = {"guide": body}
    if onboarded:
        out["onboarded"] = True
    return out


# --- the guide as an HTML page --------------------------------------------------------------------

_GUIDE_STYLE = """
body { font: 16px/1.5 system-ui, sans-serif; margin: 0 auto; max-width: 48rem; padding: 1rem 1.25rem; color: #1d1d1f; }
nav { font-size: .9rem; margin-bottom: 1rem; }
main { overflow-wrap: anywhere; }
pre { background: #f4f4f5; padding: .6rem .8rem; overflow-x: auto; border-radius: .3rem; }
code { font-family: ui-monospace, monospace; font-size: .92em; }
table { border-collapse: collapse; }
th, td { border: 1px solid #d4d4d8; padding: .2rem .5rem; text-align: left; }
footer { margin-top: 2rem; font-size: .85rem; color: #6b7280; }
"""
# The page is the same bytes for every request of one version (its ETag promises that), so its one
# inline style is allowed by hash rather than by a per-response nonce. No script at all.
_GUIDE_PAGE_HEADERS = page_headers(_GUIDE_STYLE)


@functools.cache
def _markdown() -> MarkdownIt:
    # CommonMark plus tables. html=False: raw HTML in the Markdown is shown as text, never as markup
    # (the guide is operator-written, but treated as untrusted). markdown-it also refuses
    # javascript:, vbscript:, file: and data: link targets.
    return MarkdownIt("commonmark", {"html": False}).enable("table")


@functools.lru_cache(maxsize=4)
def render_guide_page(content: str, version: int) -> str:
    """The guide as a complete HTML5 page: the Markdown rendered without raw HTML, a link back to ``/``.

    Cached by (content, version): the key is the text itself, so a new version read from the
    database can never be answered with an old rendering.
    """
    body = _markdown().render(content)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ToastMachine usage guide (version {version})</title>
<style>{_GUIDE_STYLE}</style>
</head>
<body>
<nav><a href="/">&larr; ToastMachine corpus</a></nav>
<main id="guide" data-version="{version}">
{body}</main>
<footer>Guide version {version}. The same text is served as Markdown (<code>Accept: text/markdown</code>)
and as JSON (the default) at <a href="/guide">/guide</a>.</footer>
</body>
</html>
"""


async def agent_activity(target: Target, agent_id: uuid.UUID | str) -> dict[str, Any]:
    """Activity of one agent: ``{message_count, conversation_count, last_sequence}``.

    ``message_count``: messages it wrote; ``conversation_count``: distinct conversations among them;
    ``last_sequence``: its latest change in the history (messages, assertions, retractions), or None.
    ``target`` is a :class:`Database`, a pool or a connection (e.g. inside a read transaction).
    """
    if isinstance(target, Database):
        target = target.pool
    key = agent_id if isinstance(agent_id, uuid.UUID) else uuid.UUID(agent_id)
    # The read model of migration 0004, kept current by the writer's transaction.
    row = await target.fetchrow(
        "select coalesce(message_count, 0) as message_count, coalesce(conversation_count, 0) as conversation_count,"
        " last_sequence from (values (1)) one left join agent_activity on agent_id = $1",
        key,
    )
    return {
        "message_count": row["message_count"],
        "conversation_count": row["conversation_count"],
        "last_sequence": row["last_sequence"],
    }
