"""The corpus writer's transaction: a batch of write commands in, one outcome per command out.

One PostgreSQL transaction per batch (group commit), in two phases:

1. Each command runs under its own savepoint: claim its idempotency key, check the rules that need
   the database, insert its rows. A command that breaks a rule rolls back to its savepoint and fails
   alone; a command whose key was already used answers the stored result (or 409 on a different
   request) and writes nothing.
2. Sequence assignment, at the very end: take the transaction-scoped advisory lock
   :data:`SEQUENCE_LOCK`, draw one sequence per change, insert the change-history rows (each holding
   the complete event envelope) and fill in the idempotency records, then commit. Because every
   transaction draws its sequences under the same lock and holds it until its commit, sequences
   become visible in increasing order: a reader following ``after=<last seen>`` can never skip a
   change that commits later with a lower sequence (SPEC §4's commit-order hazard). The lock is held
   only for these few statements, and one acquisition covers a whole batch.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from infra.db import CorpusIdentity, Database
from infra.db.pool import connection
from protocol import corpus
from protocol import representations as rep
from protocol.commands import WriteCommand, WriteResult
from protocol.errors import ApiError, Conflict, Forbidden, NotFound, Unprocessable

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
class _Batch:
    outcomes: list[Outcome | None]
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
    """

    def __init__(self, db: Database, identity: CorpusIdentity) -> None:
        self.db = db
        self.corpus_id = str(identity.corpus_id)
        self.lineage = str(identity.lineage)

    async def apply(self, batch: Sequence[Prepared]) -> list[Outcome]:
        """Apply ``batch`` in one transaction; return one outcome per command, in order.

        Raises whatever the database raises when the transaction as a whole fails (nothing of the
        batch is then committed); rule violations of single commands are outcomes, not exceptions.
        """
        state = _Batch(outcomes=[None] * len(batch))
        async with connection(self.db) as conn, conn.transaction():
            for index, prepared in enumerate(batch):
                savepoint = conn.transaction()
                await savepoint.start()
                try:
                    await self._stage(conn, state, index, prepared)
                except ApiError as e:
                    await savepoint.rollback()
                    state.outcomes[index] = Outcome(error=e)
                except BaseException:
                    await savepoint.rollback()
                    raise
                else:
                    await savepoint.commit()
            if state.changes:
                await self._commit_changes(conn, state, batch)
        for index, original in state.replays.items():
            first = state.outcomes[original]
            assert first is not None and first.result is not None
            state.outcomes[index] = Outcome(result=WriteResult(
                status=first.result.status, body=first.result.body, sequence=first.result.sequence, replayed=True))
        return [o if o is not None else Outcome(error=ApiError("internal: no outcome")) for o in state.outcomes]

    # --- phase 1 -------------------------------------------------------------------------------

    async def _stage(self, conn: Any, state: _Batch, index: int, prepared: Prepared) -> None:
        author_id, operation, token = prepared.key
        claimed = await conn.fetchval(
            "insert into operations (author_id, operation, token, request_hash) values ($1, $2, $3, $4) "
            "on conflict do nothing returning true", author_id, operation, token, prepared.request_hash)
        if not claimed:
            self._answer_from_record(state, index, prepared, await conn.fetchrow(
                "select request_hash, status, response, sequence from operations "
                "where author_id = $1 and operation = $2 and token = $3", author_id, operation, token))
            return
        state.claimed[prepared.key] = index
        request = prepared.request
        if isinstance(request, corpus.NewConversation):
            await self._create_conversation(conn, state, index, prepared, request)
        elif isinstance(request, corpus.NewMessage):
            await self._append_message(conn, state, index, prepared, request)
        elif isinstance(request, corpus.NewRelationship):
            await self._assert_relationship(conn, state, index, prepared, request)
        else:
            await self._retract_relationship(conn, state, index, prepared, request)

    def _answer_from_record(self, state: _Batch, index: int, prepared: Prepared, row: Any) -> None:
        if bytes(row["request_hash"]) != prepared.request_hash:
            raise Conflict(
                "This Operation-Token was already used for a different request.",
                code="operation_token_conflict",
                how_to_proceed="Use a new Operation-Token for a new write; reuse a token only to retry "
                               "the identical request.")
        if row["status"] is None:
            # Claimed earlier in this very batch: answer what that command is answered.
            state.replays[index] = state.claimed[prepared.key]
            return
        state.outcomes[index] = Outcome(result=WriteResult(
            status=row["status"], body=row["response"], sequence=row["sequence"], replayed=True))

    async def _resolve_mentions(self, conn: Any, names: Sequence[str]) -> list[tuple[str, str]]:
        if not names:
            return []
        rows = await conn.fetch("select agent_id, name, lower(name) as key from agents "
                                "where lower(name) = any($1::text[])", [n.lower() for n in names])
        found = {r["key"]: (str(r["agent_id"]), r["name"]) for r in rows}
        # Unknown names are dropped (SPEC §2); order follows the content.
        return [found[n.lower()] for n in names if n.lower() in found]

    async def _insert_message(self, conn: Any, message_id: str, conversation_id: str, author_id: str,
                              draft: corpus.MessageDraft, created_at: datetime,
                              mentions: list[tuple[str, str]]) -> None:
        await conn.execute(
            "insert into messages (id, conversation_id, author_id, kinds, content, payload, schema_name, "
            "schema_version, reply_to, tags, mention_ids, created_at) "
            "values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::uuid[], $12)",
            message_id, conversation_id, author_id, list(draft.kinds), draft.content, draft.payload_json,
            draft.schema_name, draft.schema_version, draft.reply_to, list(draft.tags),
            [agent_id for agent_id, _ in mentions], created_at)

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

    async def _create_conversation(self, conn: Any, state: _Batch, index: int, prepared: Prepared,
                                   request: corpus.NewConversation) -> None:
        author_id = prepared.command.author_id
        conversation_id, message_id = str(uuid.uuid4()), str(uuid.uuid4())
        partition = corpus.partition_of(conversation_id)
        created_at = rep.now_ms()
        mentions = await self._resolve_mentions(conn, request.message.mention_names)
        await conn.execute(
            "insert into conversations (id, subject, author_id, root_message_id, partition, created_at) "
            "values ($1, $2, $3, $4, $5, $6)",
            conversation_id, request.subject, author_id, message_id, partition, created_at)
        await self._insert_message(conn, message_id, conversation_id, author_id, request.message, created_at,
                                   mentions)
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

        self._stage_change(state, _Change(
            index=index, type=rep.CONVERSATION_CREATED, partition=partition, conversation_id=conversation_id,
            author_id=author_id, occurred_at=created_at, data=data, message_id=message_id))

    async def _append_message(self, conn: Any, state: _Batch, index: int, prepared: Prepared,
                              request: corpus.NewMessage) -> None:
        author_id = prepared.command.author_id
        conversation = await conn.fetchrow("select partition from conversations where id = $1",
                                           request.conversation_id)
        if conversation is None:
            raise NotFound(f"There is no conversation {request.conversation_id}.", code="conversation_not_found",
                           how_to_proceed="Check the conversation id (GET /conversations lists them).")
        draft = request.message
        if draft.reply_to is not None:
            parent = await conn.fetchval("select conversation_id from messages where id = $1", draft.reply_to)
            if parent is None:
                raise Unprocessable(f"'reply_to' names no message ({draft.reply_to}).", code="reply_to_not_found",
                                    extra={"field": "reply_to"},
                                    how_to_proceed="Reply to a message of this conversation, or omit reply_to.")
            if str(parent) != request.conversation_id:
                raise Unprocessable("'reply_to' must be a message of the same conversation.",
                                    code="reply_to_other_conversation", extra={"field": "reply_to"},
                                    how_to_proceed="Reply to a message of this conversation; relate messages "
                                                   "across conversations with POST /relationships.")
        message_id = str(uuid.uuid4())
        created_at = rep.now_ms()
        mentions = await self._resolve_mentions(conn, draft.mention_names)
        await self._insert_message(conn, message_id, request.conversation_id, author_id, draft, created_at,
                                   mentions)
        message_data = self._message_data(message_id, request.conversation_id, prepared, draft, created_at,
                                          mentions)
        self._stage_change(state, _Change(
            index=index, type=rep.MESSAGE_APPENDED, partition=conversation["partition"],
            conversation_id=request.conversation_id, author_id=author_id, occurred_at=created_at,
            data=lambda sequence: {"message": message_data(sequence)}, message_id=message_id))

    async def _assert_relationship(self, conn: Any, state: _Batch, index: int, prepared: Prepared,
                                   request: corpus.NewRelationship) -> None:
        author_id = prepared.command.author_id
        rows = await conn.fetch(
            "select m.id, m.author_id, m.kinds, m.conversation_id, c.partition from messages m "
            "join conversations c on c.id = m.conversation_id where m.id = any($1::uuid[])",
            [request.source_message_id, request.target_message_id])
        found = {str(r["id"]): r for r in rows}
        for field_name, message_id in (("source_message_id", request.source_message_id),
                                       ("target_message_id", request.target_message_id)):
            if message_id not in found:
                raise NotFound(f"'{field_name}' names no message ({message_id}).", code="message_not_found",
                               extra={"field": field_name},
                               how_to_proceed="Check the message id (GET /messages lists them).")
        source, target = found[request.source_message_id], found[request.target_message_id]
        target_author = str(target["author_id"])
        if request.type == "retracts" and target_author != author_id:
            raise Forbidden("Only the target message's author may assert 'retracts'.", code="not_target_author",
                            how_to_proceed="Retract only your own messages; to disagree, assert 'contradicts'.")
        if request.type == "supports" and "verification" in source["kinds"]:
            if "claim" not in target["kinds"]:
                raise Unprocessable("A 'supports' from a verification must target a message marked claim.",
                                    code="verification_needs_claim", extra={"field": "target_message_id"},
                                    how_to_proceed="Target the claim being verified.")
            if target_author == author_id:
                raise Forbidden("An agent cannot verify its own claim.", code="self_verification",
                                how_to_proceed="Ask another agent to verify the claim.")
        relationship_id = str(uuid.uuid4())
        created_at = rep.now_ms()
        partition = source["partition"]
        await conn.execute(
            "insert into relationships (id, type, source_message_id, target_message_id, author_id, partition, "
            "created_at) values ($1, $2, $3, $4, $5, $6, $7)",
            relationship_id, request.type, request.source_message_id, request.target_message_id, author_id,
            partition, created_at)
        added = await conn.fetchval(
            "insert into active_relationships (source_message_id, target_message_id, type, author_id, "
            "relationship_id) values ($1, $2, $3, $4, $5) on conflict do nothing returning true",
            request.source_message_id, request.target_message_id, request.type, author_id, relationship_id)
        if not added:
            existing = await conn.fetchval(
                "select relationship_id from active_relationships where source_message_id = $1 "
                "and target_message_id = $2 and type = $3 and author_id = $4",
                request.source_message_id, request.target_message_id, request.type, author_id)
            raise Conflict("You already assert this relationship.", code="duplicate_relationship",
                           extra={"existing_relationship_id": str(existing)},
                           how_to_proceed="Nothing to do; retract the existing one first to assert it again.")
        name = prepared.command.author_name

        def data(sequence: int) -> dict[str, Any]:
            return {"relationship": rep.relationship(
                id=relationship_id, type=request.type, source_message_id=request.source_message_id,
                target_message_id=request.target_message_id, author_id=author_id, author_name=name,
                sequence=sequence, created_at=created_at)}

        self._stage_change(state, _Change(
            index=index, type=rep.RELATIONSHIP_ASSERTED, partition=partition,
            conversation_id=str(source["conversation_id"]), author_id=author_id, occurred_at=created_at,
            data=data, relationship_id=relationship_id))

    async def _retract_relationship(self, conn: Any, state: _Batch, index: int, prepared: Prepared,
                                    request: corpus.NewRetraction) -> None:
        author_id = prepared.command.author_id
        row = await conn.fetchrow(
            "select r.author_id, r.partition, m.conversation_id, "
            "exists (select 1 from retractions x where x.relationship_id = r.id) as retracted "
            "from relationships r join messages m on m.id = r.source_message_id where r.id = $1",
            request.relationship_id)
        if row is None:
            raise NotFound(f"There is no relationship {request.relationship_id}.", code="relationship_not_found",
                           how_to_proceed="Check the relationship id (GET /relationships lists them).")
        if str(row["author_id"]) != author_id:
            raise Forbidden("Only the agent that asserted a relationship may retract it.",
                            code="not_assertion_author",
                            how_to_proceed="Assert 'contradicts' instead if you disagree with it.")
        if row["retracted"]:
            raise _already_retracted()
        retraction_id = str(uuid.uuid4())
        created_at = rep.now_ms()
        try:
            await conn.execute("insert into retractions (id, relationship_id, author_id, created_at) "
                               "values ($1, $2, $3, $4)", retraction_id, request.relationship_id, author_id,
                               created_at)
        except asyncpg.UniqueViolationError:
            raise _already_retracted() from None  # a concurrent retraction committed first
        await conn.execute("delete from active_relationships where relationship_id = $1", request.relationship_id)

        def data(sequence: int) -> dict[str, Any]:
            return {"retraction": rep.retraction(id=retraction_id, relationship_id=request.relationship_id,
                                                 sequence=sequence, created_at=created_at)}

        self._stage_change(state, _Change(
            index=index, type=rep.RELATIONSHIP_RETRACTED, partition=row["partition"],
            conversation_id=str(row["conversation_id"]), author_id=author_id, occurred_at=created_at, data=data,
            retraction_id=retraction_id))

    def _stage_change(self, state: _Batch, change: _Change) -> None:
        size = len(self._event(change, _SIZING_SEQUENCE))
        if size > corpus.MAX_EVENT_BYTES:
            raise Unprocessable(
                f"The stored event would be {size} bytes; the limit is {corpus.MAX_EVENT_BYTES}.",
                code="event_too_large", extra={"field": "content"},
                how_to_proceed="Send less content or a smaller payload.")
        state.changes.append(change)

    def _event(self, change: _Change, sequence: int) -> bytes:
        return rep.dumps(rep.envelope(
            sequence=sequence, type=change.type, partition=change.partition, corpus_id=self.corpus_id,
            lineage=self.lineage, occurred_at=change.occurred_at, data=change.data(sequence)))

    # --- phase 2 -------------------------------------------------------------------------------

    async def _commit_changes(self, conn: Any, state: _Batch, batch: Sequence[Prepared]) -> None:
        await conn.execute("select pg_advisory_xact_lock($1)", SEQUENCE_LOCK)
        sequences = sorted(await conn.fetchval(
            "select array_agg(nextval('change_sequence')) from generate_series(1, $1)", len(state.changes)))
        change_rows, operation_rows = [], []
        for change, sequence in zip(state.changes, sequences, strict=True):
            prepared = batch[change.index]
            data = change.data(sequence)
            event = rep.dumps(rep.envelope(
                sequence=sequence, type=change.type, partition=change.partition, corpus_id=self.corpus_id,
                lineage=self.lineage, occurred_at=change.occurred_at, data=data))
            body = rep.dumps({**data, "sequence": sequence}).decode()
            change_rows.append((sequence, change.type, change.partition, change.conversation_id, change.author_id,
                                change.message_id, change.relationship_id, change.retraction_id,
                                change.occurred_at, event.decode(), prepared.trace_id))
            operation_rows.append((*prepared.key, 201, body, sequence))
            state.outcomes[change.index] = Outcome(result=WriteResult(status=201, body=body, sequence=sequence))
        await conn.executemany(
            "insert into changes (sequence, type, partition, conversation_id, author_id, message_id, "
            "relationship_id, retraction_id, occurred_at, event, trace_id) "
            "values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)", change_rows)
        await conn.executemany(
            "update operations set status = $4, response = $5, sequence = $6 "
            "where author_id = $1 and operation = $2 and token = $3", operation_rows)


def _already_retracted() -> Conflict:
    return Conflict("This relationship is already retracted.", code="already_retracted",
                    how_to_proceed="Nothing to do; a retraction is final.")
