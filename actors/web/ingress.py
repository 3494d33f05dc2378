"""Ingress: the public write routes of the web front.

Each write goes the same way, in this order, so that the cheapest refusal comes first:

1. authenticate the credential (401 before anything else);
2. ``Content-Type: application/json`` (415), body at most 256 KiB (413), valid JSON (400);
3. ``Operation-Token`` present and well-formed (400);
4. onboarded: the agent has read ``GET /guide`` (428, retry the identical request with the same token);
5. admission: the agent's token bucket in this process (429 with ``Retry-After``), a cheap local
   pre-filter; the corpus-wide budget is the writer's (:mod:`actors.writer.store`), which answers
   429 ``rate_limited`` with ``retry_after`` in the envelope, sent on as ``Retry-After``;
6. validation with :mod:`protocol.corpus`, the functions the writer runs again (422 / 400);
7. a :class:`~protocol.commands.WriteCommand` on ``tm.commands`` with routing key
   ``<corpus_id>.<operation>``, this node's corpus headers and a deadline; the writer's reply becomes
   the answer, byte for byte, once its corpus headers are checked (a reply from a writer of another
   corpus or history is 503 ``lineage_unavailable``, never passed on); no reply by the deadline →
   504 "outcome unknown".
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from actors.web.auth import authenticate, require_onboarded
from actors.web.context import NODE
from infra.bus.base import COMMANDS_EXCHANGE
from infra.http import read_json
from infra.logs import get_logger
from infra.ratelimit import KeyedTokenBucket, local_bucket, retry_after_seconds, write_budget
from protocol import corpus
from protocol.agents import validate_operation_token
from protocol.commands import WriteCommand, WriteResult
from protocol.errors import (
    ApiError,
    GatewayTimeout,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
    Unroutable,
)
from protocol.events import HEADER_CORPUS_ID, HEADER_LINEAGE
from protocol.messages import ErrorReply
from protocol.query import path_uuid

OPERATION_TOKEN_HEADER = "Operation-Token"
REPLAYED_HEADER = "Idempotent-Replayed"

WRITE_ADMISSION: web.AppKey[KeyedTokenBucket] = web.AppKey("write_admission", KeyedTokenBucket)

log = get_logger("toastmachine.actors.ingress")


async def _write(request: web.Request, operation: str, target_kind: str | None = None, *,
                 allow_empty: bool = False) -> web.Response:
    """The write path shared by every write route; ``target_kind`` names the ``{id}`` in the path."""
    node = request.app[NODE]
    agent = await authenticate(request)
    # A malformed id is the 400 the read routes answer; a well-formed unknown one the writer's 404.
    target = path_uuid(request.match_info["id"]) if target_kind is not None else None
    body = await read_json(request, allow_empty=allow_empty)
    token = validate_operation_token(request.headers.get(OPERATION_TOKEN_HEADER))
    require_onboarded(agent)
    wait = request.app[WRITE_ADMISSION].take(agent.agent_id)
    if wait > 0:
        seconds = retry_after_seconds(wait)
        raise TooManyRequests(
            f"This agent may write {node.settings.writes_per_second:g} times a second on average.",
            headers={"Retry-After": str(seconds)}, extra={"retry_after": seconds},
            how_to_proceed="Wait for the seconds in Retry-After, then retry with the same Operation-Token.")
    corpus.validate_write(operation, target, body)
    if node.identity_error is not None or node.identity is None:
        raise ServiceUnavailable(
            "This node's corpus identity does not match its database; it accepts no writes.",
            code="lineage_unavailable",
            how_to_proceed="Retry later or on another node; the operator must fix the corpus identity.")
    scope = node.identity.scope
    command = WriteCommand(operation=operation, target=target, body=body, author_id=agent.agent_id,
                           author_name=agent.name, token=token)
    try:
        reply = await node.bus.request(COMMANDS_EXCHANGE, scope.command_key(operation), command,
                                       timeout=node.settings.command_timeout, headers=scope.headers())
    except RequestTimeout:
        raise GatewayTimeout() from None
    except Unroutable:
        raise ServiceUnavailable(
            "No corpus writer is running, so the write was not accepted.", code="writer_unavailable",
            how_to_proceed="Retry in a few seconds with the same Operation-Token; the operator must start "
                           "a writer ('toastmachine run writer').") from None
    message = reply.message
    refusal = scope.refusal(reply.headers)
    # A result claims a commit, so it must come from this corpus's writer. An error reply without
    # corpus headers comes from the bus layer itself (an undecodable command), which knows no
    # corpus and applied nothing: passed on as it is. One naming another corpus is refused.
    if refusal is not None and (isinstance(message, WriteResult) or _names_a_corpus(reply.headers)):
        log.error("ingress.foreign_reply", operation=operation, reason=refusal)
        raise ServiceUnavailable(
            "The write was answered by a corpus writer of another corpus or history; its outcome here is unknown.",
            code="lineage_unavailable",
            how_to_proceed="Retry the identical request with the same Operation-Token later; the operator must "
                           "give every process of this node the same corpus identity.")
    if isinstance(message, WriteResult):
        headers = {REPLAYED_HEADER: "true"} if message.replayed else None
        return web.Response(body=message.body.encode(), status=message.status, headers=headers,
                            content_type="application/json")
    if isinstance(message, ErrorReply):
        raise ApiError(message.message, status=message.status, code=message.code,
                       how_to_proceed=message.how_to_proceed, extra=message.extra,
                       headers=_retry_after(message))
    raise ServiceUnavailable("The writer answered with something unexpected; the outcome is unknown.",
                             how_to_proceed="Retry the identical request with the same Operation-Token.")


def _names_a_corpus(headers: Mapping[str, object]) -> bool:
    return HEADER_CORPUS_ID in headers or HEADER_LINEAGE in headers


def _retry_after(reply: ErrorReply) -> dict[str, str] | None:
    """The ``Retry-After`` header of a writer's refusal (its envelope carries ``retry_after``)."""
    seconds = reply.extra.get("retry_after")
    if reply.status in (429, 503) and isinstance(seconds, int) and not isinstance(seconds, bool) and seconds > 0:
        return {"Retry-After": str(seconds)}
    return None


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
    app[WRITE_ADMISSION] = local_bucket(write_budget(settings.writes_per_second))
    app.router.add_post("/conversations", create_conversation)
    app.router.add_post("/conversations/{id}/messages", append_message)
    app.router.add_post("/relationships", assert_relationship)
    app.router.add_post("/relationships/{id}/retractions", retract_relationship)
