"""The writer's set-based group commit (actors/writer/store.py) against a real database.

One batch mixing every kind of command, repeated keys, rule violations and racing assertions must
answer exactly what applying the commands one by one would answer, write only what it answers 201,
in one transaction; applied again it writes nothing and replays every answer. Two transactions
applying the same batch at once commit each command once, the loser answering the winner's result.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

import orjson

from actors.writer.store import CorpusStore, Outcome, Prepared
from infra.db import Database, ensure_identity
from infra.ratelimit import Gcra
from protocol import corpus
from protocol.commands import WriteCommand


async def _agent(db: Database, name: str) -> str:
    agent_id = str(uuid.uuid4())
    await db.pool.execute("insert into agents (agent_id, name, credential_hash) values ($1, $2, $3)",
                          agent_id, name, hashlib.sha256(agent_id.encode()).digest())
    return agent_id


def _command(author: tuple[str, str], operation: str, body: dict[str, Any], token: str,
             target: str | None = None) -> Prepared:
    return Prepared.from_command(WriteCommand(operation=operation, target=target, body=body, author_id=author[0],
                                              author_name=author[1], token=token))


def _body(outcome: Outcome) -> dict[str, Any]:
    assert outcome.result is not None and outcome.result.status == 201, outcome
    return orjson.loads(outcome.result.body)


def _code(outcome: Outcome) -> tuple[int, str]:
    assert outcome.error is not None, outcome
    return outcome.error.status, outcome.error.code


async def test_a_mixed_batch_answers_as_one_by_one_and_replays_exactly(db: Database) -> None:
    identity = await ensure_identity(db, None, None)
    store = CorpusStore(db, identity)
    suffix = uuid.uuid4().hex[:6]
    alice = (await _agent(db, f"alice_{suffix}"), f"alice_{suffix}")
    bob = (await _agent(db, f"bob_{suffix}"), f"bob_{suffix}")
    first = await store.apply([
        _command(alice, corpus.OP_CREATE_CONVERSATION, {"subject": "x", "content": "root x"}, "c-x"),
        _command(bob, corpus.OP_CREATE_CONVERSATION, {"subject": "y", "content": "root y"}, "c-y"),
    ])
    x, y = _body(first[0])["conversation"], _body(first[1])["conversation"]
    [asserted] = await store.apply([_command(alice, corpus.OP_ASSERT_RELATIONSHIP, {
        "type": "extends", "source_message_id": x["root_message_id"],
        "target_message_id": y["root_message_id"]}, "r-1")])
    relationship_id = _body(asserted)["relationship"]["id"]
    before = await db.pool.fetchval("select max(sequence) from changes")

    hello = {"content": f"hello @BOB_{suffix} and @nobody_here #Tag1 #tag2", "reply_to": x["root_message_id"]}
    contradicts = {"type": "contradicts", "source_message_id": y["root_message_id"],
                   "target_message_id": x["root_message_id"]}
    batch = [
        _command(alice, corpus.OP_APPEND_MESSAGE, hello, "a-1", x["id"]),
        _command(alice, corpus.OP_APPEND_MESSAGE, hello, "a-1", x["id"]),  # a retry within the batch
        _command(alice, corpus.OP_APPEND_MESSAGE, {"content": "other"}, "a-1", x["id"]),  # token reused
        _command(bob, corpus.OP_APPEND_MESSAGE, {"content": "lost"}, "b-1", str(uuid.uuid4())),
        _command(bob, corpus.OP_APPEND_MESSAGE, {"content": "r", "reply_to": x["root_message_id"]}, "b-2",
                 y["id"]),
        _command(bob, corpus.OP_CREATE_CONVERSATION, {"subject": "z", "content": f"hi @alice_{suffix}"}, "b-3"),
        _command(bob, corpus.OP_ASSERT_RELATIONSHIP, contradicts, "b-4"),
        _command(bob, corpus.OP_ASSERT_RELATIONSHIP, contradicts, "b-5"),  # the same assertion again
        _command(alice, corpus.OP_RETRACT_RELATIONSHIP, {}, "a-2", relationship_id),
        _command(bob, corpus.OP_RETRACT_RELATIONSHIP, {}, "b-6", relationship_id),
    ]
    outcomes = await store.apply(batch)

    created = [0, 5, 6, 8]
    sequences = [_body(outcomes[i])["sequence"] for i in created]
    assert sequences == sorted(sequences) and sequences[0] > before  # arrival order within the batch
    retried, original = outcomes[1].result, outcomes[0].result
    assert retried is not None and original is not None and retried.replayed
    assert (retried.body, retried.sequence) == (original.body, sequences[0])
    assert _code(outcomes[2]) == (409, "operation_token_conflict")
    assert _code(outcomes[3]) == (404, "conversation_not_found")
    assert _code(outcomes[4]) == (422, "reply_to_other_conversation")
    assert _code(outcomes[7]) == (409, "duplicate_relationship")
    assert outcomes[7].error is not None
    assert outcomes[7].error.extra["existing_relationship_id"] == _body(outcomes[6])["relationship"]["id"]
    assert _code(outcomes[9]) == (403, "not_assertion_author")

    message = _body(outcomes[0])["message"]
    row = await db.pool.fetchrow("select kinds, tags, mention_ids, reply_to from messages where id = $1",
                                 message["id"])
    assert list(row["tags"]) == ["tag1", "tag2"]
    assert [str(m) for m in row["mention_ids"]] == [bob[0]]  # the unknown name is dropped
    assert list(row["kinds"]) == list(corpus.DEFAULT_KINDS)
    assert str(row["reply_to"]) == x["root_message_id"]
    root = _body(outcomes[5])["conversation"]["root_message_id"]
    assert [str(m) for m in await db.pool.fetchval("select mention_ids from messages where id = $1", root)] \
        == [alice[0]]
    # Only the four 201s wrote, all in one transaction, each change holding its answer's sequence.
    changes = await db.pool.fetch("select sequence, xmin::text as tx from changes where sequence > $1 "
                                  "order by sequence", before)
    assert [c["sequence"] for c in changes] == sequences
    assert len({c["tx"] for c in changes}) == 1
    assert await db.pool.fetchval("select count(*) from operations") == 3 + 4
    assert await db.pool.fetchval("select count(*) from active_relationships where relationship_id = $1",
                                  relationship_id) == 0

    again = await store.apply(batch)
    for i in (0, 1, *created[1:]):
        result = again[i].result
        assert result is not None and result.replayed
        assert result.body == (outcomes[0] if i == 1 else outcomes[i]).result.body  # type: ignore[union-attr]
    assert [_code(again[i]) for i in (2, 3, 4, 7, 9)] == [_code(outcomes[i]) for i in (2, 3, 4, 7, 9)]
    assert await db.pool.fetchval("select max(sequence) from changes") == sequences[-1]


async def test_two_transactions_applying_one_batch_commit_each_command_once(db: Database) -> None:
    identity = await ensure_identity(db, None, None)
    store = CorpusStore(db, identity)
    author = (await _agent(db, f"racer_{uuid.uuid4().hex[:6]}"), "racer")
    [created] = await store.apply([_command(author, corpus.OP_CREATE_CONVERSATION,
                                            {"subject": "race", "content": "root"}, "c")])
    conversation = _body(created)["conversation"]["id"]
    batch = [_command(author, corpus.OP_APPEND_MESSAGE, {"content": f"m{i}"}, f"t-{i}", conversation)
             for i in range(20)]
    one, other = await asyncio.gather(store.apply(batch), store.apply(batch))
    for a, b in zip(one, other, strict=True):
        assert a.result is not None and b.result is not None
        assert a.result.body == b.result.body and a.result.sequence == b.result.sequence
        assert a.result.replayed != b.result.replayed  # one committed it, the other answered its result
    assert await db.pool.fetchval("select count(*) from changes") == 1 + 20
    assert await db.pool.fetchval("select count(*) from messages") == 1 + 20


async def test_the_budget_counts_earlier_commands_of_the_same_batch(db: Database) -> None:
    identity = await ensure_identity(db, None, None)
    store = CorpusStore(db, identity, write_budget=Gcra(rate=0.001, burst=3))
    author = (await _agent(db, f"budget_{uuid.uuid4().hex[:6]}"), "budget")
    batch = [_command(author, corpus.OP_CREATE_CONVERSATION, {"subject": f"s{i}", "content": "c"}, f"t-{i}")
             for i in range(5)]
    outcomes = await store.apply(batch)
    assert [o.result.status if o.result else _code(o)[0] for o in outcomes] == [201, 201, 201, 429, 429]
    assert await db.pool.fetchval("select count(*) from operations") == 3  # a refusal claims nothing
    replayed = await store.apply(batch[:3])  # replays are answered, never charged
    assert all(o.result is not None and o.result.replayed for o in replayed)
