"""The write-command submission shared by both fronts (the web front's ingress and the MCP tools).

:func:`submit_write` runs every step of a write after the front has authenticated the agent and read
its request, in this order, so that the cheapest refusal comes first:

1. onboarded: the agent has read the guide (428 ``onboarding_required``);
2. admission: the agent's token bucket in this process (429 with ``Retry-After``), a cheap local
   pre-filter that an identical replay does not use up (its token is given back, and a write whose
   operation token already has a record is let through to the writer, which replays it uncharged); the corpus-wide budget is the writer's (:mod:`actors.writer.store`), which answers
   429 ``rate_limited`` with ``retry_after`` in the envelope, sent on as ``Retry-After``;
3. validation with :mod:`protocol.corpus`, the functions the writer runs again (422 / 400);
4. a :class:`~protocol.commands.WriteCommand` on ``tm.commands`` with routing key
   ``<corpus_id>.<operation>``, this node's corpus headers and a deadline, sent with the other writes
   of the same event-loop turn as one batch message (routing key ``<corpus_id>.batch``, the bus's
   batch form, :mod:`infra.bus.batch`) answered by one reply; the writer's result is
   returned once its corpus headers are checked (a reply from a writer of another corpus or history
   is 503 ``lineage_unavailable``, never passed on); no reply by the deadline is 504 "outcome unknown".

Every refusal is a typed :class:`~protocol.errors.ApiError`; each front renders it its own way.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from infra.bus.base import COMMANDS_EXCHANGE, Bus
from infra.config import Settings
from infra.db import CorpusIdentity, Database
from infra.logs import get_logger
from infra.ratelimit import KeyedTokenBucket, retry_after_seconds
from protocol import corpus
from protocol.commands import WriteCommand, WriteResult
from protocol.errors import (
    ApiError,
    GatewayTimeout,
    LineageMismatch,
    PreconditionRequired,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
    Unroutable,
)
from protocol.events import HEADER_CORPUS_ID, HEADER_LINEAGE
from protocol.messages import ErrorReply

log = get_logger("toastmachine.actors.ingress")

#: The last word of the routing key of a batch of writes (``<corpus_id>.batch``).
WRITE_BATCH = "batch"

#: What a 428 tells a web client to do (the MCP front passes its own: read the guide resource).
HTTP_ONBOARDING_HINT = "GET /guide with your credential, then retry the identical request with the same Operation-Token."


class WriteNode(Protocol):
    """What a write needs of the process that sends it (a :class:`~toastmachine.node.Node` is one)."""

    settings: Settings
    bus: Bus
    db: Database
    identity: CorpusIdentity | None
    identity_error: LineageMismatch | None


class Author(Protocol):
    """The authenticated agent a write is made by."""

    @property
    def agent_id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def onboarded(self) -> bool: ...


async def submit_write(node: WriteNode, admission: KeyedTokenBucket, author: Author, operation: str,
                       target: str | None, body: Any, token: str, *,
                       onboarding_hint: str = HTTP_ONBOARDING_HINT) -> WriteResult:
    """Send one write (already parsed: ``target`` canonical, ``token`` validated) to the corpus writer
    and return its :class:`WriteResult` (committed or replayed), or raise the refusal as an ApiError."""
    if not author.onboarded:
        raise PreconditionRequired("Read the usage guide before your first write.", code="onboarding_required",
                                   how_to_proceed=onboarding_hint)
    wait = admission.take(author.agent_id)
    # An identical replay costs nothing (the writer answers it from the idempotency record, uncharged):
    # a write whose token already has a record goes on to the writer even when the bucket is empty.
    if wait > 0 and not await _recorded(node.db, author.agent_id, operation, token):
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
    command = WriteCommand(operation=operation, target=target, body=body, author_id=author.agent_id,
                           author_name=author.name, token=token)
    try:
        # Every write of this event-loop turn travels in one command message (the bus's batch form),
        # answered by one reply; each keeps its own deadline, answer and error.
        reply = await node.bus.request(COMMANDS_EXCHANGE, scope.command_key(operation), command,
                                       timeout=node.settings.command_timeout, headers=scope.headers(),
                                       batch_key=scope.command_key(WRITE_BATCH))
    except RequestTimeout:
        # The client gets 504 outcome_unknown; the operator gets a line (no writer answering, or a
        # stalled one, shows here rather than only in the clients' errors).
        log.warning("ingress.write_timeout", operation=operation, timeout=node.settings.command_timeout,
                    detail="no writer answered in time: outcome unknown to the client, who retries with its token")
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
            code="lineage_unavailable", outcome_unknown=True,
            how_to_proceed="Retry the identical request with the same Operation-Token later; the operator must "
                           "give every process of this node the same corpus identity.")
    if isinstance(message, WriteResult):
        if message.replayed and wait == 0:
            admission.give_back(author.agent_id)
        return message
    if isinstance(message, ErrorReply):
        raise ApiError(message.message, status=message.status, code=message.code,
                       how_to_proceed=message.how_to_proceed, extra=message.extra,
                       headers=_retry_after(message))
    raise ServiceUnavailable("The writer answered with something unexpected; the outcome is unknown.",
                             how_to_proceed="Retry the identical request with the same Operation-Token.",
                             outcome_unknown=True)


async def _recorded(db: Database, agent_id: str, operation: str, token: str) -> bool:
    """Whether this agent's ``operation`` with ``token`` has an idempotency record (one primary-key
    lookup, made only for a write the local bucket would refuse)."""
    found = await db.pool.fetchval("select exists (select 1 from operations where author_id = $1"
                                   " and operation = $2 and token = $3)", uuid.UUID(agent_id), operation, token)
    return bool(found)


def _names_a_corpus(headers: Mapping[str, object]) -> bool:
    return HEADER_CORPUS_ID in headers or HEADER_LINEAGE in headers


def _retry_after(reply: ErrorReply) -> dict[str, str] | None:
    """The ``Retry-After`` header of a writer's refusal (its envelope carries ``retry_after``)."""
    seconds = reply.extra.get("retry_after")
    if reply.status in (429, 503) and isinstance(seconds, int) and not isinstance(seconds, bool) and seconds > 0:
        return {"Retry-After": str(seconds)}
    return None
