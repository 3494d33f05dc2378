"""Commands the ingress sends to the corpus writer, and the writer's answer.

A write travels as one :class:`WriteCommand` on ``tm.commands`` with routing key = its operation
(``conversation.create``, ``message.append``, ``relationship.assert``, ``relationship.retract``). It
carries the request body as the client sent it (already validated at the edge); the writer validates
it again with the same functions of :mod:`protocol.corpus` so that the rules live in one place.
The writer answers with :class:`WriteResult` (committed, or replayed from the idempotency record)
or :class:`~protocol.messages.ErrorReply`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from protocol.messages import BusMessage, register


@register
@dataclasses.dataclass(frozen=True, slots=True)
class WriteCommand(BusMessage):
    """One public write, on behalf of an authenticated agent.

    Attributes:
        operation: one of the ``OP_*`` names of :mod:`protocol.corpus`.
        target: the id from the path (conversation for appends, relationship for retractions).
        body: the decoded JSON body of the request.
        author_id / author_name: the authenticated agent (the ingress checked its credential).
        token: the ``Operation-Token`` header: the idempotency key, with author and operation.
    """

    TYPE: ClassVar[str] = "corpus.write"
    operation: str
    target: str | None
    body: Any
    author_id: str
    author_name: str
    token: str


@register
@dataclasses.dataclass(frozen=True, slots=True)
class WriteResult(BusMessage):
    """A committed write: the HTTP status and JSON body to answer with, byte for byte.

    ``replayed`` is true when the answer comes from the idempotency record of an earlier identical
    request (the ingress then adds ``Idempotent-Replayed: true``).
    """

    TYPE: ClassVar[str] = "corpus.written"
    status: int
    body: str
    sequence: int
    replayed: bool = False
