"""Corpus writer: the one place where commands become committed changes.

Consumes: the durable quorum queue ``tm.commands.writer``, bound to every routing key on the
``tm.commands`` exchange; writers on many machines are competing consumers of it.
Does: for each command, checks the requester's deadline (work nobody waits for is skipped) and the
corpus identity (a node whose lineage does not match its database refuses writes), then handles the
command. In this foundation the only command is :class:`~protocol.messages.Ping`, which proves the
path ingress → RabbitMQ → writer → direct reply-to works end to end; the corpus commands join it here.
Emits: one reply per command to the requester; decodable commands it does not understand are
answered with an error reply and dead-lettered with the reason, so the requester never waits for
its deadline and nothing is dropped silently.
"""

from __future__ import annotations

from infra.bus.base import COMMANDS_EXCHANGE, Bus, Delivery, QueueKind, QueueSpec
from infra.runtime import ConsumerActor
from protocol.errors import LineageMismatch
from protocol.messages import ErrorReply, Ping, Pong

WRITER_QUEUE = QueueSpec(name="tm.commands.writer", kind=QueueKind.WORK)


class CorpusWriter(ConsumerActor):
    """The corpus writer actor.

    Args:
        bus: the bus to consume from and reply on.
        node_id: this process's name, sent back in :class:`Pong`.
        identity_error: set when the corpus identity check failed at start-up; every command is
            then refused with 503 ``lineage_unavailable``.
        prefetch: unsettled commands at a time.
    """

    name = "writer"
    queue = WRITER_QUEUE
    bindings = ((COMMANDS_EXCHANGE, "#"),)

    def __init__(self, bus: Bus, *, node_id: str, identity_error: LineageMismatch | None = None,
                 prefetch: int = 64) -> None:
        super().__init__(bus, prefetch=prefetch)
        self.node_id = node_id
        self.identity_error = identity_error

    async def handle(self, delivery: Delivery) -> None:
        if delivery.expired():
            # The requester already answered 504 "outcome unknown"; doing the work now would only
            # surprise it. It retries with the same operation token if it still wants the effect.
            self.log.info("writer.skipped_expired", message_type=delivery.message.TYPE)
            return
        if self.identity_error is not None:
            await self.bus.reply(delivery, ErrorReply(
                status=503, code="lineage_unavailable",
                message="This node's corpus identity does not match its database; it accepts no writes.",
                how_to_proceed="Retry later or on another node; the operator must fix TOASTMACHINE_CORPUS_ID "
                               "/ TOASTMACHINE_LINEAGE."))
            return
        message = delivery.message
        if isinstance(message, Ping):
            await self.bus.reply(delivery, Pong(nonce=message.nonce, responder=self.node_id))
            return
        reason = f"the writer has no handler for command type {message.TYPE!r}"
        await self.bus.reply(delivery, ErrorReply(
            status=400, code="unknown_command", message=reason,
            how_to_proceed="Upgrade the node that sent it, or report it to the operator."))
        await delivery.dead_letter(reason)
