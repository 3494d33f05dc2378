"""``archive restore``: a real corpus written over HTTP, archived, restored into an empty database and
served again by a real web front and writer, on both backend pairs (embedded PostgreSQL with the
in-process bus; PostgreSQL with RabbitMQ) and on a directory store and SeaweedFS.

The restored corpus must be the same corpus under a fresh lineage: ``snapshot.jsonl`` and
``changes.jsonl`` equal apart from the lineage, the same Merkle root, every agent's old credential
accepted, an old write retried with its old token answered from the stored record (no second
effect), new writes after the highest sequence, and ``GET /corpus`` naming the parent lineage and the
checkpoint. Restoring into a non-empty database, or from a tampered archive, writes nothing.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import jsonschema
import obstore
import orjson
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from actors.archiver import SigningKeyMismatch
from actors.recovery import load
from actors.recovery.load import LoadProgress
from actors.recovery.restore import RestoreRefused, restore_archive
from actors.recovery.verify import verify_archive
from actors.recovery.walk import StoreSource
from infra.archive_keys import archive_origin
from infra.archive_store import ArchiveStore
from infra.db import Database, apply_migrations
from protocol.archive import Stream, segment_key
from protocol.checkpoint import generate_signer_key
from protocol.merkle import leaf_hash, tree_root
from tests.archive_fixtures import (
    Archived,
    archive_database,
    archiver_caught_up,
    archiving,
    raw_store,
    store_fixture,  # noqa: F401 - the ``store`` fixture, on each backend
)
from tests.corpus_fixtures import STACK_ENV, Agent, Stack, running_stack
from tests.db_fixtures import fresh_database
from tests.procs import communicate
from tests.s3_server import S3Server


async def _read(stack: Stack, path: str) -> bytes:
    resp = await stack.client.get(path)
    assert resp.status == 200, await resp.text()
    return await resp.read()


async def _read_as(stack: Stack, path: str, agent: Agent) -> bytes:
    resp = await stack.client.get(path, headers=agent.headers())
    assert resp.status == 200, await resp.text()
    return await resp.read()


def _without_lineage(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "lineage"} for e in events]


async def _changes(stack: Stack) -> list[dict[str, Any]]:
    body = await _read(stack, "/corpus/changes.jsonl?limit=10000")
    return [orjson.loads(line) for line in body.splitlines()]


@dataclass
class Parent:
    """The archived history a restore starts from: its identity, tree size and root."""

    lineage: uuid.UUID
    corpus_id: uuid.UUID
    size: int
    root: bytes


class Original:
    """What the test remembers of the original corpus."""

    def __init__(self) -> None:
        self.agents: list[Agent] = []
        self.me: list[dict[str, Any]] = []
        self.retry: tuple[Agent, str, str, dict[str, Any]] | None = None
        self.retry_answer: Any = None
        self.snapshot = b""
        self.changes: list[dict[str, Any]] = []
        self.head = 0


async def _write_history(stack: Stack, original: Original) -> None:
    """Every change type, a reply, a mention, payloads, a retraction and a re-assertion after it."""
    alice = await stack.register("alice-restored")
    bob = await stack.register("bob-restored")
    carol = await stack.register("carol-restored", onboard=False)
    original.agents = [alice, bob, carol]
    first = await stack.conversation(alice, "restorable", content="hello @bob-restored #archive")
    cid, root = first["conversation"]["id"], first["message"]["id"]
    token = str(uuid.uuid4())
    body = {"content": "a claim worth keeping", "kinds": ["claim"], "reply_to": root,
            "payload": {"confidence": 0.25, "n": [1, 2.5, None]}}
    reply = await stack.post(bob, f"/conversations/{cid}/messages", body, token=token)
    assert reply.status == 201, reply.body
    original.retry = (bob, f"/conversations/{cid}/messages", token, body)
    original.retry_answer = reply.body
    claim = reply.body["message"]["id"]
    for n in range(8):
        await stack.message(alice if n % 2 else bob, cid, content=f"message {n} #n{n % 3}")
    second = await stack.conversation(bob, "second", payload=None)
    assertion = {"type": "supports", "source_message_id": second["message"]["id"], "target_message_id": claim}
    rel = await stack.post(bob, "/relationships", assertion)
    assert rel.status == 201, rel.body
    assert (await stack.post(bob, f"/relationships/{rel.body['relationship']['id']}/retractions")).status == 201
    again = await stack.post(bob, "/relationships", assertion)  # the same assertion, active again
    assert again.status == 201, again.body
    other = await stack.post(alice, "/relationships", {"type": "contradicts", "source_message_id": root,
                                                      "target_message_id": claim})
    assert other.status == 201, other.body
    for agent in original.agents:
        original.me.append(orjson.loads(await _read_as(stack, "/me", agent)))
    assert [m["onboarded"] for m in original.me] == [True, True, False]
    original.snapshot = await _read(stack, "/corpus/snapshot.jsonl")
    original.changes = await _changes(stack)
    original.head = original.changes[-1]["sequence"]


async def _restore(store: ArchiveStore, archived: Archived, dsn: str) -> dict[str, Any]:
    db = await Database.connect(dsn, min_size=1, max_size=2)
    try:
        await apply_migrations(db)
        report = await restore_archive(StoreSource(store), archived.lineage, db, trusted=archived.key.verifier())
        return report.to_json()
    finally:
        await db.close()


async def test_restore_round_trip(stack_backends: tuple[str | None, str], store: ArchiveStore) -> None:
    amqp_url, server = stack_backends
    original = Original()
    async with fresh_database(server) as source_dsn:
        async with running_stack(source_dsn, amqp_url, STACK_ENV) as stack:
            await _write_history(stack, original)
            archived = await archive_database(stack.db, store, per_segment=4)
            parent = stack.identity.lineage
        async with fresh_database(server) as dsn:
            report = await _restore(store, archived, dsn)
            assert report["provenance"] == {"parent_lineage": str(parent), "checkpoint_size": archived.size,
                                            "checkpoint_root": archived.root.hex()}
            assert report["restored_through"] == original.head
            assert report["counts"]["changes"] == len(original.changes) == archived.size
            assert report["counts"]["agents"] == 3 and report["counts"]["changes_without_operation_record"] == 0
            async with running_stack(dsn, amqp_url, STACK_ENV) as restored:
                parent_history = Parent(archived.lineage, archived.corpus_id, archived.size, archived.root)
                await _check_restored(restored, original, parent_history, report)


async def _check_restored(restored: Stack, original: Original, archived: Parent, report: dict[str, Any]) -> None:
    new_lineage = str(restored.identity.lineage)
    assert new_lineage == report["lineage"] != str(archived.lineage)
    assert restored.identity.corpus_id == archived.corpus_id
    # The same state and history, apart from the lineage.
    assert await _read(restored, "/corpus/snapshot.jsonl") == original.snapshot
    changes = await _changes(restored)
    assert {e["lineage"] for e in changes} == {new_lineage}
    assert _without_lineage(changes) == _without_lineage(original.changes)
    # The same Merkle root: the restored events, stamped back with the parent lineage, are the leaves
    # (format 2 archives the stored envelope text, which the loader writes with orjson as the writer does).
    leaves = [leaf_hash(orjson.dumps({**e, "lineage": str(archived.lineage)})) for e in changes]
    assert tree_root(leaves) == archived.root
    # Provenance on GET /corpus.
    resp = await restored.client.get("/corpus")
    info = await resp.json()
    assert info["lineage"] == new_lineage
    assert info["provenance"]["parent_lineage"] == str(archived.lineage)
    assert info["provenance"]["checkpoint_size"] == archived.size
    assert info["provenance"]["checkpoint_root"] == archived.root.hex()
    # The body, provenance included, is what /openapi.json documents.
    doc = await (await restored.client.get("/openapi.json")).json()
    registry: Registry[Any] = Registry().with_resource("urn:openapi", Resource.from_contents(
        doc, default_specification=DRAFT202012))
    errors = list(jsonschema.Draft202012Validator({"$ref": "urn:openapi#/components/schemas/CorpusInfo"},
                                                  registry=registry).iter_errors(info))
    assert not errors, [e.message for e in errors]
    page = await restored.client.get("/corpus", headers={"Accept": "text/html"})
    html = await page.text()
    assert page.status == 200 and "restored from lineage" in html and str(archived.lineage) in html
    # Every agent keeps its credential, its onboarding state and its activity.
    for agent, before in zip(original.agents, original.me, strict=True):
        resp = await restored.client.get("/me", headers=agent.headers())
        assert resp.status == 200, await resp.text()
        assert await resp.json() == before
    # An old write retried with its old token is answered from the stored record: no second effect.
    assert original.retry is not None
    who, path, token, body = original.retry
    again = await restored.post(who, path, body, token=token)
    assert again.status == 201 and again.body == original.retry_answer
    assert (await _changes(restored))[-1]["sequence"] == original.head
    # A new write continues after the highest restored sequence.
    cid = original.retry_answer["message"]["conversation_id"]
    fresh = await restored.message(original.agents[0], cid, content="after the restore")
    assert fresh["message"]["sequence"] > original.head
    # Nothing was republished: the publisher's cursor starts at the restored head.
    assert await restored.db.pool.fetchval("select sequence from publisher_cursor") == original.head


async def test_restore_from_what_the_archiver_wrote(stack_backends: tuple[str | None, str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Load, archive with the real archiver, verify, restore: the same corpus under a fresh lineage.

    The loader's in-transaction ANALYZE (due every time its event count doubles from
    ``ANALYZE_FROM``, 4,000 in production: the first run) is made due from the third event, and the restore writes
    each segment as a run of its own (``RUN_EVENTS``, 4,000 in production), so this restore runs it
    several times between its segments and must still give the same corpus."""
    monkeypatch.setattr(load, "ANALYZE_FROM", 3)
    monkeypatch.setattr("actors.recovery.restore.RUN_EVENTS", 1)
    amqp_url, server = stack_backends
    original = Original()
    store = ArchiveStore.local(tmp_path / "archive")
    async with fresh_database(server) as source_dsn:
        async with running_stack(source_dsn, amqp_url, STACK_ENV) as stack:
            await _write_history(stack, original)
            signer = generate_signer_key(archive_origin(stack.identity.corpus_id))
            async with archiving(stack, store, signer):
                await archiver_caught_up(stack)
            verified = await verify_archive(StoreSource(store), stack.identity.lineage, db=stack.db)
            assert verified.ok, verified.to_json()
            assert verified.private is not None and verified.private["records_checked"] > 0
            parent = Parent(stack.identity.lineage, stack.identity.corpus_id, verified.archive.tree_size,
                            bytes.fromhex(verified.archive.root or ""))
        async with fresh_database(server) as dsn:
            db = await Database.connect(dsn, min_size=1, max_size=2)
            try:
                await apply_migrations(db)
                told: list[LoadProgress] = []
                report = (await restore_archive(StoreSource(store), parent.lineage, db, progress=told.append)).to_json()
                # Told after each run (here one a segment), in order, up to every archived change.
                assert len(told) == verified.archive.segments_checked >= 2
                assert [t.changes_done for t in told] == sorted({t.changes_done for t in told})
                assert told[-1].changes_done == told[-1].changes_archived == report["counts"]["changes"]
                assert told[-1].through_sequence == report["restored_through"]
                assert await db.pool.fetchval("select analyze_count from pg_stat_user_tables "
                                              "where relname = 'changes'") >= 2
            finally:
                await db.close()
            async with running_stack(dsn, amqp_url, STACK_ENV) as restored:
                await _check_restored(restored, original, parent, report)
                # The restored node archives its own lineage with the corpus's key, naming the
                # parent, and that verifies; an archiver with another key (a restore whose
                # DATA_DIR lacks the key file generates one) is refused before it signs anything.
                second = ArchiveStore.local(tmp_path / "restored-archive")
                with pytest.raises(SigningKeyMismatch, match="this corpus's database records"):
                    async with archiving(restored, second):
                        pass
                assert [o async for o in second.list()] == []
                async with archiving(restored, second, signer):
                    await archiver_caught_up(restored)
                again = await verify_archive(StoreSource(second), restored.identity.lineage, db=restored.db)
                assert again.ok, again.to_json()
                assert again.archive.parent_lineage == parent.lineage


async def test_restore_refuses_a_non_empty_database_and_a_tampered_archive(
        db: Database, database_server: str, tmp_path: Path) -> None:
    from toastmachine.seed import seed_corpus

    await seed_corpus(db, messages=12, agents=6, random_seed=3)  # two private segments
    store = ArchiveStore.local(tmp_path / "archive")
    archived = await archive_database(db, store)
    trusted = archived.key.verifier()
    # Into the very database it came from: refused, nothing written.
    before = await db.pool.fetchval("select count(*) from changes")
    with pytest.raises(RestoreRefused, match="not empty"):
        await restore_archive(StoreSource(store), archived.lineage, db, trusted=trusted)
    assert await db.pool.fetchval("select count(*) from changes") == before
    # From a tampered archive (a byte flipped in the last public segment, or a private segment
    # missing): refused after reading, and the empty database stays empty.
    last = archived.segment_key(len(archived.segments) - 1)
    data = await store.get(last)
    async with fresh_database(database_server) as dsn:
        target = await Database.connect(dsn, min_size=1, max_size=2)
        try:
            await apply_migrations(target)
            await obstore.put_async(raw_store(store), last, data[:100] + bytes([data[100] ^ 1]) + data[101:])
            with pytest.raises(RestoreRefused) as refused:
                await restore_archive(StoreSource(store), archived.lineage, target, trusted=trusted)
            assert "crc_mismatch" in {f.kind for f in refused.value.findings}
            await obstore.put_async(raw_store(store), last, data)
            # A byte flipped in the first segment: what follows it no longer fits, but the refusal
            # names the segment's own fault (it once said only "does not fit together").
            assert len(archived.segments) >= 2
            first = archived.segment_key(0)
            head = await store.get(first)
            await obstore.put_async(raw_store(store), first, head[:100] + bytes([head[100] ^ 1]) + head[101:])
            with pytest.raises(RestoreRefused) as refused:
                await restore_archive(StoreSource(store), archived.lineage, target, trusted=trusted)
            assert "crc_mismatch" in {f.kind for f in refused.value.findings}, refused.value
            assert "does not verify" in str(refused.value)
            await obstore.put_async(raw_store(store), first, head)
            private = [o.key async for o in store.list(f"{archived.lineage}/private/segments")]
            await obstore.delete_async(raw_store(store), min(private))
            with pytest.raises(RestoreRefused) as refused:
                await restore_archive(StoreSource(store), archived.lineage, target, trusted=trusted)
            assert "missing_segment" in {f.kind for f in refused.value.findings}
            for table in ("corpus_witness", "agents", "changes", "operations", "corpus_provenance"):
                assert await target.pool.fetchval(f"select count(*) from {table}") == 0, table
        finally:
            await target.close()
    assert segment_key(archived.lineage, 0, 1, 1, Stream.PRIVATE).startswith(f"{archived.lineage}/private/")


async def test_two_restores_into_one_database_at_once_one_wins_and_the_other_is_refused(
        db: Database, database_server: str, tmp_path: Path) -> None:
    """Two operators (or a retry) restoring into the same empty database at the same time: one
    restores, the other waits for it and is refused as into a non-empty database, with the
    refusal the CLI reports, not a unique-key error from the database."""
    from toastmachine.seed import seed_corpus

    await seed_corpus(db, messages=12, agents=3, random_seed=5)
    store = ArchiveStore.local(tmp_path / "archive")
    archived = await archive_database(db, store)
    async with fresh_database(database_server) as dsn:
        target = await Database.connect(dsn, min_size=2, max_size=4)
        try:
            await apply_migrations(target)
            outcomes = await asyncio.gather(
                *(restore_archive(StoreSource(store), archived.lineage, target, trusted=archived.key.verifier())
                  for _ in range(2)), return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(refused) == 1 and isinstance(refused[0], RestoreRefused), outcomes
            assert "not empty" in str(refused[0])
            assert await target.pool.fetchval("select count(*) from corpus_witness") == 1
            assert await target.pool.fetchval("select count(*) from changes") == archived.size
        finally:
            await target.close()


async def test_a_restore_whose_signing_key_is_lost_records_none_and_signs_anew(
        db: Database, database_server: str, tmp_path: Path) -> None:
    """By default a restore records the archive's key, and an archiver with another one is
    refused; with ``keep_signing_key=False`` (``--new-signing-key``: the key is lost) it records none,
    and the first archiver of the restored corpus records its own."""
    from actors.archiver import Archiver
    from infra.bus import make_bus
    from infra.db import ensure_identity
    from toastmachine.seed import seed_corpus

    await seed_corpus(db, messages=6, agents=2, random_seed=11)
    archived = await archive_database(db, ArchiveStore.local(tmp_path / "archive"))
    for keep in (True, False):
        async with fresh_database(database_server) as dsn:
            target = await Database.connect(dsn, min_size=1, max_size=4)
            bus = make_bus(None)
            await bus.connect()
            try:
                await apply_migrations(target)
                await restore_archive(StoreSource(ArchiveStore.local(tmp_path / "archive")), archived.lineage, target,
                                      keep_signing_key=keep)
                recorded = await target.pool.fetchval("select public_key from archive_signing_key")
                assert recorded == (archived.key.verifier().text() if keep else None)
                new_key = generate_signer_key(archive_origin(archived.corpus_id))
                archiver = Archiver(bus, target, identity=await ensure_identity(target, None, None),
                                    store=ArchiveStore.local(tmp_path / f"restored-{keep}"), signer=new_key,
                                    node_id="t-new-key")
                if keep:
                    with pytest.raises(SigningKeyMismatch, match="--new-signing-key"):
                        await archiver.start()
                else:
                    await archiver.start()
                    await archiver.stop(grace=5)
            finally:
                await bus.close()
                await target.close()


async def test_a_store_that_refuses_the_credentials_is_unreadable_not_empty(
        db: Database, database_server: str, s3_server: S3Server) -> None:
    """An archive on S3 read with a wrong secret: verify reports its manifest and public key
    unreadable, with the S3 cause, not absent (they are there); a restore is refused saying the
    cause in its one line; neither shows the secret."""
    from toastmachine.seed import seed_corpus

    await seed_corpus(db, messages=6, agents=2, random_seed=9)
    prefix = f"refused-{uuid.uuid4().hex[:8]}"
    archived = await archive_database(db, s3_server.store(prefix))
    wrong = s3_server.store(prefix, secret="definitely-wrong-secret")
    report = await verify_archive(StoreSource(wrong), archived.lineage)
    kinds = {f.kind for f in report.findings}
    assert "unreadable_object" in kinds and not kinds & {"missing_manifest", "missing_public_key"}, report.to_json()
    assert any("SignatureDoesNotMatch" in f.message for f in report.findings), report.to_json()
    async with fresh_database(database_server) as dsn:
        target = await Database.connect(dsn, min_size=1, max_size=2)
        try:
            await apply_migrations(target)
            with pytest.raises(RestoreRefused) as refused:
                await restore_archive(StoreSource(wrong), archived.lineage, target)
        finally:
            await target.close()
    assert "SignatureDoesNotMatch" in str(refused.value) and "definitely-wrong-secret" not in str(refused.value)
    # The command, not told the lineage, cannot even list the store: still its JSON report, saying why.
    env = {**os.environ, "TOASTMACHINE_ARCHIVE_S3_ENDPOINT": s3_server.endpoint,
           "TOASTMACHINE_ARCHIVE_S3_REGION": "us-east-1", "TOASTMACHINE_ARCHIVE_S3_ACCESS_KEY_ID": s3_server.access_key_id,
           "TOASTMACHINE_ARCHIVE_S3_SECRET_ACCESS_KEY": "definitely-wrong-secret"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "toastmachine.cli", "archive", "verify", "--from-store",
        f"s3://{s3_server.bucket}/{prefix}", "--no-database", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await communicate(proc, 120)
    assert proc.returncode == 1, (out, err)
    report = orjson.loads(out)
    assert [f["kind"] for f in report["findings"]] == ["unlistable_store"], report
    assert "SignatureDoesNotMatch" in report["findings"][0]["message"] and b"definitely-wrong-secret" not in out + err


async def test_a_store_named_wrongly_on_the_command_line_is_said_so(
        database_url: str, tmp_path: Path, s3_server: S3Server) -> None:
    """A mistyped bucket is no archive there (restore: exit 2; verify: its report of nothing
    verified, exit 1), saying NoSuchBucket; a malformed --from or --from-store is blamed on that
    option, not on TOASTMACHINE_ARCHIVE_URL; the database stays empty throughout."""
    async with fresh_database(database_url) as dsn:
        env = {**os.environ, "TOASTMACHINE_DATABASE_URL": dsn, "TOASTMACHINE_DATA_DIR": str(tmp_path / "data"),
               "TOASTMACHINE_ARCHIVE_S3_ENDPOINT": s3_server.endpoint, "TOASTMACHINE_ARCHIVE_S3_REGION": "us-east-1",
               "TOASTMACHINE_ARCHIVE_S3_ACCESS_KEY_ID": s3_server.access_key_id,
               "TOASTMACHINE_ARCHIVE_S3_SECRET_ACCESS_KEY": s3_server.secret_access_key}

        async def cli(*args: str) -> tuple[int | None, bytes, bytes]:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "toastmachine.cli", "archive", *args,
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            assert b"Traceback" not in err and s3_server.secret_access_key.encode() not in out + err, err
            return proc.returncode, out, err

        code, out, err = await cli("restore", "--from", "s3://no-such-bucket-here/p")
        assert code == 2, (out, err)
        assert b"no archive there" in err and b"the bucket does not exist (NoSuchBucket)" in err, err
        code, out, err = await cli("verify", "--from-store", "s3://no-such-bucket-here/p", "--no-database")
        assert code == 1, (out, err)
        report = orjson.loads(out)
        assert not report["ok"] and "NoSuchBucket" in orjson.dumps(report).decode(), report
        for option, command in (("--from", "restore"), ("--from-store", "verify")):
            code, out, err = await cli(command, option, "s3:no-such-bucket-here/p")
            assert code == 2, (out, err)
            assert err.decode().startswith(f"toastmachine: {option} starts like a URL"), err
            assert b"TOASTMACHINE_ARCHIVE_URL" not in err
        conn = await asyncpg.connect(dsn)
        try:  # nothing written (the schema may have been migrated: no row in it)
            if await conn.fetchval("select to_regclass('changes') is not null"):
                assert await conn.fetchval("select count(*) from changes") == 0
        finally:
            await conn.close()


async def test_the_restore_command_as_pasted(database_url: str, tmp_path: Path) -> None:
    """``toastmachine archive restore --from DIR`` into an empty database, then again: refused."""
    from toastmachine.seed import seed_corpus

    source = await Database.connect(database_url, min_size=1, max_size=2)
    try:
        await apply_migrations(source)
        await seed_corpus(source, messages=10, agents=2, random_seed=5)
        archived = await archive_database(source, ArchiveStore.local(tmp_path / "archive"))
    finally:
        await source.close()
    async with fresh_database(database_url) as dsn:
        env = {**os.environ, "TOASTMACHINE_DATABASE_URL": dsn, "TOASTMACHINE_DATA_DIR": str(tmp_path / "data"),
               "TOASTMACHINE_ARCHIVE_SIGNING_KEY": archived.key.text()}
        # Mistakes first: a mistyped path and an empty directory are usage errors naming the path,
        # nothing is created there, and the database stays empty (the restore below succeeds).
        (tmp_path / "empty").mkdir()
        for wrong, said in (("archiv", b"does not exist"), ("empty", b"no lineage with a manifest.json")):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "toastmachine.cli", "archive", "restore", "--from", str(tmp_path / wrong),
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == 2, (out, err)
            assert said in err and str(tmp_path / wrong).encode() in err and b"Traceback" not in err, err
        assert not (tmp_path / "archiv").exists()
        # A lineage the store does not hold: no archive there either (exit 2), not "does not verify".
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "toastmachine.cli", "archive", "restore", "--from", str(tmp_path / "archive"),
            "--lineage", str(uuid.uuid4()), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await communicate(proc, 120)
        assert proc.returncode == 2 and b"no archive of that lineage" in err, (out, err)
        for expected in (0, 1):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "toastmachine.cli", "archive", "restore", "--from", str(tmp_path / "archive"),
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == expected, (out, err)
            if expected == 0:
                report = orjson.loads(out)
                assert report["provenance"]["parent_lineage"] == str(archived.lineage)
                assert report["provenance"]["checkpoint_root"] == archived.root.hex()
                # Progress on stderr (stdout is the report alone): here one run, so one line, the last.
                changes = report["counts"]["changes"]
                lines = [line for line in err.decode().splitlines() if line.startswith("toastmachine: restore: ")]
                assert lines and lines[-1].startswith(
                    f"toastmachine: restore: {changes:,} of {changes:,} archived changes loaded (100%), "
                    f"through sequence {report['restored_through']:,}, "), err
            else:
                assert b"not empty" in err and archived.key.text().encode() not in err + out
        # A node on the restored database whose data directory lacks the corpus's key (the README's
        # `cp data/archive-signing-key restored/` forgotten) would generate a key of its own and sign
        # the restored history with it: it refuses to start instead (exit 2), saying what to copy.
        forgot = {k: v for k, v in env.items() if k != "TOASTMACHINE_ARCHIVE_SIGNING_KEY"}
        forgot.update(TOASTMACHINE_DATA_DIR=str(tmp_path / "forgot"), TOASTMACHINE_PORT="0", TOASTMACHINE_MCP_PORT="0")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "toastmachine.cli", "up", env=forgot,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await communicate(proc, 120)  # (killed if it does not stop on its own)
        assert proc.returncode == 2, out.decode()[-3000:]
        assert b"TOASTMACHINE_ARCHIVE_SIGNING_KEY" in out and b"copy that file into this DATA_DIR" in out, out[-3000:]
        assert archived.key.verifier().text().encode() in out and b"Traceback" not in out
        assert not (tmp_path / "forgot" / "archive-signing-key").exists()  # the key it made is gone again


def test_the_loader_refuses_events_it_cannot_write_with_the_sequence_named() -> None:
    corpus = str(uuid.uuid4())
    loader = load.HistoryLoader(None, corpus, str(uuid.uuid4()))
    when = "2026-12-02T10:00:00.123Z"
    message = {"id": str(uuid.uuid4()), "conversation_id": str(uuid.uuid4()),
               "author": {"agent_id": str(uuid.uuid4()), "name": "a"}, "kinds": ["claim"], "content": "x",
               "tags": [], "mentions": [], "created_at": when}
    good = {"corpus_id": corpus, "sequence": 7, "type": "message.appended", "partition": 0, "occurred_at": when,
            "data": {"message": message}}
    batch = loader.prepare([(7, good)])
    assert [m[0] for m in batch.messages] == [message["id"]] and batch.changes[0] == [7]
    assert batch.messages[0][-1].isoformat() == "2026-12-02T10:00:00.123000+00:00"
    broken = [
        {**good, "data": {}},  # no message
        {**good, "data": {"message": {**message, "created_at": "2026-12-02 10:00:00"}}},  # not an event time
        {**good, "data": {"message": {**message, "created_at": "2026-02-30T10:00:00.123Z"}}},  # no such day
        {**good, "type": "message.edited"},  # no such change
        {**good, "corpus_id": str(uuid.uuid4())},  # another corpus
        {**good, "data": {"message": {**message, "mentions": [7]}}},  # a mention that is not an agent
        [1, 2],  # not an object
        {**good, "occurred_at": "yesterday"},  # the change's own time, read by the database
        {k: v for k, v in good.items() if k != "occurred_at"},
    ]
    for envelope in broken:
        with pytest.raises(load.LoadRefused, match="change 7 "):
            loader.prepare([(7, envelope)])


async def test_a_value_the_database_refuses_is_a_load_refusal_naming_the_changes(db: Database) -> None:
    """prepare checks each event's shape, not every field's type: a message id that is no UUID
    passes it, and the database's refusal reaches the caller as LoadRefused, not as asyncpg's error."""
    corpus = str(uuid.uuid4())
    when = "2026-12-02T10:00:00.123Z"
    message = {"id": "not-a-uuid", "conversation_id": str(uuid.uuid4()),
               "author": {"agent_id": str(uuid.uuid4()), "name": "a"}, "kinds": ["claim"], "content": "x",
               "tags": [], "mentions": [], "created_at": when}
    event = {"corpus_id": corpus, "sequence": 3, "type": "message.appended", "partition": 0, "occurred_at": when,
             "data": {"message": message}}
    async with db.pool.acquire() as conn, conn.transaction():
        loader = load.HistoryLoader(conn, corpus, str(uuid.uuid4()))
        with pytest.raises(load.LoadRefused, match="from 3 to 3 hold a value the database refuses"):
            await loader.segment([(3, event)])


def test_the_progress_lines_show_each_loads_first_and_last_step_and_one_per_interval(
        capsys: pytest.CaptureFixture[str]) -> None:
    from toastmachine.recovery_cli import PROGRESS_EVERY, progress_printer

    def lines() -> list[str]:
        captured = capsys.readouterr()
        assert captured.out == ""  # stdout is the command's JSON alone
        return captured.err.splitlines()

    show = progress_printer("restore")
    step = PROGRESS_EVERY / 4
    for n in range(1, 10):  # 9 steps over 2 intervals: the first, one per interval, the last
        show(LoadProgress(n * 1000, 9000, n * 1000, n * step))
    shown = lines()
    assert [line.split(" of ")[0] for line in shown] == [
        "toastmachine: restore: 1,000", "toastmachine: restore: 5,000", "toastmachine: restore: 9,000"]
    assert shown[-1].startswith("toastmachine: restore: 9,000 of 9,000 archived changes loaded (100%), "
                                "through sequence 9,000, ")
    # A follower's rounds: a small one says nothing; a catch-up round shows its own first step.
    follow = progress_printer("mirror", min_changes=4000)
    follow(LoadProgress(9500, 9500, 9500, 0.1, changes_at_start=9000))
    assert lines() == []
    follow(LoadProgress(10_000, 20_000, 10_000, 0.1, changes_at_start=9500))
    follow(LoadProgress(11_000, 20_000, 11_000, 0.2, changes_at_start=9500))
    follow(LoadProgress(20_000, 20_000, 20_000, 0.3, changes_at_start=9500))
    caught_up = lines()
    assert [line.split(" of ")[0] for line in caught_up] == ["toastmachine: mirror: 10,000", "toastmachine: mirror: 20,000"]
    # The rate is the round's own: 500 changes in 0.1 s, then 10,500 in 0.3 s (not the whole tree's).
    assert caught_up[0].endswith(" 5,000 changes/s (committed once all is checked)"), caught_up[0]
    assert " 35,000 changes/s " in caught_up[1], caught_up[1]
