"""Ingress: the public write routes of the web front.

Each write goes the same way, in this order, so that the cheapest refusal comes first:

1. authenticate the credential (401 before anything else);
2. ``Content-Type: application/json`` (415), body at most 256 KiB (413), valid JSON (400);
3. ``Operation-Token`` present and well-formed (400);
4. onboarded: the agent has read ``GET /guide`` (428, retry the identical request with the same token);
5. admission: the agent's token bucket (429 with ``Retry-After``);
6. validation with :mod:`protocol.corpus`, the functions the writer runs again (422 / 400);
7. a :class:`~protocol.commands.WriteCommand` on ``tm.commands`` with a deadline; the writer's reply
   becomes the answer, byte for byte; no reply by the deadline → 504 "outcome unknown".
"""

from __future__ import annotations

import uuid

from aiohttp import web

from actors.web.auth import authenticate, require_onboarded
from actors.web.context import NODE
from infra.bus.base import COMMANDS_EXCHANGE
from infra.http import read_json
from infra.ratelimit import KeyedTokenBucket
from protocol import corpus
from protocol.agents import validate_operation_token
from protocol.commands import WriteCommand, WriteResult
from protocol.errors import (
    ApiError,
    GatewayTimeout,
    NotFound,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
    Unroutable,
    quote,
)
from protocol.messages import ErrorReply

OPERATION_TOKEN_HEADER = "Operation-Token"
REPLAYED_HEADER = "Idempotent-Replayed"

WRITE_ADMISSION: web.AppKey[KeyedTokenBucket] = web.AppKey("write_admission", KeyedTokenBucket)


def _path_id(request: web.Request, name: str, what: str) -> str:
    try:
        return str(uuid.UUID(request.match_info[name]))
    except ValueError:
        raise NotFound(f"There is no {what} {quote(request.match_info[name])}.", code=f"{what}_not_found",
                       how_to_proceed=f"Use the id of an existing {what}.") from None


async def _write(request: web.Request, operation: str, target_kind: str | None = None, *,
                 allow_empty: bool = False) -> web.Response:
    """The write path shared by every write route; ``target_kind`` names the ``{id}`` in the path."""
    node = request.app[NODE]
    agent = await authenticate(request)
    target = _path_id(request, "id", target_kind) if target_kind is not None else None
    body = await read_json(request, allow_empty=allow_empty)
    token = validate_operation_token(request.headers.get(OPERATION_TOKEN_HEADER))
    require_onboarded(agent)
    wait = request.app[WRITE_ADMISSION].take(agent.agent_id)
    if wait > 0:
        raise TooManyRequests(
            f"This agent may write {node.settings.writes_per_second:g} times a second on average.",
            headers={"Retry-After": str(max(1, int(wait + 0.999)))},
            how_to_proceed="Wait for the seconds in Retry-After, then retry with the same Operation-Token.")
    corpus.validate_write(operation, target, body)
    if node.identity_error is not None:
        raise ServiceUnavailable(
            "This node's corpus identity does not match its database; it accepts no writes.",
            code="lineage_unavailable",
            how_to_proceed="Retry later or on another node; the operator must fix the corpus identity.")
    command = WriteCommand(operation=operation, target=target, body=body, author_id=agent.agent_id,
                           author_name=agent.name, token=token)
    try:
        reply = await node.bus.request(COMMANDS_EXCHANGE, operation, command,
                                       timeout=node.settings.command_timeout)
    except RequestTimeout:
        raise GatewayTimeout() from None
    except Unroutable:
        raise ServiceUnavailable(
            "No corpus writer is running, so the write was not accepted.", code="writer_unavailable",
            how_to_proceed="Retry in a few seconds with the same Operation-Token; the operator must start "
                           "a writer ('toastmachine run writer').") from None
    message = reply.message
    if isinstance(message, WriteResult):
        headers = {REPLAYED_HEADER: "true"} if message.replayed else None
        return web.Response(body=message.body.encode(), status=message.status, headers=headers,
                            content_type="application/json")
    if isinstance(message, ErrorReply):
        raise ApiError(message.message, status=message.status, code=message.code,
                       how_to_proceed=message.how_to_proceed, extra=message.extra)
    raise ServiceUnavailable("The writer answered with something unexpected; the outcome is unknown.",
                             how_to_proceed="Retry the identical request with the same Operation-Token.")


async def create_conversation(request: web.Request) -> web.Response:
    """``POST /conversations``: a new conversation with its root message."""
    return await _write(request, corpus.OP_CREATE_CONVERSATION)


async def append_message(request: web.Request) -> web.Response:
    """``POST /conversations/{id}/messages``."""
    return await _write(request, corpus.OP_APPEND_MESSAGE, "conversation")


async def assert_relationship(request: web.Request) -> web.Response:
    """``POST /relationships``."""
    return await _write(request, corpus.OP_ASSERT_RELATIONSHIP)


async def retract_relationship(request: web.Request) -> web.Response:
    """``POST /relationships/{id}/retractions`` (an empty body is fine)."""
    return await _write(request, corpus.OP_RETRACT_RELATIONSHIP, "relationship", allow_empty=True)


def add_routes(app: web.Application) -> None:
    settings = app[NODE].settings
    app[WRITE_ADMISSION] = KeyedTokenBucket(rate=settings.writes_per_second, burst=2 * settings.writes_per_second)
    app.router.add_post("/conversations", create_conversation)
    app.router.add_post("/conversations/{id}/messages", append_message)
    app.router.add_post("/relationships", assert_relationship)
    app.router.add_post("/relationships/{id}/retractions", retract_relationship)
