"""``toastmachine dev seed``: generated corpus data that cannot be told from written data.

The loader is checked against the database it filled: counts against its report, every change's
envelope against the rows it describes (rebuilt with the read routes' own row builders), the read
models against aggregates recomputed from the base tables, and the write path's domain rules. Also:
seeding twice adds more, the same seed generates the same text, a seed beside a writing node keeps
the change history gap-free for a reader following ``after=``, and the CLI command end to end.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from actors.reads import rows
from actors.web.app import make_app
from infra.bus import make_bus
from infra.db import CorpusIdentity, Database, apply_migrations, read_identity
from protocol import corpus
from protocol import representations as rep
from protocol.schemas import catalogue
from tests import procs
from tests.corpus_fixtures import Stack, follow_history
from tests.db_fixtures import fresh_database
from tests.webclient import serve, test_node
from toastmachine.seed import SeedProgress, SeedReport, seed_corpus

pytestmark = pytest.mark.timeout(240)

SUMMARY_RE = re.compile(
    r"seeded (\d+) agents, (\d+) conversations, (\d+) messages, (\d+) relationships, (\d+) retractions, "
    r"(\d+) changes \(sequences (\d+)\.\.(\d+)\) in [\d.]+ s: [\d,]+ rows/s")


def _json(value: Any) -> Any:
    """A representation as a client sees it (payload fragments decoded)."""
    return orjson.loads(rep.dumps(value))


async def _counts(db: Database) -> dict[str, int]:
    out = {}
    for table in ("agents", "conversations", "messages", "relationships", "retractions", "changes"):
        out[table] = await db.pool.fetchval(f"select count(*) from {table}")
    return out


def _added(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {table: after[table] - before[table] for table in after}


def _reported(report: SeedReport) -> dict[str, int]:
    return {"agents": report.agents, "conversations": report.conversations, "messages": report.messages,
            "relationships": report.relationships, "retractions": report.retractions, "changes": report.changes}


async def _check_history(db: Database, identity: CorpusIdentity, *, alone: bool = True) -> None:
    """Every change's envelope parses and holds exactly what the rows say (as the writer builds it).

    ``alone``: only the seeder wrote, so timestamps follow sequence order too (concurrent writers,
    the corpus writer's own included, draw sequences at commit but timestamps before it).
    """
    changes = await db.pool.fetch("select * from changes order by sequence")
    sequences = [c["sequence"] for c in changes]
    assert sequences == sorted(set(sequences))
    times = [c["occurred_at"] for c in changes]
    assert not alone or times == sorted(times), "occurred_at follows sequence order"

    messages = {str(r["id"]): r for r in await db.pool.fetch(
        f"select {rows.MESSAGE_COLUMNS}{rows.MESSAGE_FROM}")}
    conversations = {str(r["id"]): r for r in await db.pool.fetch(
        f"select {rows.CONVERSATION_COLUMNS}{rows.CONVERSATION_FROM}")}
    relationships = {str(r["id"]): r for r in await db.pool.fetch(
        f"select {rows.RELATIONSHIP_COLUMNS}{rows.RELATIONSHIP_FROM}")}
    retractions = {str(r["id"]): r for r in await db.pool.fetch(
        "select x.id, x.relationship_id, x.author_id, x.created_at, r.author_id as asserted_by, r.partition, "
        "m.conversation_id from retractions x join relationships r on r.id = x.relationship_id "
        "join messages m on m.id = r.source_message_id")}
    seen: Counter[str] = Counter()
    for change in changes:
        event = orjson.loads(change["event"])
        assert set(event) == {"schema_version", "sequence", "type", "partition", "corpus_id", "lineage",
                              "occurred_at", "data"}
        assert event["schema_version"] == rep.EVENT_SCHEMA_VERSION
        assert (event["sequence"], event["type"], event["partition"]) == (
            change["sequence"], change["type"], change["partition"])
        assert (event["corpus_id"], event["lineage"]) == (str(identity.corpus_id), str(identity.lineage))
        assert event["occurred_at"] == rep.format_time(change["occurred_at"])
        assert len(change["event"].encode()) <= corpus.MAX_EVENT_BYTES
        data, kind = event["data"], change["type"]
        seen[kind] += 1
        if kind in (rep.CONVERSATION_CREATED, rep.MESSAGE_APPENDED):
            row = messages[str(change["message_id"])]
            assert data["message"] == _json(rows.message(row))
            assert row["sequence"] == change["sequence"]
            assert (str(change["conversation_id"]), change["author_id"]) == (str(row["conversation_id"]),
                                                                               row["author_id"])
            assert change["partition"] == corpus.partition_of(str(row["conversation_id"]))
            assert change["relationship_id"] is None and change["retraction_id"] is None
            if kind == rep.CONVERSATION_CREATED:
                assert set(data) == {"conversation", "message"}
                conversation = conversations[str(row["conversation_id"])]
                # As the writer records it: the conversation at its creation, root message only.
                expected = {**_json(rows.conversation(conversation)), "message_count": 1,
                            "last_sequence": change["sequence"]}
                assert data["conversation"] == expected
                assert conversation["root_message_id"] == row["id"]
            else:
                assert set(data) == {"message"}
        elif kind == rep.RELATIONSHIP_ASSERTED:
            row = relationships[str(change["relationship_id"])]
            assert row["sequence"] == change["sequence"]
            # As asserted: not yet retracted, whatever happened later.
            expected = _json(rep.relationship(
                id=str(row["id"]), type=row["type"], source_message_id=str(row["source_message_id"]),
                target_message_id=str(row["target_message_id"]), author_id=str(row["author_id"]),
                author_name=row["author_name"], sequence=row["sequence"], created_at=row["created_at"]))
            assert data == {"relationship": expected}
            source = messages[str(row["source_message_id"])]
            assert change["conversation_id"] == source["conversation_id"]
            assert change["partition"] == corpus.partition_of(str(source["conversation_id"]))
            assert change["author_id"] == row["author_id"]
        else:
            row = retractions[str(change["retraction_id"])]
            assert data == {"retraction": _json(rep.retraction(
                id=str(row["id"]), relationship_id=str(row["relationship_id"]), sequence=change["sequence"],
                created_at=row["created_at"]))}
            assert change["author_id"] == row["author_id"] == row["asserted_by"]
            assert (change["partition"], change["conversation_id"]) == (row["partition"], row["conversation_id"])
            assert relationships[str(row["relationship_id"])]["retraction_sequence"] == change["sequence"]
    assert seen[rep.CONVERSATION_CREATED] == len(conversations)
    assert seen[rep.CONVERSATION_CREATED] + seen[rep.MESSAGE_APPENDED] == len(messages)
    assert seen[rep.RELATIONSHIP_ASSERTED] == len(relationships)
    assert seen[rep.RELATIONSHIP_RETRACTED] == len(retractions)

    # Derived fields follow the write path's rules; unknown names are dropped from mentions.
    registered = {r[0].lower() for r in await db.pool.fetch("select name from agents")}
    mentioned = 0
    for row in messages.values():
        assert row["tags"] == corpus.extract_tags(row["content"])
        wanted = [n.lower() for n in corpus.extract_mentions(row["content"])]
        assert [n.lower() for n in row["mention_names"]] == [n for n in wanted if n in registered]
        mentioned += len(wanted) > len(row["mention_names"])
        assert list(row["kinds"]) == [k for k in corpus.KINDS if k in row["kinds"]]
        assert row["content"] is not None or row["payload"] is not None
        if row["content"] is not None:
            assert corpus.validate_content(row["content"]) == row["content"]
        if row["payload"] is not None:
            assert corpus.canonical_json(orjson.loads(row["payload"])).decode() == row["payload"]
        if row["schema_name"] is not None:
            assert catalogue().violation(row["schema_name"], row["schema_version"],
                                         orjson.loads(row["payload"])) is None
    for row in conversations.values():
        assert corpus.validate_subject(row["subject"]) == row["subject"]


async def _check_read_models(db: Database) -> None:
    """The trigger-maintained read models equal aggregates recomputed from the base tables."""
    fetch = db.pool.fetch

    async def same(read_model: str, recomputed: str) -> None:
        got, want = await fetch(read_model), await fetch(recomputed)
        assert [tuple(r) for r in got] == [tuple(r) for r in want], read_model

    await same("select sequence, message_id, conversation_id, author_id, kinds, tags, mention_ids "
               "from message_feed order by sequence",
               "select c.sequence, m.id, m.conversation_id, m.author_id, m.kinds, m.tags, m.mention_ids "
               "from changes c join messages m on m.id = c.message_id order by c.sequence")
    await same("select conversation_id, created_sequence, message_count, last_sequence "
               "from conversation_activity order by conversation_id",
               "select m.conversation_id, min(c.sequence) filter (where c.type = 'conversation.created'), "
               "count(*)::int, max(c.sequence) from messages m join changes c on c.message_id = m.id "
               "group by m.conversation_id order by m.conversation_id")
    await same("select agent_id, message_count, conversation_count, last_sequence from agent_activity "
               "order by agent_id",
               "select c.author_id, (select count(*) from messages m where m.author_id = c.author_id)::int, "
               "(select count(distinct m.conversation_id) from messages m where m.author_id = c.author_id)::int, "
               "max(c.sequence) from changes c group by c.author_id order by c.author_id")
    await same("select agent_id, conversation_id from agent_conversations order by 1, 2",
               "select distinct author_id, conversation_id from messages order by 1, 2")
    await same("select tag, message_count, conversation_count from tag_stats order by tag",
               "select t.tag collate \"C\", count(*)::int, count(distinct m.conversation_id)::int "
               "from messages m cross join lateral unnest(m.tags) as t(tag) group by 1 order by 1")
    await same("select tag, conversation_id from tag_conversations order by 1, 2",
               "select distinct t.tag collate \"C\", m.conversation_id from messages m "
               "cross join lateral unnest(m.tags) as t(tag) order by 1, 2")


async def _check_rules(db: Database) -> None:
    """The write path's domain rules hold for every relationship and message."""
    fetchval = db.pool.fetchval
    # No active duplicates, and the active index holds exactly the unretracted assertions.
    assert await fetchval(
        "select count(*) from (select 1 from relationships r where not exists "
        "(select 1 from retractions x where x.relationship_id = r.id) "
        "group by source_message_id, target_message_id, type, author_id having count(*) > 1) d") == 0
    assert await fetchval(
        "select count(*) from ((select id from relationships r where not exists "
        "(select 1 from retractions x where x.relationship_id = r.id)) "
        "except (select relationship_id from active_relationships)) d") == 0
    assert await fetchval(
        "select count(*) from active_relationships a join relationships r on r.id = a.relationship_id "
        "where (a.source_message_id, a.target_message_id, a.type, a.author_id) "
        "is distinct from (r.source_message_id, r.target_message_id, r.type, r.author_id) "
        "or exists (select 1 from retractions x where x.relationship_id = r.id)") == 0
    # Only the target's author asserts 'retracts'.
    assert await fetchval(
        "select count(*) from relationships r join messages t on t.id = r.target_message_id "
        "where r.type = 'retracts' and t.author_id <> r.author_id") == 0
    # A 'supports' from a verification targets a claim by someone other than the asserter.
    assert await fetchval(
        "select count(*) from relationships r join messages s on s.id = r.source_message_id "
        "join messages t on t.id = r.target_message_id where r.type = 'supports' "
        "and 'verification' = any(s.kinds) and (not 'claim' = any(t.kinds) or t.author_id = r.author_id)") == 0
    # Only the asserter retracts; nothing is related to itself; replies stay in their conversation.
    assert await fetchval("select count(*) from retractions x join relationships r on r.id = x.relationship_id "
                          "where x.author_id <> r.author_id") == 0
    assert await fetchval("select count(*) from relationships where source_message_id = target_message_id") == 0
    assert await fetchval("select count(*) from messages m join messages p on p.id = m.reply_to "
                          "where p.conversation_id <> m.conversation_id") == 0
    assert await fetchval("select count(*) from conversations c join messages m on m.id = c.root_message_id "
                          "where m.reply_to is not null or m.conversation_id <> c.id") == 0


async def test_seed_fills_a_corpus_the_writer_could_have_written(db: Database) -> None:
    seen: list[SeedProgress] = []
    report = await seed_corpus(db, messages=3000, agents=12, random_seed=7, batch_messages=700,
                               progress=seen.append)
    assert [p.messages for p in seen] == [700, 1400, 2100, 2800, 3000]
    assert all(p.total_messages == 3000 for p in seen) and seen[-1].changes == report.changes

    # (1) counts match the report.
    assert await _counts(db) == _reported(report)
    assert report.messages == 3000 and report.agents == 12
    assert report.changes == report.messages + report.relationships + report.retractions
    assert (report.first_sequence, report.last_sequence) == (
        await db.pool.fetchval("select min(sequence) from changes"),
        await db.pool.fetchval("select max(sequence) from changes"))
    assert report.rows == sum(_reported(report).values()) and report.rows_per_second > 0
    assert SUMMARY_RE.search(report.summary())

    # (2) + (3) every envelope matches its rows; the read models match the base tables.
    identity = await read_identity(db)
    assert identity is not None
    await _check_history(db, identity)
    await _check_read_models(db)
    # (4) the domain rules hold.
    await _check_rules(db)

    # And the data has the shape benchmarks and demos need.
    fetch, fetchval = db.pool.fetch, db.pool.fetchval
    assert report.messages / 8 < report.relationships < report.messages / 3
    assert 0 < report.retractions < report.relationships / 5
    types = {r[0] for r in await fetch("select distinct type from relationships")}
    assert types == set(corpus.RELATIONSHIP_TYPES)
    kinds = Counter(k for r in await fetch("select kinds from messages") for k in r[0])
    assert set(kinds) == set(corpus.KINDS) and kinds.most_common(1)[0][0] == "post"
    assert await fetchval("select count(*) from messages where cardinality(kinds) > 1") > 0
    tags = await fetch("select tag, message_count from tag_stats order by message_count desc")
    assert 25 <= len(tags) <= 40
    assert tags[0]["message_count"] > 5 * tags[-1]["message_count"], "tag popularity is skewed"
    sizes = sorted(r[0] for r in await fetch("select message_count from conversation_activity"))
    assert statistics.median(sizes) <= 3 and sizes[-1] >= 40, "many small conversations, a few long ones"
    assert await fetchval("select count(*) from messages where cardinality(mention_ids) > 0") > 100
    assert await fetchval("select count(*) from messages where reply_to is not null") > 300
    assert await fetchval("select count(distinct schema_name) from messages") == 4
    assert await fetchval("select count(*) from messages where payload is not null and schema_name is null") > 0
    assert await fetchval("select count(*) from messages where content is null") > 0
    lengths = [r[0] for r in await fetch("select char_length(content) from messages where content is not null")]
    assert min(lengths) < 120 and max(lengths) > 1500
    assert await fetchval("select count(*) from messages where content ~ '\\n\\n'") > 100
    # Full-text search has real text, short common words included.
    for query in ("the & is & on", "benchmark", "latency"):
        assert await fetchval("select count(*) from messages where search @@ to_tsquery('simple', $1)", query) > 10


async def test_seeding_twice_adds_more(db: Database) -> None:
    first = await seed_corpus(db, messages=600, agents=6, random_seed=1, batch_messages=250)
    middle = await _counts(db)
    # Same seed again: the same names come up and must be skipped; new ids, later sequences.
    second = await seed_corpus(db, messages=600, agents=6, random_seed=1, batch_messages=250)
    assert _added(middle, await _counts(db)) == _reported(second)
    assert middle == _reported(first)
    assert second.agents == 6
    assert first.last_sequence is not None and second.first_sequence is not None
    assert second.first_sequence > first.last_sequence
    names = [r[0] for r in await db.pool.fetch("select name from agents")]
    assert len({n.lower() for n in names}) == len(names) == 12
    identity = await read_identity(db)
    assert identity is not None
    await _check_history(db, identity)
    await _check_read_models(db)
    await _check_rules(db)

    # The export serves the seeded changes exactly as stored.
    stored = [r[0].encode() for r in await db.pool.fetch("select event from changes order by sequence")]
    bus = make_bus(None)
    await bus.connect()
    try:
        async with serve(make_app(test_node(db, bus, identity=identity))) as client:
            resp = await client.get("/corpus/changes.jsonl", params={"after": "0", "limit": "1000"})
            body = await resp.read()
            assert resp.status == 200, body
    finally:
        await bus.close()
    lines = body.split(b"\n")[:-1]
    assert lines == stored[:1000]


def _without_ids(payload: str | None) -> Any:
    value = None if payload is None else orjson.loads(payload)
    if isinstance(value, dict):
        value.pop("claim_message_id", None)
    return value


async def test_same_seed_same_text(database_server: str) -> None:
    async def text(random_seed: int) -> list[tuple[Any, ...]]:
        async with fresh_database(database_server) as dsn:
            await seed_corpus(dsn, messages=400, random_seed=random_seed)  # a DSN: migrated here
            conn = await asyncpg.connect(dsn)
            try:
                # Everything but ids (random, like the writer's) and timestamps; a verification's
                # payload names the claim it checked by id.
                return [(*r[:3], _without_ids(r[3]), *r[4:]) for r in await conn.fetch(
                    "select c.type, a.name, m.content, m.payload, m.kinds, s.subject from changes c "
                    "join agents a on a.agent_id = c.author_id left join messages m on m.id = c.message_id "
                    "left join conversations s on s.root_message_id = m.id order by c.sequence")]
            finally:
                await conn.close()

    first = await text(5)
    assert await text(5) == first
    assert await text(6) != first


async def test_seed_beside_a_writing_node_keeps_the_history_gap_free(stack: Stack) -> None:
    """Seeded batches and the writer's batches share the sequence lock: a reader following after=
    never skips a change, whichever committed it."""
    agent = await stack.register()
    cid = (await stack.conversation(agent))["conversation"]["id"]
    seen: list[int] = []
    done = asyncio.Event()

    async def writes() -> None:
        for i in range(60):
            await stack.message(agent, cid, content=f"written {i} #live")

    read = asyncio.create_task(follow_history(stack.db, done, seen))
    try:
        report, _ = await asyncio.gather(
            seed_corpus(stack.db, messages=1200, agents=5, batch_messages=50), writes())
    finally:
        done.set()
        await read
    committed = [r[0] for r in await stack.db.pool.fetch("select sequence from changes order by sequence")]
    assert len(committed) == 1 + 60 + report.changes
    assert seen == committed, f"the reader skipped {sorted(set(committed) - set(seen))[:20]}"
    await _check_history(stack.db, stack.identity, alone=False)
    await _check_read_models(stack.db)
    await _check_rules(stack.db)


async def test_cli_dev_seed(tmp_path: Path, database_url: str) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_DATABASE_URL=database_url)
    proc = await procs.start("dev", "seed", "--messages", "1500", "--agents", "9", "--random-seed", "3", env=env)
    assert await proc.wait(timeout=120) == 0, "\n".join(proc.output)
    text = "\n".join(proc.output)
    assert "Traceback" not in text
    assert re.search(r"^seeding .*: 1,500 messages, random seed 3$", text, re.MULTILINE), text
    assert re.search(r"^  1,500/1,500 messages, [\d,]+ changes", text, re.MULTILINE), text
    found = SUMMARY_RE.search(text)
    assert found, text
    agents, conversations, messages, relationships, retractions, changes, low, high = map(int, found.groups())
    assert (agents, messages) == (9, 1500)

    db = await Database.connect(database_url)
    try:
        assert await _counts(db) == {"agents": agents, "conversations": conversations, "messages": messages,
                                     "relationships": relationships, "retractions": retractions,
                                     "changes": changes}
        assert (low, high) == (1, await db.pool.fetchval("select max(sequence) from changes"))
        identity = await read_identity(db)
        assert identity is not None, "the corpus witness was created, as on a node's first start"
        await _check_history(db, identity)
        await _check_read_models(db)
    finally:
        await db.close()

    # A configured identity that does not match the witness: refused, nothing added.
    other = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_DATABASE_URL=database_url,
                            TOASTMACHINE_LINEAGE=str(uuid.uuid4()))
    proc = await procs.start("dev", "seed", "--messages", "10", env=other)
    assert await proc.wait(timeout=60) == 1
    text = "\n".join(proc.output)
    assert "toastmachine: " in text and "is configured as" in text and "Traceback" not in text, text
    # A usage error: no messages to add.
    proc = await procs.start("dev", "seed", "--messages", "0", env=env)
    assert await proc.wait(timeout=60) == 2
    assert "must be at least 1" in "\n".join(proc.output)


async def test_seed_rejects_nonsense(db: Database) -> None:
    with pytest.raises(ValueError, match="messages"):
        await seed_corpus(db, messages=0)
    with pytest.raises(ValueError, match="agents"):
        await seed_corpus(db, messages=10, agents=1)
    assert await db.pool.fetchval("select count(*) from agents") == 0


async def test_seed_migrates_a_dsn(database_dsn: str) -> None:
    report = await seed_corpus(database_dsn, messages=50)
    assert report.agents == 5 and report.messages == 50
    db = await Database.connect(database_dsn)
    try:
        assert await apply_migrations(db) == []
        assert await _counts(db) == _reported(report)
    finally:
        await db.close()
