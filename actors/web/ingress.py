"""Ingress: the public write routes of the web front.

Each write goes the same way, in this order, so that the cheapest refusal comes first:

1. authenticate the credential (401 before anything else);
2. ``Content-Type: application/json`` (415), body at most 256 KiB (413), valid JSON (400);
3. ``Operation-Token`` present and well-formed (400);
Steps 4-7 are :func:`actors.commands.submit_write`, which the MCP front's write tools call too:

4. onboarded: the agent has read ``GET /guide`` (428, retry the identical request with the same token);
5. admission: the agent's token bucket in this process (429 with ``Retry-After``), a cheap local
   pre-filter; the corpus-wide budget is the writer's (:mod:`actors.writer.store`), which answers
   429 ``rate_limited`` with ``retry_after`` in the envelope, sent on as ``Retry-After``;
6. validation with :mod:`protocol.corpus`, the functions the writer runs again (422 / 400);
7. a :class:`~protocol.commands.WriteCommand` on ``tm.commands`` with routing key
   ``<corpus_id>.<operation>``, this node's corpus headers and a deadline (the writes of one
   event-loop turn travel together as one batch message with one reply); the writer's reply becomes
   the answer, byte for byte, once its corpus headers are checked (a reply from a writer of another
   corpus or history is 503 ``lineage_unavailable``, never passed on); no reply by the deadline →
   504 "outcome unknown".
"""

from __future__ import annotations

from aiohttp import web

from actors.commands import submit_write
from actors.web.auth import authenticate
from actors.web.context import NODE
from infra.http import read_json, single_header
from infra.ratelimit import KeyedTokenBucket, local_bucket, write_budget
from protocol import corpus
from protocol.agents import validate_operation_token
from protocol.query import path_uuid

OPERATION_TOKEN_HEADER = "Operation-Token"
REPLAYED_HEADER = "Idempotent-Replayed"

WRITE_ADMISSION: web.AppKey[KeyedTokenBucket] = web.AppKey("write_admission", KeyedTokenBucket)


async def _write(request: web.Request, operation: str, target_kind: str | None = None, *,
                 allow_empty: bool = False) -> web.Response:
    """The write path shared by every write route; ``target_kind`` names the ``{id}`` in the path.
    Steps 1-3 here; the rest is :func:`actors.commands.submit_write`, whose result is the answer."""
    agent = await authenticate(request)
    # A malformed id is the 400 the read routes answer; a well-formed unknown one the writer's 404.
    target = path_uuid(request.match_info["id"]) if target_kind is not None else None
    body = await read_json(request, allow_empty=allow_empty)
    token = validate_operation_token(single_header(request, OPERATION_TOKEN_HEADER))
    result = await submit_write(request.app[NODE], request.app[WRITE_ADMISSION], agent, operation, target,
                                body, token)
    headers = {REPLAYED_HEADER: "true"} if result.replayed else None
    return web.Response(body=result.body.encode(), status=result.status, headers=headers,
                        content_type="application/json")


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
