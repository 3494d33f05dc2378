"""The archiver as real OS processes (its Procfile line) on PostgreSQL and RabbitMQ: a second archiver
stays standby; ``kill -9`` of the active one mid-upload and then of its successor mid-verify; after
each take-over every segment is in the store once, verified, linked, and exactly the history.

Both kills land at a known point, however fast or slow the machine: the first while the store
refuses every upload (a file where a directory must be), the second while the successor's
statement recording a verification waits at a gate the test holds (:class:`VerifyGate`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from actors.archiver import active_archiver, application_name
from infra.archive_store import ArchiveStore
from protocol.archive import (
    Stream,
    checkpoint_key,
    decode_segment,
    manifest_key,
    parse_segment_key,
    public_key_key,
)
from protocol.manifest import decode_manifest
from tests import procs
from tests.corpus_fixtures import STACK_ENV, running_stack
from tests.deployment import WAIT, Deployment, deployment
from tests.s3_server import S3Server

#: Changes written before the archivers start: 2 per segment, so 300 segments to cut (in batches of
#: two), enough work after the store comes back for the second kill to land mid-verify.
CHANGES = 600


async def holder(database_url: str) -> str | None:
    conn = await asyncpg.connect(database_url)
    try:
        return await active_archiver(conn)
    finally:
        await conn.close()


async def kill_when(dep: Deployment, database_url: str, state: str) -> str:
    """SIGKILL the active archiver as soon as a segment is in ``state`` (sealed: its upload is
    under way; written: its read-back is), with segments still left to do; return its name."""
    conn = await asyncpg.connect(database_url)
    try:
        async with asyncio.timeout(WAIT):
            while True:
                name = await active_archiver(conn)
                found = await conn.fetchval("select count(*) from archive_segments where state = $1", state)
                if name is not None and found:
                    node = name.split(":", 1)[1]
                    dep.processes[node].signal(signal.SIGKILL)
                    break
                await asyncio.sleep(0.002)
        remaining = await conn.fetchval("select count(*) from archive_segments where state <> 'published'")
        assert remaining, "the kill did not land while there was work left"
        await dep.processes[node].wait(timeout=WAIT)
        return node
    finally:
        await conn.close()


#: The advisory lock key of the verify gate (any number the product does not use).
GATE_LOCK = 7_700_011


class VerifyGate:
    """A test-only trigger on ``archive_segments``: the statement that records segments verified
    waits for an advisory lock this gate holds, then fails if its session is the one the gate was
    poisoned with. So an archiver can be killed with its segments read back and checked but not yet
    recorded verified, and what its dead session had sent is rolled back, not committed after its
    death; its successor's statements pass."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def wait_until_held(self) -> int:
        """Wait until a statement waits at the gate; the backend's process id."""
        async with asyncio.timeout(WAIT):
            while True:
                pid = await self.conn.fetchval(
                    "select pid from pg_locks where locktype = 'advisory' and not granted and objid = $1",
                    GATE_LOCK)
                if pid is not None:
                    return int(pid)
                await asyncio.sleep(0.01)

    async def poison_and_open(self, pid: int) -> None:
        """Open the gate, failing the statement of backend ``pid`` that waits at it."""
        await self.conn.execute("update archive_test_gate set poisoned = $1", pid)
        await self.conn.execute("select pg_advisory_unlock($1)", GATE_LOCK)


@contextlib.asynccontextmanager
async def verify_gate(database_url: str) -> AsyncIterator[VerifyGate]:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f"""
            create table archive_test_gate (poisoned integer);
            insert into archive_test_gate values (null);
            create function archive_test_hold() returns trigger language plpgsql as $$
            begin
              perform pg_advisory_xact_lock({GATE_LOCK});
              if (select poisoned from archive_test_gate) = pg_backend_pid() then
                raise exception 'the archiver recording this was killed';
              end if;
              return new;
            end $$;
            create trigger archive_test_hold before update on archive_segments for each row
              when (old.state = 'written' and new.state = 'verified') execute function archive_test_hold();
            select pg_advisory_lock({GATE_LOCK});""")
        yield VerifyGate(conn)
    finally:
        try:
            # Open the gate first: a statement still waiting at it holds a lock the drop needs.
            await conn.execute("select pg_advisory_unlock_all()")
            await conn.execute("drop trigger if exists archive_test_hold on archive_segments; "
                               "drop function if exists archive_test_hold(); drop table if exists archive_test_gate")
        finally:
            await conn.close()


async def all_published(database_url: str, expected: int) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        async with asyncio.timeout(WAIT * 2):
            while await conn.fetchval("select count(*) from archive_segments where stream = 0 "
                                      "and state = 'published'") < expected:
                await asyncio.sleep(0.1)
    finally:
        await conn.close()


@pytest.mark.fault
@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.timeout(300)
async def test_kill_9_mid_upload_and_mid_verify_take_over_and_every_segment_is_written_once(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    async with running_stack(database_url, rabbitmq_url, STACK_ENV) as stack:
        agent = await stack.register()
        first = await stack.conversation(agent)
        cid = first["conversation"]["id"]
        for _ in range(CHANGES - 1):
            await stack.message(agent, cid, content="archived")
        lineage = stack.identity.lineage
    # Batches of two segments: 60 of them, so the kills land inside one (a sealed or a written batch).
    env = {"TOASTMACHINE_ARCHIVE_SEGMENT_EVENTS": "2", "TOASTMACHINE_ARCHIVE_SEGMENT_SECONDS": "3600",
           "TOASTMACHINE_ARCHIVE_BATCH_SEGMENTS": "2"}
    # The store refuses every segment until the first kill: a plain file stands where the lineage's
    # segments directory must be created (a real failure of the directory store, even for root),
    # so the first active archiver seals its first batch and is still retrying its upload when it
    # is killed, however fast or slow this machine is.
    blocker = tmp_path / "archive" / str(lineage) / "segments"
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"not a directory\n")
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep, verify_gate(database_url) as gate:
        await dep.start("archiver", "arch-a", **env)
        await dep.start("archiver", "arch-b", **env)
        async with asyncio.timeout(WAIT):
            while await holder(database_url) is None:
                await asyncio.sleep(0.05)
        active = (await holder(database_url) or "").split(":", 1)[1]
        standby = ({"arch-a", "arch-b"} - {active}).pop()
        await dep.processes[standby].wait_for_line(r"archiver\.standby", timeout=WAIT)

        killed = await kill_when(dep, database_url, "sealed")
        assert killed == active
        blocker.unlink()  # the store is back for the successor
        await dep.processes[standby].wait_for_line(r"archiver\.active", timeout=WAIT)
        assert await holder(database_url) == application_name(standby)
        await dep.start("archiver", "arch-c", **env)
        await dep.processes["arch-c"].wait_for_line(r"archiver\.standby", timeout=WAIT)

        # Mid-verify: the successor wrote its first batch, read it back and checked it, and waits
        # at the gate to record it verified.
        waiting = await gate.wait_until_held()
        written = await gate.conn.fetchval("select count(*) from archive_segments where state = 'written'")
        assert written and await gate.conn.fetchval(  # and history left to archive after them
            "select (select max(sequence) from changes) > (select max(last_sequence) from archive_segments)")
        dep.processes[standby].signal(signal.SIGKILL)
        await dep.processes[standby].wait(timeout=WAIT)
        await gate.poison_and_open(waiting)  # the dead session's statement fails: nothing it sent commits
        await dep.processes["arch-c"].wait_for_line(r"archiver\.active", timeout=WAIT)
        await all_published(database_url, CHANGES // 2)
        # The batch the killed archiver had checked was verified again by its successor.
        await dep.processes["arch-c"].wait_for_line(r"archiver\.verified\s.*\bindex=0\s.*stream=public", timeout=WAIT)

    store = ArchiveStore.local(tmp_path / "archive")
    conn = await asyncpg.connect(database_url)
    try:
        history = [r["sequence"] for r in await conn.fetch("select sequence from changes order by sequence")]
        rows = await conn.fetch("select segment_index, first_sequence, last_sequence, hash, state from "
                                "archive_segments where stream = 0 order by segment_index")
    finally:
        await conn.close()
    assert {r["state"] for r in rows} == {"published"} and len(rows) == CHANGES // 2
    keys = sorted([o.key async for o in store.list(f"{lineage}/segments")])
    assert len(keys) == len(rows)  # one object per segment: nothing written twice under other names
    previous = None
    archived: list[int] = []
    for row, key in zip(rows, keys, strict=True):
        parsed = parse_segment_key(key)
        assert parsed is not None and (parsed.index, parsed.first_sequence, parsed.last_sequence) == (
            row["segment_index"], row["first_sequence"], row["last_sequence"])
        seg = decode_segment(await store.get(key), expected_previous_hash=previous,
                             expected_lineage=uuid.UUID(str(lineage)), expected_index=row["segment_index"],
                             expected_stream=Stream.PUBLIC)
        assert seg.hash == bytes(row["hash"])
        previous = seg.hash
        archived += [e.sequence for e in seg.events]
    assert archived == history
    manifest = decode_manifest(await store.get(manifest_key(uuid.UUID(str(lineage)))))
    assert [s.hash for s in manifest.segments] == [bytes(r["hash"]).hex() for r in rows]


@pytest.mark.timeout(180)
async def test_up_archives_to_the_data_directory_and_archive_status_reports_it(tmp_path: Path) -> None:
    """``toastmachine up`` on its defaults archives to DATA_DIR/archive; ``archive status`` reports it."""
    import json

    import aiohttp


    data = tmp_path / "data"
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(data), TOASTMACHINE_PORT="0",
                          TOASTMACHINE_ARCHIVE_SEGMENT_SECONDS="0.2")
    node = await procs.start("up", env=env)
    try:
        url = await node.wait_listening(timeout=30)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/register", json={"name": "archivist"}) as resp:
                credential = (await resp.json())["credential"]
            auth = {"Authorization": f"Bearer {credential}"}
            async with http.get(url + "/guide", headers=auth) as resp:
                assert resp.status == 200
            async with http.post(url + "/conversations", json={"subject": "s", "content": "c"},
                                 headers={**auth, "Operation-Token": str(uuid.uuid4())}) as resp:
                sequence = (await resp.json())["sequence"]
            async with asyncio.timeout(WAIT):
                while True:
                    async with http.get(url + "/corpus/archive") as resp:
                        body = await resp.json()
                    if body["verified_through"] >= sequence and body["checkpoint"]:
                        break
                    await asyncio.sleep(0.1)
            async with http.get(url + "/metrics") as resp:
                metrics = await resp.text()
            assert "toastmachine_archive_lag_events" in metrics and "toastmachine_archiver_active 1.0" in metrics
        segment = body["segments"][0]["name"]
        assert (data / "archive" / body["lineage"] / "segments" / segment).is_file()
    finally:
        assert await node.stop() == 0, "\n".join(node.output)
    status = await procs.start("archive", "status", env=env)
    assert await status.wait() == 0, "\n".join(status.output)
    start = status.output.index("{")  # log lines of the embedded database come first
    report = json.loads("\n".join(status.output[start:]))
    assert report["public"]["verified_through"] == sequence
    assert report["public"]["segments"] == {"published": 1}
    assert report["active_archiver"] is None and report["lag_events"] == 0


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.timeout(180)
async def test_the_procfile_archiver_archives_to_an_s3_compatible_store(
        tmp_path: Path, rabbitmq_url: str, database_url: str, s3_server: S3Server) -> None:
    """The Procfile's archiver line against SeaweedFS (``s3://bucket/prefix`` and the S3 settings)."""
    async with running_stack(database_url, rabbitmq_url, STACK_ENV) as stack:
        agent = await stack.register()
        first = await stack.conversation(agent)
        for _ in range(4):
            await stack.message(agent, first["conversation"]["id"], content="to s3")
        lineage = uuid.UUID(str(stack.identity.lineage))
    prefix = f"procfile-{uuid.uuid4().hex[:8]}"
    env = {"TOASTMACHINE_ARCHIVE_URL": f"s3://{s3_server.bucket}/{prefix}",
           "TOASTMACHINE_ARCHIVE_S3_ENDPOINT": s3_server.endpoint, "TOASTMACHINE_ARCHIVE_S3_REGION": "us-east-1",
           "TOASTMACHINE_ARCHIVE_S3_ACCESS_KEY_ID": s3_server.access_key_id,
           "TOASTMACHINE_ARCHIVE_S3_SECRET_ACCESS_KEY": s3_server.secret_access_key,
           "TOASTMACHINE_ARCHIVE_SEGMENT_EVENTS": "2", "TOASTMACHINE_ARCHIVE_SEGMENT_SECONDS": "0.2"}
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
        proc = await dep.start("archiver", "arch-s3", **env)
        await all_published(database_url, 3)  # 5 changes: 2 + 2 + 1 (the last one sealed by age)
        assert s3_server.secret_access_key not in "\n".join(proc.output)
    store = s3_server.store(prefix)
    manifest = decode_manifest(await store.get(manifest_key(lineage)))
    previous = None
    for entry in manifest.segments:
        seg = decode_segment(await store.get(f"{lineage}/segments/{entry.index:010d}-{entry.first_sequence:019d}-"
                                             f"{entry.last_sequence:019d}"), expected_previous_hash=previous)
        previous = seg.hash
    assert [s.event_count for s in manifest.segments] == [2, 2, 1]


async def _seeded(database_url: str, rabbitmq_url: str, messages: int) -> tuple[uuid.UUID, uuid.UUID]:
    """A corpus with a conversation and ``messages`` more messages; its corpus id and lineage."""
    async with running_stack(database_url, rabbitmq_url, STACK_ENV) as stack:
        agent = await stack.register()
        first = await stack.conversation(agent)
        for _ in range(messages):
            await stack.message(agent, first["conversation"]["id"], content="signed")
        return uuid.UUID(str(stack.identity.corpus_id)), uuid.UUID(str(stack.identity.lineage))


def _machine(tmp_path: Path, name: str, archive: Path, **env: str) -> dict[str, str]:
    """The settings of an archiver on a machine of its own: its own data directory (so its own
    signing key unless one is given), the deployment's shared archive."""
    return {"TOASTMACHINE_DATA_DIR": str(tmp_path / name), "TOASTMACHINE_ARCHIVE_URL": str(archive),
            "TOASTMACHINE_ARCHIVE_SEGMENT_EVENTS": "2", "TOASTMACHINE_ARCHIVE_SEGMENT_SECONDS": "0.2", **env}


@contextlib.asynccontextmanager
async def _reaped(proc: procs.NodeProcess) -> AsyncIterator[None]:
    """A process the deployment does not stop (one that must exit on its own), killed if the block
    fails while it still runs."""
    try:
        yield
    finally:
        if proc.proc.returncode is None:
            proc.signal(signal.SIGKILL)
            await proc.wait(timeout=WAIT)


async def _refused(dep: Deployment, name: str, env: dict[str, str], *, exited_before_start: bool) -> str:
    """Start an archiver that must stop with exit 2 for its key; what it printed."""
    proc = await procs.start(env={**dep.env, "TOASTMACHINE_NODE_ID": name, **env},
                             program=("/bin/sh", "-c", dep.commands["archiver"]))
    async with _reaped(proc):
        assert await proc.wait(timeout=WAIT) == 2, "\n".join(proc.output)
    output = "\n".join(proc.output)
    assert ("ToastMachine running archiver" not in output) == exited_before_start, output
    assert "TOASTMACHINE_ARCHIVE_SIGNING_KEY" in output and "is not the one that signs this corpus" in output
    assert not procs.unexpected_tracebacks(proc.output), output
    assert "PRIVATE+KEY" not in output  # the secret half of neither key
    return output


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.timeout(180)
async def test_an_archiver_with_a_key_of_its_own_is_refused_at_start_and_the_corpus_key_takes_over(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """Archivers on two machines (data directories of their own) and one shared archive: the second,
    with the key its own data directory generated, exits 2 at start naming
    TOASTMACHINE_ARCHIVE_SIGNING_KEY (before, it stood by and met a fork alarm on public-key.txt
    at take-over, archiving nothing); given the corpus's key it stands by, takes over when the
    first is killed, and its checkpoints verify against the one published key."""
    from protocol.checkpoint import parse_verifier_key, verify_checkpoint

    _, lineage = await _seeded(database_url, rabbitmq_url, 3)
    archive = tmp_path / "archive"
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
        await dep.start("archiver", "arch-a", **_machine(tmp_path, "a", archive))
        await all_published(database_url, 2)
        await _refused(dep, "arch-b", _machine(tmp_path, "b", archive), exited_before_start=True)
        # The key it generated on the way is gone again: no unused key is left to be backed up.
        assert (tmp_path / "b").is_dir() and not (tmp_path / "b" / "archive-signing-key").exists()

        corpus_key = (tmp_path / "a" / "archive-signing-key").read_text().strip()
        await dep.start("archiver", "arch-c",
                        **_machine(tmp_path, "c", archive, TOASTMACHINE_ARCHIVE_SIGNING_KEY=corpus_key))
        await dep.processes["arch-c"].wait_for_line(r"archiver\.standby", timeout=WAIT)
        assert not (tmp_path / "c" / "archive-signing-key").exists()  # the configured key, no other
        dep.processes["arch-a"].signal(signal.SIGKILL)
        await dep.processes["arch-c"].wait_for_line(r"archiver\.active", timeout=WAIT)
        async with running_stack(database_url, rabbitmq_url, STACK_ENV) as stack:
            agent = await stack.register()
            second = await stack.conversation(agent)
            await stack.message(agent, second["conversation"]["id"], content="after the take-over")
        await all_published(database_url, 3)  # 4 changes, then 2 more: 3 segments of 2

    store = ArchiveStore.local(archive)
    verifier = parse_verifier_key((await store.get(public_key_key(lineage))).decode())
    size = sum(s.event_count for s in decode_manifest(await store.get(manifest_key(lineage))).segments)
    assert size == 6
    verify_checkpoint(await store.get(checkpoint_key(lineage, size)), verifier)


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.timeout(180)
async def test_a_key_published_while_a_standby_waited_stops_it_before_it_signs(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """A standby that started on an archive with no public key yet (two archivers deployed at once)
    checks again when it becomes active: another key's public key there stops it with exit 2
    before it seals or signs anything."""
    from actors.archiver import ARCHIVER_LOCK
    from infra.archive_keys import archive_origin
    from protocol.checkpoint import generate_signer_key

    corpus_id, lineage = await _seeded(database_url, rabbitmq_url, 1)
    archive = tmp_path / "archive"
    lock = await asyncpg.connect(database_url)  # the lock held, as by an active archiver elsewhere
    try:
        await lock.execute("select pg_advisory_lock($1)", ARCHIVER_LOCK)
        async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
            env = _machine(tmp_path, "b", archive, TOASTMACHINE_NODE_ID="arch-b")
            proc = await procs.start(env={**dep.env, **env}, program=("/bin/sh", "-c", dep.commands["archiver"]))
            async with _reaped(proc):
                await proc.wait_for_line(r"archiver\.standby", timeout=WAIT)
                other = generate_signer_key(archive_origin(corpus_id))
                await ArchiveStore.local(archive).put(public_key_key(lineage),
                                                      (other.verifier().text() + "\n").encode())
                await lock.execute("select pg_advisory_unlock($1)", ARCHIVER_LOCK)
                assert await proc.wait(timeout=WAIT) == 2, "\n".join(proc.output)
            output = "\n".join(proc.output)
            assert other.verifier().text() in output and "TOASTMACHINE_ARCHIVE_SIGNING_KEY" in output
            assert not procs.unexpected_tracebacks(proc.output), output
        assert await lock.fetchval("select count(*) from archive_segments") == 0
        assert [o.key async for o in ArchiveStore.local(archive).list(f"{lineage}/checkpoints")] == []
    finally:
        await lock.close()


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.timeout(180)
async def test_a_standby_with_its_own_key_stops_when_the_first_archiver_records_the_corpus_key(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """Two archivers of a fresh corpus deployed together on separate data directories: the second
    started before any key was recorded, so its start check passed; while it stands by it watches
    the database, and stops (exit 2) as soon as the active one records the corpus's key, instead of
    failing only when it has to take over."""
    from actors.archiver import ARCHIVER_LOCK
    from infra.archive_keys import archive_origin
    from protocol.checkpoint import generate_signer_key

    corpus_id, _ = await _seeded(database_url, rabbitmq_url, 1)
    lock = await asyncpg.connect(database_url)  # the lock held, as by an archiver about to record its key
    try:
        await lock.execute("select pg_advisory_lock($1)", ARCHIVER_LOCK)
        async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
            env = _machine(tmp_path, "b", tmp_path / "archive", TOASTMACHINE_NODE_ID="arch-b")
            proc = await procs.start(env={**dep.env, **env}, program=("/bin/sh", "-c", dep.commands["archiver"]))
            async with _reaped(proc):
                await proc.wait_for_line(r"archiver\.standby", timeout=WAIT)
                first = generate_signer_key(archive_origin(corpus_id))
                await lock.execute("insert into archive_signing_key (public_key) values ($1)", first.verifier().text())
                assert await proc.wait(timeout=WAIT) == 2, "\n".join(proc.output)
            output = "\n".join(proc.output)
            assert first.verifier().text() in output and "TOASTMACHINE_ARCHIVE_SIGNING_KEY" in output
            assert "archiver.active" not in output and not procs.unexpected_tracebacks(proc.output), output
            assert not (tmp_path / "b" / "archive-signing-key").exists()  # the key it had made is gone
    finally:
        await lock.close()
