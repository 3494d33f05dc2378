"""Corpus writer: the one place where commands become committed changes.

Consumes: the durable quorum queue ``tm.commands.writer``, bound to every routing key on the
``tm.commands`` exchange; writers on many machines are competing consumers of it.

Does, for each command:

* skips it when the requester's deadline has passed (its answer would go unread; the client
  retries with the same operation token if it still wants the effect);
* refuses it with 503 ``lineage_unavailable`` when the corpus identity check failed at start-up;
* :class:`~protocol.commands.WriteCommand`: validates the body again with the edge's validators
  (a command that fails them past the edge is dead-lettered with the reason and answered at once),
  then hands it to the group commit: commands that arrive while a transaction runs are applied
  together in the next one (:mod:`actors.writer.store`); a command that breaks a rule fails alone;
* :class:`~protocol.messages.Ping`: answers :class:`~protocol.messages.Pong` (doctor, readiness).

Emits: one reply per command to its requester, after the commit; the delivery is acked after the
reply. A writer killed between commit and ack loses nothing: the command is redelivered and its
idempotency record answers the stored result without writing anything new.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from actors.writer.store import CorpusStore, Outcome, Prepared
from infra.bus.base import COMMANDS_EXCHANGE, Bus, Delivery, QueueKind, QueueSpec
from infra.db import CorpusIdentity, Database
from infra.db.pool import UNAVAILABLE_ERRORS
from infra.logs import get_logger
from infra.ratelimit import Gcra
from infra.runtime import ConsumerActor
from protocol.commands import WriteCommand
from protocol.errors import ApiError, DatabaseUnavailable, InternalError, LineageMismatch, ServiceUnavailable
from protocol.messages import ErrorReply, Ping, Pong

WRITER_QUEUE = QueueSpec(name="tm.commands.writer", kind=QueueKind.WORK)

#: Most commands applied in one transaction.
DEFAULT_MAX_BATCH = 100
#: Transactions one writer process runs at once (phase 1 of one overlaps phase 2 of another).
DEFAULT_BATCH_WORKERS = 2

log = get_logger("toastmachine.actors.writer")


def error_reply(error: ApiError) -> ErrorReply:
    """The bus form of a public error."""
    return ErrorReply(status=error.status, code=error.code, message=error.message,
                      how_to_proceed=error.how_to_proceed, extra=dict(error.extra))


def _database_unavailable() -> ServiceUnavailable:
    # The commit may or may not have happened (a connection can drop during COMMIT), so the
    # guidance is the one that is right either way: retry with the same token.
    return ServiceUnavailable(
        "The database is unavailable; the write's outcome is unknown.", code="database_unavailable",
        how_to_proceed="Retry the identical request with the same Operation-Token in a few seconds; "
                       "it takes effect at most once.")


@dataclass(slots=True)
class _Job:
    prepared: Prepared
    done: asyncio.Future[tuple[Outcome, str | None]]  # outcome, dead-letter reason


class GroupCommit:
    """Collects prepared commands and applies them in batches, ``workers`` transactions at a time.

    By default there is no linger: a worker takes whatever is waiting the moment it is free, so a
    lone command is applied at once and a burst is applied in few transactions. With ``linger`` > 0
    a worker waits up to that many seconds for a batch to fill before committing it. The queue holds at most
    ``max_pending`` jobs; with ``max_pending`` = the consumer's prefetch, submit never waits (every job
    belongs to an unsettled delivery), and if it ever had to, it would wait rather than grow.
    """

    def __init__(self, store: CorpusStore, *, max_pending: int, max_batch: int = DEFAULT_MAX_BATCH,
                 linger: float = 0.0, workers: int = DEFAULT_BATCH_WORKERS) -> None:
        self.store = store
        self.max_batch = max_batch
        self.linger = linger
        # One worker at a time gathers a batch; the others apply theirs meanwhile. Batches thus
        # form one after the other instead of splitting a burst between idle workers.
        self._gathering = asyncio.Lock()
        self._queue: asyncio.Queue[_Job] = asyncio.Queue(maxsize=max_pending)
        self._workers = [asyncio.create_task(self._work(), name=f"writer-batch-{i}") for i in range(workers)]

    async def submit(self, prepared: Prepared) -> tuple[Outcome, str | None]:
        """Apply ``prepared`` (with others); return its outcome and a dead-letter reason if any."""
        job = _Job(prepared, asyncio.get_running_loop().create_future())
        await self._queue.put(job)
        return await job.done

    async def close(self) -> None:
        """Stop the workers; jobs still waiting are failed (their deliveries are requeued)."""
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.done.done():
                job.done.cancel()

    async def _work(self) -> None:
        while True:
            async with self._gathering:
                batch = [await self._queue.get()]
                if self.linger > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.linger):
                            while len(batch) < self.max_batch:
                                batch.append(await self._queue.get())
                while len(batch) < self.max_batch and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
            await self._apply(batch)

    async def _apply(self, batch: list[_Job]) -> None:
        try:
            outcomes = await self.store.apply([job.prepared for job in batch])
        except UNAVAILABLE_ERRORS as e:
            log.warning("writer.database_unavailable", error=repr(e), batch=len(batch))
            self._settle(batch, [(Outcome(error=_database_unavailable()), None)] * len(batch))
            return
        except Exception as e:
            if len(batch) > 1:
                # One command broke the transaction itself (e.g. a deadlock between two batches over
                # the same tokens): apply them one by one so the others still go through.
                log.warning("writer.batch_failed_retrying_singly", error=repr(e), batch=len(batch))
                for job in batch:
                    await self._apply([job])
                return
            if not await self._database_reachable():
                # Whatever the exception says, the database is gone: an outage, not a bad command.
                self._settle(batch, [(Outcome(error=_database_unavailable()), None)])
                return
            log.exception("writer.command_failed", operation=batch[0].prepared.command.operation)
            self._settle(batch, [(Outcome(error=InternalError()), f"the writer failed on it: {type(e).__name__}")])
            return
        self._settle(batch, [(o, None) for o in outcomes])

    async def _database_reachable(self) -> bool:
        try:
            await self.store.db.check()
        except DatabaseUnavailable:
            return False
        return True

    @staticmethod
    def _settle(batch: list[_Job], results: list[tuple[Outcome, str | None]]) -> None:
        for job, result in zip(batch, results, strict=True):
            if not job.done.done():
                job.done.set_result(result)


class CorpusWriter(ConsumerActor):
    """The corpus writer actor.

    Args:
        bus: the bus to consume from and reply on.
        node_id: this process's name, sent back in :class:`Pong`.
        db: the database; with ``identity``, needed for write commands.
        identity: the corpus identity stamped on events.
        identity_error: set when the corpus identity check failed at start-up; every command is
            then refused with 503 ``lineage_unavailable``.
        prefetch: unsettled commands at a time (bounds the group-commit queue too).
        max_batch: most commands in one transaction.
        linger: seconds to wait for a batch to fill (0: commit what is waiting at once).
        write_budget: each agent's corpus-wide write budget, enforced in every batch's transaction
            (:mod:`actors.writer.store`); None admits every command (the edge's limit alone).
    """

    name = "writer"
    queue = WRITER_QUEUE
    bindings = ((COMMANDS_EXCHANGE, "#"),)

    def __init__(self, bus: Bus, *, node_id: str, db: Database | None = None,
                 identity: CorpusIdentity | None = None, identity_error: LineageMismatch | None = None,
                 prefetch: int = 64, max_batch: int = DEFAULT_MAX_BATCH, linger: float = 0.0,
                 write_budget: Gcra | None = None) -> None:
        super().__init__(bus, prefetch=prefetch)
        self.node_id = node_id
        self.identity_error = identity_error
        self._store = (CorpusStore(db, identity, write_budget=write_budget)
                       if db is not None and identity is not None else None)
        self._max_batch = max_batch
        self._linger = linger
        self._commit: GroupCommit | None = None

    async def setup(self) -> None:
        if self._store is not None:
            self._commit = GroupCommit(self._store, max_pending=self.prefetch, max_batch=self._max_batch,
                                       linger=self._linger)
        await super().setup()

    async def close(self) -> None:
        if self._commit is not None:
            await self._commit.close()
            self._commit = None

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
        if isinstance(message, WriteCommand):
            await self._write(delivery, message)
            return
        if isinstance(message, Ping):
            await self.bus.reply(delivery, Pong(nonce=message.nonce, responder=self.node_id))
            return
        reason = f"the writer has no handler for command type {message.TYPE!r}"
        await self.bus.reply(delivery, ErrorReply(
            status=400, code="unknown_command", message=reason,
            how_to_proceed="Upgrade the node that sent it, or report it to the operator."))
        await delivery.dead_letter(reason)

    async def _write(self, delivery: Delivery, command: WriteCommand) -> None:
        if self._commit is None:
            raise RuntimeError("this writer has no database")  # requeued: another writer can take it
        try:
            prepared = Prepared.from_command(command, delivery.trace_id)
        except ApiError as e:
            # The ingress validates with the same functions, so this is an old or foreign sender.
            await self.bus.reply(delivery, error_reply(e))
            await delivery.dead_letter(f"failed validation past the edge: {e.code}: {e.message}")
            return
        outcome, dead_reason = await self._commit.submit(prepared)
        if outcome.result is not None:
            if outcome.result.replayed:
                self.log.info("writer.replayed", operation=command.operation, sequence=outcome.result.sequence)
            await self.bus.reply(delivery, outcome.result)
        else:
            assert outcome.error is not None
            await self.bus.reply(delivery, error_reply(outcome.error))
            if dead_reason is not None:
                await delivery.dead_letter(dead_reason)
