"""The corpus writer's transaction: a batch of write commands in, one outcome per command out.

One PostgreSQL transaction per batch (group commit), in two phases:

1. Set-based: one statement reads what the rules of every command need (its idempotency record,
   the rows it refers to, the agents it mentions), one row per command; the rules run here in
   arrival order; then one statement claims the idempotency keys of every conversation and message
   that passed and inserts their rows, only for the keys it claimed (``insert … on conflict do
   nothing`` on the key: a concurrent claim of the same key waits on the row lock and then sees the
   outcome). What cannot be set-based keeps a statement per command: assertions and retractions
   (each races on a row of its own), a key repeated within the batch (read again after the first
   one's claim) and a claim lost to a concurrent transaction. No command can refer to a row created
   by another command of the same batch: the writer makes the ids, and a client learns them only
   after the commit. A command that breaks a rule fails alone before it has written anything, so no
   savepoint is needed; a command whose key was already used answers the stored result (or 409 on a
   different request) and writes nothing.
2. Sequence assignment, at the very end: take the transaction-scoped advisory lock
   :data:`SEQUENCE_LOCK`, draw one sequence per change, insert the change-history rows (each holding
   the complete event envelope) and fill in the idempotency records, then commit. Because every
   transaction draws its sequences under the same lock and holds it until its commit, sequences
   become visible in increasing order: a reader following ``after=<last seen>`` can never skip a
   change that commits later with a lower sequence (SPEC §4's commit-order hazard). The lock is held
   only for these few statements, and one acquisition covers a whole batch.

Admission (when the store has a write budget): before phase 1, one statement locks the
``write_budget`` rows of the batch's agents (in agent order, so two batches never deadlock on them)
and reads their theoretical arrival times with the database's clock. A command is admitted in
phase 1 right after its idempotency record was read (a replay is answered, never charged) and
charged at once when it passes its rules (given back if its claim is lost); over
budget, it is answered 429 ``rate_limited`` with ``retry_after`` and writes nothing, not even its
idempotency claim, so the client retries the identical request later with the same token. Phase 2's
statement advances each agent's budget by the changes the batch commits. The row lock makes every
writer process see one budget per agent: the limit holds however many web nodes and writers run.
The price: two batches with an agent in common run one after the other (the second waits for the
first's commit), where they used to overlap; batches of different agents still overlap.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from infra.db import CorpusIdentity, Database
from infra.db.pool import connection, transaction
from infra.logs import get_logger
from infra.ratelimit import Gcra, retry_after_seconds
from protocol import corpus
from protocol import representations as rep
from protocol.commands import WriteCommand, WriteResult
from protocol.errors import (
    ApiError,
    Conflict,
    Forbidden,
    NotFound,
    TooManyRequests,
    Unauthorized,
    Unprocessable,
)

log = get_logger("toastmachine.actors.writer.store")

#: Key of the advisory lock that serialises sequence assignment (any constant unique to us).
SEQUENCE_LOCK = 0x746D_5345_5100  # "tmSEQ"
#: Sequence used when sizing an event before its real sequence is known: no real one is longer.
_SIZING_SEQUENCE = 10**15


@dataclass(slots=True)
class Prepared:
    """A command that passed validation: what the store needs to apply it."""

    command: WriteCommand
    request: corpus.WriteRequest
    request_hash: bytes
    trace_id: str | None = None

    @classmethod
    def from_command(cls, command: WriteCommand, trace_id: str | None = None) -> Prepared:
        """Validate the command's body with the edge's validators (raises ApiError)."""
        request = corpus.validate_write(command.operation, command.target, command.body)
        digest = corpus.request_hash(command.operation, command.target, request.normalized())
        return cls(command=command, request=request, request_hash=digest, trace_id=trace_id)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.command.author_id, self.command.operation, self.command.token


@dataclass(slots=True)
class Outcome:
    """What one command came to: a result to answer with, or a public error."""

    result: WriteResult | None = None
    error: ApiError | None = None
    #: Why the command is also kept in the dead letters (a sender from outside the ingress); None: not.
    dead_reason: str | None = None


@dataclass(slots=True)
class _Change:
    """A change staged in phase 1, waiting for its sequence in phase 2."""

    index: int
    type: str
    partition: int
    conversation_id: str
    author_id: str
    occurred_at: datetime
    data: Callable[[int], dict[str, Any]]
    message_id: str | None = None
    relationship_id: str | None = None
    retraction_id: str | None = None


@dataclass(slots=True)
class _Pending:
    """A command that passed its rules in phase 1: what to write for it, and the change it makes.

    A conversation or a message is written by the batch's one set-based statement (``conversation``
    and ``message`` hold its rows); an assertion or a retraction by a statement of its own
    (``write``, answering (claimed, added); ``race``, the error when a concurrent writer committed the
    same thing after our read).
    """

    index: int
    prepared: Prepared
    change: _Change
    conversation: tuple[Any, ...] | None = None
    message: tuple[Any, ...] | None = None
    write: Callable[[Any], Awaitable[tuple[bool, bool]]] | None = None
    race: Callable[[Any], Awaitable[ApiError]] | None = None


@dataclass(slots=True)
class _Budget:
    """One agent's write budget while a batch holds its row: the stored state and what the batch took."""

    tat: float  # theoretical arrival time, epoch seconds (database clock)
    now: float  # the database's clock once the row was locked
    taken: int = 0  # changes of this batch charged to it


@dataclass(slots=True)
class _Batch:
    outcomes: list[Outcome | None]
    #: agent id → its budget, when the store enforces one
    budgets: dict[str, _Budget] = field(default_factory=dict)
    changes: list[_Change] = field(default_factory=list)
    #: key → index of the command of this batch that claimed it
    claimed: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: index → index of the earlier identical command in this batch whose answer it replays
    replays: dict[int, int] = field(default_factory=dict)


class CorpusStore:
    """Applies batches of prepared commands to the database.

    Args:
        db: the database.
        identity: the corpus identity stamped on every event envelope.
        write_budget: each agent's corpus-wide write budget (rate and burst); None admits every command.
    """

    def __init__(self, db: Database, identity: CorpusIdentity, *, write_budget: Gcra | None = None) -> None:
        self.db = db
        self.corpus_id = str(identity.corpus_id)
        self.lineage = str(identity.lineage)
        self.write_budget = write_budget

    async def apply(self, batch: Sequence[Prepared]) -> list[Outcome]:
        """Apply ``batch`` in one transaction; return one outcome per command, in order.

        Raises whatever the database raises when the transaction as a whole fails (nothing of the
        batch is then committed); rule violations of single commands are outcomes, not exceptions.
        """
        state = _Batch(outcomes=[None] * len(batch))
        async with connection(self.db) as conn, transaction(conn, _KEYED_PLANS):
            if self.write_budget is not None:
                await self._lock_budgets(conn, state, batch)
            fresh: list[int] = []
            again: list[int] = []
            keys: set[tuple[str, str, str]] = set()
            for index, prepared in enumerate(batch):
                (again if prepared.key in keys else fresh).append(index)
                keys.add(prepared.key)
            await self._phase1(conn, state, batch, fresh)
            for index in again:
                # A key used earlier in this batch (a client retrying before its answer came): read
                # after the first one's claim, so that it answers what the first one is answered.
                await self._phase1(conn, state, batch, [index])
            if state.changes:
                await self._commit_changes(conn, state, batch)
        for index, original in state.replays.items():
            first = state.outcomes[original]
            if first is not None and first.result is not None:
                state.outcomes[index] = Outcome(result=WriteResult(
                    status=first.result.status, body=first.result.body, sequence=first.result.sequence,
                    replayed=True))
            else:
                state.outcomes[index] = first
        return [o if o is not None else Outcome(error=ApiError("internal: no outcome")) for o in state.outcomes]

    # --- admission -----------------------------------------------------------------------------

    async def _lock_budgets(self, conn: Any, state: _Batch, batch: Sequence[Prepared]) -> None:
        """Lock the budget rows of the batch's agents (creating missing ones) and read them."""
        agents = sorted({uuid.UUID(p.command.author_id) for p in batch})
        rows = await conn.fetch(_LOCK_BUDGETS, agents)
        for row in rows:
            state.budgets[str(row["agent_id"])] = _Budget(tat=row["tat"], now=row["now"])
        if not rows:
            return  # no author of the batch is an agent: each command is refused in phase 1
        # Every row was locked before the last clock reading: decide on that one, the latest.
        now = max(row["now"] for row in rows)
        for budget in state.budgets.values():
            budget.now = now

    def _admit(self, state: _Batch, prepared: Prepared) -> None:
        """Refuse ``prepared`` with 429 when its agent's budget is spent (it then writes nothing)."""
        if self.write_budget is None:
            return
        budget = state.budgets[str(uuid.UUID(prepared.command.author_id))]
        wait = self.write_budget.wait(budget.tat, budget.now, budget.taken)
        if wait > 0:
            seconds = retry_after_seconds(wait)
            raise TooManyRequests(
                f"This agent may write {self.write_budget.rate:g} times a second on average "
                f"(bursts of {self.write_budget.burst:g}), on all nodes together.",
                extra={"retry_after": seconds},
                headers={"Retry-After": str(seconds)},
                how_to_proceed="Wait for the seconds in Retry-After, then retry the identical request with the "
                               "same Operation-Token; nothing was written.")

    def _budget_updates(self, state: _Batch) -> tuple[list[str], list[float]]:
        """(agent ids, new theoretical arrival times) for the agents this batch charged."""
        agents: list[str] = []
        tats: list[float] = []
        if self.write_budget is not None:
            for agent_id, budget in state.budgets.items():
                if budget.taken:
                    agents.append(agent_id)
                    tats.append(self.write_budget.advance(budget.tat, budget.now, budget.taken))
        return agents, tats

    # --- phase 1 -------------------------------------------------------------------------------

    async def _phase1(self, conn: Any, state: _Batch, batch: Sequence[Prepared], indexes: Sequence[int]) -> None:
        """Read, check, claim and insert the commands at ``indexes`` (their keys all differ).

        One statement reads what every command's rules need; the rules run here, in index order; one
        statement claims the keys of every conversation and message that passed and inserts their
        rows; assertions and retractions, rarer and each racing on a row of its own, are claimed and
        inserted by a statement each.
        """
        rows = await conn.fetch(_READ_BATCH, *_read_arguments(batch, indexes))
        pending: list[_Pending] = []
        for index, row in zip(indexes, rows, strict=True):
            prepared = batch[index]
            if not row["author_known"]:
                state.outcomes[index] = Outcome(error=_unknown_author(prepared),
                                                dead_reason="unknown author: no agent of this corpus has its id")
                continue
            try:
                if self._replayed(state, index, prepared, row):
                    continue
                self._admit(state, prepared)
                pending.append(self._plan(index, prepared, row))
            except ApiError as e:
                state.outcomes[index] = Outcome(error=e)
                continue
            # Charged now, so that the budget of a later command of the batch counts this one.
            self._charge(state, prepared, 1)
        won = await self._insert_rows(conn, [p for p in pending if p.message is not None])
        for item in pending:
            try:
                if item.write is None:
                    claimed, added = item.index in won, True
                else:
                    claimed, added = await item.write(conn)
                if not claimed:
                    # The key was claimed by a transaction that committed after our read.
                    self._charge(state, item.prepared, -1)
                    await self._lost_claim(conn, state, item.index, item.prepared)
                    continue
                if not added:
                    # Another writer committed the same assertion or retraction after our read.
                    self._charge(state, item.prepared, -1)
                    await self._release_claim(conn, item.prepared)
                    assert item.race is not None
                    raise await item.race(conn)
            except ApiError as e:
                state.outcomes[item.index] = Outcome(error=e)
                continue
            state.claimed[item.prepared.key] = item.index
            state.changes.append(item.change)

    def _plan(self, index: int, prepared: Prepared, row: Any) -> _Pending:
        """Check ``prepared``'s rules against what was read for it; what to write (raises ApiError)."""
        request = prepared.request
        if isinstance(request, corpus.NewConversation):
            return self._create_conversation(index, prepared, request, row)
        if isinstance(request, corpus.NewMessage):
            return self._append_message(index, prepared, request, row)
        if isinstance(request, corpus.NewRelationship):
            return self._assert_relationship(index, prepared, request, row)
        return self._retract_relationship(index, prepared, request, row)

    @staticmethod
    def _charge(state: _Batch, prepared: Prepared, changes: int) -> None:
        budget = state.budgets.get(str(uuid.UUID(prepared.command.author_id))) if state.budgets else None
        if budget is not None:
            budget.taken += changes

    async def _insert_rows(self, conn: Any, pending: Sequence[_Pending]) -> set[int]:
        """Claim the keys of ``pending`` (conversations and messages) and insert the rows of those
        whose claim succeeded, in one statement; return the indexes whose claim succeeded."""
        if not pending:
            return set()
        claims: list[list[Any]] = [[] for _ in range(5)]
        conversations: list[list[Any]] = [[] for _ in range(7)]
        messages: list[list[Any]] = [[] for _ in range(13)]
        for item in pending:
            assert item.message is not None
            for column, value in zip(claims, (*item.prepared.key, item.prepared.request_hash, item.index),
                                     strict=True):
                column.append(value)
            if item.conversation is not None:
                for column, value in zip(conversations, (item.index, *item.conversation), strict=True):
                    column.append(value)
            for column, value in zip(messages, (item.index, *item.message), strict=True):
                column.append(value)
        won = await conn.fetchval(_INSERT_ROWS, *claims, *conversations, *messages)
        return set(won or ())

    def _replayed(self, state: _Batch, index: int, prepared: Prepared, row: Any) -> bool:
        """Answer from the idempotency record in ``row`` if there is one; True when answered."""
        if row["request_hash"] is None:
            return False
        if bytes(row["request_hash"]) != prepared.request_hash:
            raise Conflict(
                "This Operation-Token was already used for a different request.",
                code="operation_token_conflict",
                how_to_proceed="Use a new Operation-Token for a new write; reuse a token only to retry "
                               "the identical request.")
        if row["status"] is None:
            # Claimed earlier in this very batch: answer what that command is answered.
            state.replays[index] = state.claimed[prepared.key]
        else:
            state.outcomes[index] = Outcome(result=WriteResult(
                status=row["status"], body=row["response"], sequence=row["sequence"], replayed=True))
        return True

    async def _lost_claim(self, conn: Any, state: _Batch, index: int, prepared: Prepared) -> None:
        """The key was claimed by a transaction that committed after our read: answer its outcome."""
        row = await conn.fetchrow(_READ_OPERATION, *prepared.key)
        if not self._replayed(state, index, prepared, row):  # pragma: no cover - the claim exists
            raise ApiError("internal: idempotency record vanished")

    async def _release_claim(self, conn: Any, prepared: Prepared) -> None:
        """Undo our claim when a race lost after it (the claim is mutable tracking data)."""
        await conn.execute("delete from operations where author_id = $1 and operation = $2 and token = $3",
                           *prepared.key)

    @staticmethod
    def _mentions(names: Sequence[str], found: Any) -> list[tuple[str, str]]:
        by_key = {r[1].lower(): (str(r[0]), r[1]) for r in found or ()}
        # Unknown names are dropped (SPEC §2); order follows the content.
        return [by_key[n.lower()] for n in names if n.lower() in by_key]

    def _message_data(self, message_id: str, conversation_id: str, prepared: Prepared,
                      draft: corpus.MessageDraft, created_at: datetime,
                      mentions: list[tuple[str, str]]) -> Callable[[int], dict[str, Any]]:
        command = prepared.command

        def build(sequence: int) -> dict[str, Any]:
            return rep.message(
                id=message_id, conversation_id=conversation_id, author_id=command.author_id,
                author_name=command.author_name, sequence=sequence, created_at=created_at,
                kinds=draft.kinds, content=draft.content, payload_json=draft.payload_json,
                schema_name=draft.schema_name, schema_version=draft.schema_version, reply_to=draft.reply_to,
                tags=draft.tags, mentions=mentions)

        return build

    @staticmethod
    def _message_values(message_id: str, conversation_id: str, author_id: str, draft: corpus.MessageDraft,
                        created_at: datetime, mentions: list[tuple[str, str]]) -> tuple[Any, ...]:
        """A ``messages`` row as :data:`_INSERT_ROWS` takes it (array columns as JSON text)."""
        return (message_id, conversation_id, author_id, _json_list(draft.kinds), draft.content,
                draft.payload_json, draft.schema_name, draft.schema_version, draft.reply_to,
                _json_list(draft.tags), _json_list([agent_id for agent_id, _ in mentions]), created_at)

    def _create_conversation(self, index: int, prepared: Prepared, request: corpus.NewConversation,
                             row: Any) -> _Pending:
        author_id = prepared.command.author_id
        conversation_id, message_id = str(uuid.uuid4()), str(uuid.uuid4())
        partition = corpus.partition_of(conversation_id)
        created_at = rep.now_ms()
        mentions = self._mentions(request.message.mention_names, row["mentions"])
        message_data = self._message_data(message_id, conversation_id, prepared, request.message, created_at,
                                          mentions)

        def data(sequence: int) -> dict[str, Any]:
            return {
                "conversation": rep.conversation(
                    id=conversation_id, subject=request.subject, author_id=author_id,
                    author_name=prepared.command.author_name, root_message_id=message_id,
                    created_sequence=sequence, created_at=created_at, message_count=1, last_sequence=sequence),
                "message": message_data(sequence),
            }

        change = self._check_size(_Change(
            index=index, type=rep.CONVERSATION_CREATED, partition=partition, conversation_id=conversation_id,
            author_id=author_id, occurred_at=created_at, data=data, message_id=message_id))
        return _Pending(
            index=index, prepared=prepared, change=change,
            conversation=(conversation_id, request.subject, author_id, message_id, partition, created_at),
            message=self._message_values(message_id, conversation_id, author_id, request.message, created_at,
                                         mentions))

    def _append_message(self, index: int, prepared: Prepared, request: corpus.NewMessage, row: Any) -> _Pending:
        draft = request.message
        if row["partition"] is None:
            raise NotFound(f"There is no conversation {request.conversation_id}.", code="conversation_not_found",
                           how_to_proceed="Check the conversation id (GET /conversations lists them).")
        if draft.reply_to is not None:
            if row["parent_conversation"] is None:
                raise Unprocessable(f"'reply_to' names no message ({draft.reply_to}).", code="reply_to_not_found",
                                    extra={"field": "reply_to"},
                                    how_to_proceed="Reply to a message of this conversation, or omit reply_to.")
            if str(row["parent_conversation"]) != request.conversation_id:
                raise Unprocessable("'reply_to' must be a message of the same conversation.",
                                    code="reply_to_other_conversation", extra={"field": "reply_to"},
                                    how_to_proceed="Reply to a message of this conversation; relate messages "
                                                   "across conversations with POST /relationships.")
        author_id = prepared.command.author_id
        message_id = str(uuid.uuid4())
        created_at = rep.now_ms()
        mentions = self._mentions(draft.mention_names, row["mentions"])
        message_data = self._message_data(message_id, request.conversation_id, prepared, draft, created_at,
                                          mentions)
        change = self._check_size(_Change(
            index=index, type=rep.MESSAGE_APPENDED, partition=row["partition"],
            conversation_id=request.conversation_id, author_id=author_id, occurred_at=created_at,
            data=lambda sequence: {"message": message_data(sequence)}, message_id=message_id))
        return _Pending(index=index, prepared=prepared, change=change, message=self._message_values(
            message_id, request.conversation_id, author_id, draft, created_at, mentions))

    def _assert_relationship(self, index: int, prepared: Prepared, request: corpus.NewRelationship,
                             row: Any) -> _Pending:
        author_id = prepared.command.author_id
        found = {str(m[0]): m for m in row["messages"] or ()}
        for field_name, message_id in (("source_message_id", request.source_message_id),
                                       ("target_message_id", request.target_message_id)):
            if message_id not in found:
                raise NotFound(f"'{field_name}' names no message ({message_id}).", code="message_not_found",
                               extra={"field": field_name},
                               how_to_proceed="Check the message id (GET /messages lists them).")
        _, _, source_kinds, source_conversation, partition = found[request.source_message_id]
        target_author, target_kinds = str(found[request.target_message_id][1]), found[request.target_message_id][2]
        if request.type == "retracts" and target_author != author_id:
            raise Forbidden("Only the target message's author may assert 'retracts'.", code="not_target_author",
                            how_to_proceed="Retract only your own messages; to disagree, assert 'contradicts'.")
        if request.type == "supports" and "verification" in source_kinds:
            if "claim" not in target_kinds:
                raise Unprocessable("A 'supports' from a verification must target a message marked claim.",
                                    code="verification_needs_claim", extra={"field": "target_message_id"},
                                    how_to_proceed="Target the claim being verified.")
            if target_author == author_id:
                raise Forbidden("An agent cannot verify its own claim.", code="self_verification",
                                how_to_proceed="Ask another agent to verify the claim.")
        if row["existing"] is not None:
            raise _duplicate(str(row["existing"]))
        relationship_id = str(uuid.uuid4())
        created_at = rep.now_ms()
        name = prepared.command.author_name

        def data(sequence: int) -> dict[str, Any]:
            return {"relationship": rep.relationship(
                id=relationship_id, type=request.type, source_message_id=request.source_message_id,
                target_message_id=request.target_message_id, author_id=author_id, author_name=name,
                sequence=sequence, created_at=created_at)}

        change = self._check_size(_Change(
            index=index, type=rep.RELATIONSHIP_ASSERTED, partition=partition,
            conversation_id=str(source_conversation), author_id=author_id, occurred_at=created_at,
            data=data, relationship_id=relationship_id))

        async def write(conn: Any) -> tuple[bool, bool]:
            result = await conn.fetchrow(
                _CLAIM + ", active as (insert into active_relationships (source_message_id, target_message_id, "
                "type, author_id, relationship_id) select $5, $6, $7, $1, $8 from claim on conflict do nothing "
                "returning 1), relationship as (insert into relationships (id, type, source_message_id, "
                "target_message_id, author_id, partition, created_at) select $8, $7, $5, $6, $1, $9, $10 "
                "from active) select exists (select 1 from claim) as claimed, "
                "exists (select 1 from active) as added",
                *prepared.key, prepared.request_hash, request.source_message_id, request.target_message_id,
                request.type, relationship_id, partition, created_at)
            return result["claimed"], result["added"]

        async def race(conn: Any) -> ApiError:
            existing = await conn.fetchval(
                "select relationship_id from active_relationships where source_message_id = $1 "
                "and target_message_id = $2 and type = $3 and author_id = $4",
                request.source_message_id, request.target_message_id, request.type, author_id)
            return _duplicate(str(existing))

        return _Pending(index=index, prepared=prepared, change=change, write=write, race=race)

    def _retract_relationship(self, index: int, prepared: Prepared, request: corpus.NewRetraction,
                              row: Any) -> _Pending:
        author_id = prepared.command.author_id
        if row["asserted_by"] is None:
            raise NotFound(f"There is no relationship {request.relationship_id}.", code="relationship_not_found",
                           how_to_proceed="Check the relationship id (GET /relationships lists them).")
        if str(row["asserted_by"]) != author_id:
            raise Forbidden("Only the agent that asserted a relationship may retract it.",
                            code="not_assertion_author",
                            how_to_proceed="Assert 'contradicts' instead if you disagree with it.")
        if row["retracted"]:
            raise _already_retracted()
        retraction_id = str(uuid.uuid4())
        created_at = rep.now_ms()

        def data(sequence: int) -> dict[str, Any]:
            return {"retraction": rep.retraction(id=retraction_id, relationship_id=request.relationship_id,
                                                 sequence=sequence, created_at=created_at)}

        change = self._check_size(_Change(
            index=index, type=rep.RELATIONSHIP_RETRACTED, partition=row["relationship_partition"],
            conversation_id=str(row["relationship_conversation"]), author_id=author_id, occurred_at=created_at,
            data=data, retraction_id=retraction_id))

        async def write(conn: Any) -> tuple[bool, bool]:
            result = await conn.fetchrow(
                _CLAIM + ", retraction as (insert into retractions (id, relationship_id, author_id, created_at) "
                "select $5, $6, $1, $7 from claim on conflict (relationship_id) do nothing returning 1), "
                "inactive as (delete from active_relationships where relationship_id = $6 "
                "and exists (select 1 from retraction)) "
                "select exists (select 1 from claim) as claimed, exists (select 1 from retraction) as added",
                *prepared.key, prepared.request_hash, retraction_id, request.relationship_id, created_at)
            return result["claimed"], result["added"]

        async def race(conn: Any) -> ApiError:  # a concurrent retraction committed first
            return _already_retracted()

        return _Pending(index=index, prepared=prepared, change=change, write=write, race=race)

    def _check_size(self, change: _Change) -> _Change:
        size = len(self._event(change, _SIZING_SEQUENCE))
        if size > corpus.MAX_EVENT_BYTES:
            raise Unprocessable(
                f"The stored event would be {size} bytes; the limit is {corpus.MAX_EVENT_BYTES}.",
                code="event_too_large", extra={"field": "content"},
                how_to_proceed="Send less content or a smaller payload.")
        return change

    def _event(self, change: _Change, sequence: int) -> bytes:
        return rep.dumps(rep.envelope(
            sequence=sequence, type=change.type, partition=change.partition, corpus_id=self.corpus_id,
            lineage=self.lineage, occurred_at=change.occurred_at, data=change.data(sequence)))

    # --- phase 2 -------------------------------------------------------------------------------

    async def _commit_changes(self, conn: Any, state: _Batch, batch: Sequence[Prepared]) -> None:
        # The lock is taken before the first nextval of this transaction and held until its commit.
        sequences = sorted(await conn.fetchval(
            "with locked as (select pg_advisory_xact_lock($2)) "
            "select array_agg(nextval('change_sequence')) from locked, generate_series(1, $1)",
            len(state.changes), SEQUENCE_LOCK))
        columns: list[list[Any]] = [[] for _ in range(11)]
        keys: list[list[Any]] = [[] for _ in range(5)]
        for change, sequence in zip(state.changes, sequences, strict=True):
            prepared = batch[change.index]
            data = change.data(sequence)
            event = rep.dumps(rep.envelope(
                sequence=sequence, type=change.type, partition=change.partition, corpus_id=self.corpus_id,
                lineage=self.lineage, occurred_at=change.occurred_at, data=data))
            body = rep.dumps({**data, "sequence": sequence}).decode()
            for column, value in zip(columns, (
                    sequence, change.type, change.partition, change.conversation_id, change.author_id,
                    change.message_id, change.relationship_id, change.retraction_id, change.occurred_at,
                    event.decode(), prepared.trace_id), strict=True):
                column.append(value)
            for column, value in zip(keys, (*prepared.key, body, sequence), strict=True):
                column.append(value)
            state.outcomes[change.index] = Outcome(result=WriteResult(status=201, body=body, sequence=sequence))
        # One statement for all the batch's changes, idempotency answers and budget charges.
        await conn.execute(
            "with inserted as (insert into changes (sequence, type, partition, conversation_id, author_id, "
            "message_id, relationship_id, retraction_id, occurred_at, event, trace_id) "
            "select * from unnest($1::bigint[], $2::text[], $3::smallint[], $4::uuid[], $5::uuid[], $6::uuid[], "
            "$7::uuid[], $8::uuid[], $9::timestamptz[], $10::text[], $11::text[])), "
            "charged as (update write_budget b set tat = to_timestamp(c.tat) "
            "from unnest($17::uuid[], $18::float8[]) as c(agent_id, tat) where b.agent_id = c.agent_id) "
            "update operations o set status = 201, response = u.response, sequence = u.sequence "
            "from unnest($12::uuid[], $13::text[], $14::text[], $15::text[], $16::bigint[]) "
            "as u(author_id, operation, token, response, sequence) "
            "where o.author_id = u.author_id and o.operation = u.operation and o.token = u.token",
            *columns, *keys, *self._budget_updates(state))


#: Locks (creating where missing) the write_budget rows of the agents in $1, sorted by id so that
#: two batches take them in the same order, and reads each with the database clock after its lock.
#: The no-op update is what takes the row lock and returns the latest committed state.
#: Set at the start of every batch's transaction (and undone at its end): a batch touches at most a
#: few hundred rows, each found by a key, so every join of its statements (and of the read-model
#: trigger they fire) must be an index probe. The planner's choice between that and a hash or merge
#: join over a whole table rests on statistics, which lag behind a young or fast-growing corpus;
#: the prepared statements then keep a plan that reads all of ``operations`` per batch (seen on a
#: fresh database: the batch's last update was a hash join over every operation record). Only
#: these two methods are switched off; sequential scans stay possible where nothing else exists
#: (the trigger's transition table).
_KEYED_PLANS = "set local enable_hashjoin = off; set local enable_mergejoin = off"
_LOCK_BUDGETS = ("insert into write_budget as b (agent_id) select a.agent_id from agents a "
                 "where a.agent_id = any($1::uuid[]) order by a.agent_id "
                 "on conflict (agent_id) do update set tat = b.tat "
                 "returning agent_id, extract(epoch from tat)::float8 as tat, "
                 "extract(epoch from clock_timestamp())::float8 as now")
#: Reads one command's idempotency record (a row of nulls when there is none).
_READ_OPERATION = ("select o.request_hash, o.status, o.response, o.sequence from (values (1)) one "
                   "left join operations o on o.author_id = $1 and o.operation = $2 and o.token = $3")
#: Reads what the rules of every command of a batch need, one row per command in order: its
#: idempotency record; the agents its message mentions ($10/$11: the command's position and a
#: lowercased name, one pair per name); the partition of the conversation it appends to; the
#: conversation of the message it replies to; the two messages an assertion relates and the active
#: assertion it would duplicate; the relationship a retraction retracts. The columns a command's
#: kind does not use are null.
#:
#: Every look-up is written as a per-command probe (a correlated subquery or a LATERAL join on a
#: key) rather than a join the planner may turn into a hash join: on a young corpus, or before
#: ANALYZE caught up with a growing one, the statistics say the tables are tiny, and a hash join
#: would read the whole of ``operations``, ``relationships`` or ``retractions`` for every batch (the
#: prepared statement keeps that plan). A probe on a key is an index look-up whatever the statistics
#: say, so a batch costs the same on a corpus of any size and age. Look-ups a command's kind does
#: not need are skipped by a one-time filter on the null key.
_READ_BATCH = (
    "select o.request_hash, o.status, o.response, o.sequence, "
    "exists (select 1 from agents x where x.agent_id = c.author_id) as author_known, "
    "(select array_agg(row(a.agent_id, a.name)) from agents a where lower(a.name) = any("
    "  select x.name from unnest($10::bigint[], $11::text[]) as x(ord, name) where x.ord = c.ord)) as mentions, "
    "(select v.partition from conversations v where v.id = c.conversation_id) as partition, "
    "(select p.conversation_id from messages p where p.id = c.reply_to) as parent_conversation, "
    "(select array_agg(row(m.id, m.author_id, m.kinds, m.conversation_id, k.partition)) "
    "  from (select c.source_id union all select c.target_id) as w(id) "
    "  join messages m on m.id = w.id join conversations k on k.id = m.conversation_id "
    "  where c.source_id is not null) as messages, "
    "(select e.relationship_id from active_relationships e where e.source_message_id = c.source_id "
    "  and e.target_message_id = c.target_id and e.type = c.type and e.author_id = c.author_id) as existing, "
    "r.author_id as asserted_by, r.partition as relationship_partition, "
    "(select s.conversation_id from messages s where s.id = r.source_message_id) as relationship_conversation, "
    "(select true from retractions t where t.relationship_id = r.id limit 1) is not null as retracted "
    "from unnest($1::uuid[], $2::text[], $3::text[], $4::uuid[], $5::uuid[], $6::uuid[], $7::uuid[], $8::text[], "
    "  $9::uuid[]) with ordinality as c(author_id, operation, token, conversation_id, reply_to, source_id, "
    "  target_id, type, relationship_id, ord) "
    "left join lateral (select o.request_hash, o.status, o.response, o.sequence from operations o "
    "  where o.author_id = c.author_id and o.operation = c.operation and o.token = c.token) o on true "
    "left join lateral (select r.id, r.author_id, r.partition, r.source_message_id from relationships r "
    "  where r.id = c.relationship_id and c.relationship_id is not null) r on true "
    "order by c.ord")
#: Claims the idempotency keys ($1-$4, each command's index $5) in key order (so that two batches
#: claiming common keys wait on each other instead of deadlocking), then inserts the conversations
#: ($6-$12) and messages ($13-$25) of the commands whose claim succeeded, keyed by index; returns
#: those indexes. A key claimed meanwhile by a transaction that committed is skipped (``on conflict
#: do nothing``), and so are its rows. Array columns come as JSON text (arrays of arrays cannot be
#: ragged; text, since asyncpg would take a list of lists for a 2-D array); ``with ordinality`` keeps
#: their order.
_INSERT_ROWS = (
    "with c as (select * from unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::int[]) "
    "  as c(author_id, operation, token, request_hash, index)), "
    "claim as (insert into operations (author_id, operation, token, request_hash) "
    "  select author_id, operation, token, request_hash from c order by author_id, operation, token "
    "  on conflict do nothing returning author_id, operation, token), "
    "won as (select c.index from c join claim using (author_id, operation, token)), "
    "conversation as (insert into conversations (id, subject, author_id, root_message_id, partition, created_at) "
    "  select v.id, v.subject, v.author_id, v.root_message_id, v.partition, v.created_at "
    "  from unnest($6::int[], $7::uuid[], $8::text[], $9::uuid[], $10::uuid[], $11::smallint[], "
    "  $12::timestamptz[]) as v(index, id, subject, author_id, root_message_id, partition, created_at) "
    "  join won using (index)), "
    "message as (insert into messages (id, conversation_id, author_id, kinds, content, payload, schema_name, "
    "  schema_version, reply_to, tags, mention_ids, created_at) "
    "  select m.id, m.conversation_id, m.author_id, "
    "  array(select e from jsonb_array_elements_text(m.kinds::jsonb) with ordinality as j(e, n) order by n), "
    "  m.content, m.payload, m.schema_name, m.schema_version, m.reply_to, "
    "  array(select e from jsonb_array_elements_text(m.tags::jsonb) with ordinality as j(e, n) order by n), "
    "  array(select e::uuid from jsonb_array_elements_text(m.mention_ids::jsonb) with ordinality as j(e, n) "
    "  order by n), m.created_at "
    "  from unnest($13::int[], $14::uuid[], $15::uuid[], $16::uuid[], $17::text[], $18::text[], $19::text[], "
    "  $20::text[], $21::int[], $22::uuid[], $23::text[], $24::text[], $25::timestamptz[]) "
    "  as m(index, id, conversation_id, author_id, kinds, content, payload, schema_name, schema_version, "
    "  reply_to, tags, mention_ids, created_at) join won using (index)) "
    "select array_agg(index) from won")
#: Claims one idempotency key ($1-$3, hash $4); the statement's other parts insert ``from claim``,
#: so they write nothing when the key was taken meanwhile.
_CLAIM = ("with claim as (insert into operations (author_id, operation, token, request_hash) "
          "values ($1, $2, $3, $4) on conflict do nothing returning 1)")


def _json_list(values: Sequence[str]) -> str:
    return orjson.dumps(list(values)).decode()


def _read_arguments(batch: Sequence[Prepared], indexes: Sequence[int]) -> list[list[Any]]:
    """The arrays :data:`_READ_BATCH` takes for the commands of ``batch`` at ``indexes``."""
    columns: list[list[Any]] = [[] for _ in range(9)]
    mention_at: list[int] = []
    mention_names: list[str] = []
    for position, index in enumerate(indexes, start=1):
        prepared = batch[index]
        request = prepared.request
        conversation_id = reply_to = source_id = target_id = type_ = relationship_id = None
        names: Sequence[str] = ()
        if isinstance(request, corpus.NewConversation):
            names = request.message.mention_names
        elif isinstance(request, corpus.NewMessage):
            conversation_id, reply_to = request.conversation_id, request.message.reply_to
            names = request.message.mention_names
        elif isinstance(request, corpus.NewRelationship):
            source_id, target_id, type_ = request.source_message_id, request.target_message_id, request.type
        else:
            relationship_id = request.relationship_id
        for column, value in zip(columns, (*prepared.key, conversation_id, reply_to, source_id, target_id, type_,
                                           relationship_id), strict=True):
            column.append(value)
        for name in names:
            mention_at.append(position)
            mention_names.append(name.lower())
    return [*columns, mention_at, mention_names]


def _duplicate(existing: str) -> Conflict:
    return Conflict("You already assert this relationship.", code="duplicate_relationship",
                    extra={"existing_relationship_id": existing},
                    how_to_proceed="Nothing to do; retract the existing one first to assert it again.")


def _already_retracted() -> Conflict:
    return Conflict("This relationship is already retracted.", code="already_retracted",
                    how_to_proceed="Nothing to do; a retraction is final.")


def _unknown_author(prepared: Prepared) -> Unauthorized:
    """The refusal of a command whose author is no agent of this corpus. The ingress only sends
    commands of agents it authenticated, so this is a sender from outside it (a forged or stale
    command on the broker): refused alone, without touching the batch's transaction."""
    log.warning("writer.unknown_author", operation=prepared.command.operation)
    return Unauthorized("The command's author is not an agent of this corpus.", code="unknown_agent",
                        how_to_proceed="Register with POST /register and write with the credential it returns.")
