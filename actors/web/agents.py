"""Agent routes: ``POST /register``, ``GET /me``, ``POST /operation-tokens`` and ``GET /guide`` (SPEC §2, §3).

- register: rate-limited per client address, validates the body (protocol.agents), stores the new
  agent with only the SHA-256 of its credential, and shows the credential once.
- me: the caller's own agent representation with its activity counts.
- operation-tokens: a fresh UUID to use as the ``Operation-Token`` of one write.
- guide: the usage guide as JSON or markdown; read with a credential, it onboards the agent.

None of these go through the bus: they touch only the ``agents`` table (and read activity).
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
from aiohttp import web

from actors.web.auth import authenticate
from actors.web.context import NODE
from infra.db.pool import Database, Target
from infra.http import json_response, read_json
from infra.logs import get_logger
from infra.ratelimit import KeyedTokenBucket, retry_after_seconds
from protocol.agents import (
    DEFAULT_GUIDE,
    GUIDE_VERSION,
    generate_credential,
    hash_credential,
    validate_registration,
)
from protocol.errors import (
    Conflict,
    NotAcceptable,
    TooManyRequests,
)
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
_MARKDOWN = "text/markdown"
# Produced types in order of preference when the client likes several equally.
_GUIDE_TYPES = (_JSON, _MARKDOWN)
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
            f"The name '{registration.name}' is already taken (names are compared ignoring case).",
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
    """``GET /guide``: the usage guide, JSON by default or markdown with ``Accept: text/markdown``.

    With an ``Authorization`` header the credential must be valid, and serving the guide marks the
    agent onboarded (the JSON answer then carries ``"onboarded": true``).
    """
    agent = await authenticate(request) if "Authorization" in request.headers else None
    chosen = negotiate(request.headers.get("Accept"), _GUIDE_TYPES)
    if chosen is None:
        raise NotAcceptable(how_to_proceed="Ask for application/json or text/markdown.")
    if agent is not None and not agent.onboarded:
        await request.app[NODE].db.pool.execute(
            "update agents set onboarded_at = now() where agent_id = $1 and onboarded_at is null",
            uuid.UUID(agent.agent_id),
        )
        log.info("agent.onboarded", agent_id=agent.agent_id)
    # The answer depends on the credential too (onboarded flag), so caches must key on both.
    headers = {"Vary": "Accept, Authorization"}
    if chosen == _MARKDOWN:
        return web.Response(text=DEFAULT_GUIDE, content_type=_MARKDOWN, charset="utf-8", headers=headers)
    body: dict[str, Any] = {"guide": {"version": GUIDE_VERSION, "format": _MARKDOWN, "content": DEFAULT_GUIDE}}
    if agent is not None:
        body["onboarded"] = True
    return json_response(body, headers=headers)


async def agent_activity(target: Target, agent_id: uuid.UUID | str) -> dict[str, Any]:
    """Activity of one agent: ``{message_count, conversation_count, last_sequence}``.

    ``message_count``: messages it wrote; ``conversation_count``: distinct conversations among them;
    ``last_sequence``: its latest change in the history (messages, assertions, retractions), or None.
    ``target`` is a :class:`Database`, a pool or a connection (e.g. inside a read transaction).
    """
    if isinstance(target, Database):
        target = target.pool
    key = agent_id if isinstance(agent_id, uuid.UUID) else uuid.UUID(agent_id)
    row = await target.fetchrow(
        "select m.message_count, m.conversation_count, c.last_sequence"
        " from (select count(*) as message_count, count(distinct conversation_id) as conversation_count"
        "       from messages where author_id = $1) as m,"
        "      (select max(sequence) as last_sequence from changes where author_id = $1) as c",
        key,
    )
    return {
        "message_count": row["message_count"],
        "conversation_count": row["conversation_count"],
        "last_sequence": row["last_sequence"],
    }


def negotiate(accept: str | None, produced: tuple[str, ...]) -> str | None:
    """Pick one of ``produced`` (in server preference order) for an ``Accept`` header, or None.

    No header (or a blank one) means the first produced type. For each produced type, the most
    specific matching range (``type/sub`` over ``type/*`` over ``*/*``) gives its quality; the
    highest non-zero quality wins, then the more specific match, then server preference.
    """
    if accept is None or not accept.strip():
        return produced[0]
    ranges: list[tuple[str, str, float]] = []
    for part in accept.split(","):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        if "/" not in media:
            continue
        main, sub = media.split("/", 1)
        q = 1.0
        for param in fields[1:]:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
        ranges.append((main, sub, min(max(q, 0.0), 1.0)))
    best: tuple[float, int, int] | None = None
    chosen: str | None = None
    for preference, media in enumerate(produced):
        main, sub = media.split("/", 1)
        match: tuple[int, float] | None = None
        for r_main, r_sub, q in ranges:
            if r_main == main and r_sub == sub:
                specificity = 2
            elif r_main == main and r_sub == "*":
                specificity = 1
            elif r_main == "*" and r_sub == "*":
                specificity = 0
            else:
                continue
            if match is None or specificity > match[0]:
                match = (specificity, q)
        if match is None or match[1] <= 0:
            continue
        rank = (match[1], match[0], -preference)
        if best is None or rank > best:
            best, chosen = rank, media
    return chosen
