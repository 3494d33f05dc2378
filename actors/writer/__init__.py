"""Corpus writer: the one place where commands become committed changes.

Consumes: its corpus's durable quorum queue ``tm.commands.writer.<corpus_id>``, bound to
``<corpus_id>.#`` on the ``tm.commands`` exchange (:mod:`protocol.routing`); the writers of one
corpus, on many machines, are competing consumers of it, and the writers of another corpus sharing
the broker never see its commands. At start-up a writer removes the binding of the single-corpus
topology's queue ``tm.commands.writer`` (``#``), which would otherwise keep collecting a copy of
every command of every corpus (logged when it existed). A writer whose corpus identity check failed
at start-up consumes nothing: it could only refuse, and taking commands from a healthy writer of the
same corpus would turn them into refusals.

Does, for each command:

* skips it when the requester's deadline has passed (its answer would go unread; the client
  retries with the same operation token if it still wants the effect);
* refuses a foreign command (its ``x-corpus-id`` / ``x-corpus-lineage`` headers missing or naming
  another corpus or history) with 503 ``lineage_unavailable`` and dead-letters it with the reason:
  it must never be applied to this corpus;
* :class:`~protocol.commands.WriteCommand`: validates the body again with the edge's validators
  (a command that fails them past the edge is dead-lettered with the reason and answered at once),
  then hands it to the group commit: commands that arrive while a transaction runs are applied
  together in the next one (:mod:`actors.writer.store`); a command that breaks a rule fails alone;
* :class:`~protocol.messages.Ping`: answers :class:`~protocol.messages.Pong` (doctor, readiness).

Emits: one reply per command to its requester, after the commit, carrying this corpus's headers
(the requester checks them); the delivery is acked after the reply. A command it cannot apply is
never answered 500: a failure that is not the database's gets 503 ``write_not_applied`` (nothing was
committed) and the command is dead-lettered with the reason. A writer killed between commit and ack
loses nothing: the command is redelivered and its idempotency record answers the stored result
without writing anything new.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import asyncpg

from actors.writer.store import CorpusStore, Outcome, Prepared
from infra.bus.base import COMMANDS_EXCHANGE, Bus, Delivery, QueueKind, QueueSpec
from infra.db import CorpusIdentity, Database
from infra.db.pool import UNAVAILABLE_ERRORS
from infra.logs import current_trace_id, get_logger
from infra.ratelimit import Gcra
from infra.runtime import ConsumerActor
from protocol.commands import WriteCommand
from protocol.errors import ApiError, DatabaseUnavailable, LineageMismatch, ReadOnlyMirror, ServiceUnavailable
from protocol.messages import BusMessage, ErrorReply, Ping, Pong
from protocol.routing import LEGACY_WRITER_QUEUE, CorpusScope

#: Most commands applied in one transaction.
DEFAULT_MAX_BATCH = 100
#: Transactions one writer process runs at once (phase 1 of one overlaps phase 2 of another).
DEFAULT_BATCH_WORKERS = 2
#: Seconds a batch's transaction may take before it is abandoned and its commands are answered 503
#: ``database_unavailable`` (retry with the same token: its commit may or may not have happened).
#: A batch takes milliseconds; this bounds what a connection to PostgreSQL that stopped answering
#: without closing (a network partition, a host gone without a reset) would otherwise hold for
#: ever: the worker, and every command behind it. Its requesters gave up at COMMAND_TIMEOUT already.
BATCH_TIMEOUT = 30.0

log = get_logger("toastmachine.actors.writer")


def error_reply(error: ApiError) -> ErrorReply:
    """The bus form of a public error."""
    return ErrorReply(status=error.status, code=error.code, message=error.message,
                      how_to_proceed=error.how_to_proceed, extra=dict(error.extra))


def writer_queue(scope: CorpusScope) -> QueueSpec:
    """The durable queue the writers of ``scope``'s corpus share."""
    return QueueSpec(name=scope.writer_queue, kind=QueueKind.WORK)


def _foreign_command() -> ServiceUnavailable:
    # The requester's node and this writer disagree about which corpus (or history) they serve:
    # nothing was written, and only the operator can make them agree.
    return ServiceUnavailable(
        "The corpus writer that received this write serves another corpus or history; nothing was written.",
        code="lineage_unavailable",
        how_to_proceed="Retry later with the same Operation-Token; the operator must give the web and writer "
                       "processes the same TOASTMACHINE_CORPUS_ID / TOASTMACHINE_LINEAGE and database.")


def _not_applied() -> ServiceUnavailable:
    # Not a 500: the writer knows that nothing was committed (the transaction failed and rolled
    # back), and the command was set aside in tm.dead.letters for the operator.
    return ServiceUnavailable(
        "The corpus writer could not apply this write; nothing was committed.", code="write_not_applied",
        how_to_proceed="Retry later with the same Operation-Token; if it keeps failing, report the request "
                       "to the operator (the command is kept in the dead-letter queue).")


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
    ``max_pending`` jobs (the consumer's prefetch); a delivery can be a batch of up to 64 commands, so
    a submit may wait for room: the queue waits rather than grows, and the members held back are
    committed by the next transactions.
    """

    def __init__(self, store: CorpusStore, *, max_pending: int, max_batch: int = DEFAULT_MAX_BATCH,
                 linger: float = 0.0, workers: int = DEFAULT_BATCH_WORKERS,
                 timeout: float = BATCH_TIMEOUT) -> None:
        self.store = store
        self.max_batch = max_batch
        self.linger = linger
        self.timeout = timeout
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
            async with asyncio.timeout(self.timeout):
                outcomes = await self.store.apply([job.prepared for job in batch])
        except TimeoutError:
            log.error("writer.batch_timed_out", batch=len(batch), seconds=self.timeout,
                      detail="PostgreSQL did not answer; the connection is dropped and the commands told to retry")
            self._settle(batch, [(Outcome(error=_database_unavailable()), None)] * len(batch))
            return
        except UNAVAILABLE_ERRORS as e:
            log.warning("writer.database_unavailable", error=repr(e), batch=len(batch))
            self._settle(batch, [(Outcome(error=_database_unavailable()), None)] * len(batch))
            return
        except asyncpg.ReadOnlySQLTransactionError:
            # The database is a mirror's (migration 0011): nothing of this batch was committed, and
            # nothing ever will be here; each command is told so (not dead-lettered: it is not bad).
            log.error("writer.mirror_database", batch=len(batch),
                      detail="this writer's database is a read-only mirror; it accepts no writes")
            self._settle(batch, [(Outcome(error=ReadOnlyMirror()), None)] * len(batch))
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
            self._settle(batch, [(Outcome(error=_not_applied()), f"the writer failed on it: {type(e).__name__}")])
            return
        self._settle(batch, [(o, o.dead_reason) for o in outcomes])

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
        identity: the corpus identity of the database (stamped on events); it names the queue this
            writer consumes and is checked against every command's corpus headers. None when the
            corpus identity check failed at start-up: the writer then consumes nothing.
        db: the database, needed for write commands (without it only pings are answered).
        identity_error: why the identity check failed, logged at start-up.
        prefetch: unsettled commands at a time (bounds the group-commit queue too).
        max_batch: most commands in one transaction.
        linger: seconds to wait for a batch to fill (0: commit what is waiting at once).
        write_budget: each agent's corpus-wide write budget, enforced in every batch's transaction
            (:mod:`actors.writer.store`); None admits every command (the edge's limit alone).
        batch_timeout: seconds a batch's transaction may take (see :data:`BATCH_TIMEOUT`).
    """

    name = "writer"

    def __init__(self, bus: Bus, *, node_id: str, identity: CorpusIdentity | None, db: Database | None = None,
                 identity_error: LineageMismatch | None = None,
                 prefetch: int = 64, max_batch: int = DEFAULT_MAX_BATCH, linger: float = 0.0,
                 write_budget: Gcra | None = None, batch_timeout: float = BATCH_TIMEOUT) -> None:
        super().__init__(bus, prefetch=prefetch)
        self._batch_timeout = batch_timeout
        self.node_id = node_id
        self.identity_error = identity_error
        self.scope = identity.scope if identity is not None else None
        if self.scope is not None:
            self.queue = writer_queue(self.scope)
            self.bindings = ((COMMANDS_EXCHANGE, self.scope.command_pattern),)
        self._store = (CorpusStore(db, identity, write_budget=write_budget)
                       if db is not None and identity is not None else None)
        self._max_batch = max_batch
        self._linger = linger
        self._commit: GroupCommit | None = None

    async def setup(self) -> None:
        if self.scope is None:
            self.log.error("writer.identity_unavailable", consuming=False,
                           detail=str(self.identity_error or "no corpus identity"))
            return
        await self._unbind_legacy_queue()
        if self._store is not None:
            self._commit = GroupCommit(self._store, max_pending=self.prefetch, max_batch=self._max_batch,
                                       timeout=self._batch_timeout,
                                       linger=self._linger)
        await super().setup()

    async def _unbind_legacy_queue(self) -> None:
        """Cut the single-corpus topology's catch-all queue off ``tm.commands`` (an upgrade step).

        Left bound, it would silently collect a copy of every command of every corpus for ever (and
        an old writer still consuming it would apply other corpora's commands). Its contents are
        left alone for the operator: delete it once no old writer runs.
        """
        if await self.bus.unbind(LEGACY_WRITER_QUEUE, COMMANDS_EXCHANGE, "#"):
            self.log.warning("writer.legacy_binding_removed", queue=LEGACY_WRITER_QUEUE, exchange=COMMANDS_EXCHANGE,
                             detail="the queue of the single-corpus topology no longer receives commands; "
                                    "delete it once no writer of an older version runs")

    async def close(self) -> None:
        if self._commit is not None:
            await self._commit.close()
            self._commit = None

    async def _reply(self, delivery: Delivery, message: BusMessage) -> None:
        """Answer with this corpus's headers, so the requester can check whom it heard from."""
        await self.bus.reply(delivery, message, headers=self.scope.headers() if self.scope is not None else None)

    async def handle(self, delivery: Delivery) -> None:
        if delivery.expired():
            # The requester already answered 504 "outcome unknown"; doing the work now would only
            # surprise it. It retries with the same operation token if it still wants the effect.
            self.log.info("writer.skipped_expired", message_type=delivery.message.TYPE)
            return
        assert self.scope is not None  # a writer without an identity consumes nothing (setup)
        refusal = self.scope.refusal(delivery.headers)
        if refusal is not None:
            self.log.warning("writer.foreign_command", message_type=delivery.message.TYPE,
                             routing_key=delivery.routing_key[:200], reason=refusal)
            await self._reply(delivery, error_reply(_foreign_command()))
            await delivery.dead_letter(refusal)
            return
        message = delivery.message
        if isinstance(message, WriteCommand):
            await self._write(delivery, message)
            return
        if isinstance(message, Ping):
            await self._reply(delivery, Pong(nonce=message.nonce, responder=self.node_id))
            return
        reason = f"the writer has no handler for command type {message.TYPE!r}"
        await self._reply(delivery, ErrorReply(
            status=400, code="unknown_command", message=reason,
            how_to_proceed="Upgrade the node that sent it, or report it to the operator."))
        await delivery.dead_letter(reason)

    async def _write(self, delivery: Delivery, command: WriteCommand) -> None:
        if self._commit is None:
            raise RuntimeError("this writer has no database")  # requeued: another writer can take it
        try:
            # The trace id the delivery is handled under: the command's, or a fresh one when it
            # came without a valid one, so that every change (and its event) carries one.
            prepared = Prepared.from_command(command, current_trace_id())
        except ApiError as e:
            # The ingress validates with the same functions, so this is an old or foreign sender.
            await self._reply(delivery, error_reply(e))
            await delivery.dead_letter(f"failed validation past the edge: {e.code}: {e.message}")
            return
        outcome, dead_reason = await self._commit.submit(prepared)
        if outcome.result is not None:
            if outcome.result.replayed:
                self.log.info("writer.replayed", operation=command.operation, sequence=outcome.result.sequence)
            await self._reply(delivery, outcome.result)
        else:
            assert outcome.error is not None
            await self._reply(delivery, error_reply(outcome.error))
            if dead_reason is not None:
                await delivery.dead_letter(dead_reason)
