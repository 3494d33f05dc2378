"""``archive verify`` on real archives of real databases: clean, lagging, empty, and tampered.

The history is the seeder's (the writer's own row shapes), on both PostgreSQL backends; the archive
goes to a directory and to SeaweedFS. Each tampering is a real change to the stored objects (through
obstore, bypassing the create-only contract, as an attacker with bucket access would) or to the
database (an event edited with the immutability trigger disabled), and verify must name it: kind,
segment index or key, and sequence where one applies. The CLI is run as a process once per store kind.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import obstore
import orjson
import pytest

from actors.recovery.verify import VerifyReport, verify_archive
from actors.recovery.walk import StoreSource
from infra.archive_store import ArchiveStore
from infra.db import Database, ensure_identity
from protocol.archive import HEADER_SIZE, TRAILER_SIZE, checkpoint_key, manifest_page_key
from protocol.checkpoint import Checkpoint, generate_signer_key, sign_checkpoint
from protocol.errors import ConfigError
from tests.archive_fixtures import (
    Archived,
    archive_database,
    raw_store,
    store_fixture,  # noqa: F401 - the ``store`` fixture, on each backend
)
from tests.s3_server import S3Server
from toastmachine.seed import seed_corpus

PER_SEGMENT = 5


async def _archived(db: Database, store: ArchiveStore, messages: int = 20) -> Archived:
    await seed_corpus(db, messages=messages, agents=3, random_seed=7)
    archived = await archive_database(db, store, per_segment=PER_SEGMENT)
    assert len(archived.segments) >= 4
    return archived


async def _verify(db: Database | None, store: ArchiveStore, archived: Archived, *, pinned: bool = True,
                  archiver_store: bool = True) -> VerifyReport:
    return await verify_archive(StoreSource(store), archived.lineage,
                                trusted=archived.key.verifier() if pinned else None, db=db,
                                archiver_store=archiver_store)


def _kinds(report: VerifyReport) -> set[str]:
    return {f.kind for f in report.findings}


async def test_a_faithful_archive_verifies_against_the_database(db: Database, store: ArchiveStore) -> None:
    archived = await _archived(db, store)
    report = await _verify(db, store, archived)
    assert report.ok, report.to_json()
    body = report.to_json()
    assert body["archive"]["root"] == archived.root.hex()
    assert body["archive"]["tree_size"] == archived.size == body["archive"]["events_checked"]
    assert body["archive"]["checkpoints_checked"] == len(archived.segments)
    assert body["archive"]["key_source"] == "pinned"
    assert body["database"]["compared"] == archived.size and body["database"]["lag_events"] == 0
    # Trusting the archive's own key still verifies, but says it was not pinned.
    assert (await _verify(db, store, archived, pinned=False)).to_json()["archive"]["key_source"].startswith("archive")


async def test_an_archive_with_more_checkpoints_than_a_walk_reads_still_verifies_and_restores(
        db: Database, store: ArchiveStore, database_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An archiver publishes a checkpoint per sealed segment, so a long-lived archive holds more than
    a walk reads (MAX_CHECKPOINTS, lowered here to 2): the newest are checked, the older ones are
    counted as skipped, and that is no finding: the archive still verifies and restores (it used to
    fail both once past 10,000 checkpoints, about a week of a steady trickle of writes)."""
    from actors.recovery import walk
    from actors.recovery.restore import restore_archive
    from infra.db import apply_migrations
    from tests.db_fixtures import fresh_database

    archived = await _archived(db, store)
    monkeypatch.setattr(walk, "MAX_CHECKPOINTS", 2)
    report = await _verify(db, store, archived)
    assert report.ok, report.to_json()
    body = report.to_json()["archive"]
    assert (body["checkpoints_checked"], body["checkpoints_skipped"]) == (2, len(archived.segments) - 2)
    async with fresh_database(database_server) as dsn:
        target = await Database.connect(dsn, min_size=1, max_size=2)
        try:
            await apply_migrations(target)
            restored = await restore_archive(StoreSource(store), archived.lineage, target,
                                             trusted=archived.key.verifier())
            assert restored.restored_through == archived.size
        finally:
            await target.close()


async def test_the_database_ahead_of_the_archive_is_lag_not_failure(db: Database, store: ArchiveStore) -> None:
    archived = await _archived(db, store)
    added = await seed_corpus(db, messages=3, agents=2, random_seed=8)
    report = await _verify(db, store, archived)
    assert report.ok, report.to_json()
    assert report.database is not None and report.database.lag_events == added.changes


async def test_a_store_behind_what_the_database_records_published_is_not_mere_lag(
        db: Database, store: ArchiveStore) -> None:
    """The database records the checkpoints the archiver published. A store whose newest checkpoint
    is older (another store than the archiver wrote to, or objects lost from it) is reported as
    such, not as lag with ``ok`` true; a recorded checkpoint of the store's size with another root
    is a mismatch; one the store holds as recorded is fine."""
    archived = await _archived(db, store)
    added = await seed_corpus(db, messages=3, agents=2, random_seed=8)
    record = "insert into archive_checkpoints (stream, tree_size, root, note) values (0, $1, $2, 'n')"
    await db.pool.execute(record, archived.size, archived.root)  # what the store holds: no finding
    assert (await _verify(db, store, archived)).ok
    await db.pool.execute(record, archived.size + added.changes, bytes(32))
    report = await _verify(db, store, archived)
    assert _kinds(report) == {"archive_behind_database"}, report.to_json()
    assert f"size {archived.size + added.changes} as published" in report.findings[0].message
    # A copy named by --from-store (a replica, a backup) may lag: lag it is, as before.
    copy = await _verify(db, store, archived, archiver_store=False)
    assert copy.ok and copy.database is not None and copy.database.lag_events == added.changes
    # A store whose checkpoints could not be read is reported as such, not also as behind.
    await obstore.delete_async(raw_store(store), f"{archived.lineage}/public-key.txt")
    unread = await _verify(db, store, archived, pinned=False)
    assert "archive_behind_database" not in _kinds(unread) and "missing_public_key" in _kinds(unread), \
        unread.to_json()
    await store.put(f"{archived.lineage}/public-key.txt", (archived.key.verifier().text() + "\n").encode())
    await db.pool.execute("delete from archive_checkpoints")
    await db.pool.execute(record, archived.size, bytes(32))
    assert _kinds(await _verify(db, store, archived)) == {"checkpoint_mismatch"}


async def test_an_empty_or_absent_archive_verifies_nothing_and_fails(db: Database, tmp_path: Path) -> None:
    store = ArchiveStore.local(tmp_path / "empty")
    await ensure_identity(db, None, None)
    archived = await archive_database(db, store)  # no changes: a manifest without segments
    report = await _verify(db, store, archived)
    assert "nothing_verified" in _kinds(report) and not report.ok
    other = await verify_archive(StoreSource(ArchiveStore.local(tmp_path / "none")), archived.lineage, db=db)
    assert "missing_manifest" in _kinds(other) and not other.ok


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of every frame of a segment."""
    out, pos = [], HEADER_SIZE
    while pos < len(data) - TRAILER_SIZE:
        (length,) = struct.unpack_from(">I", data, pos)
        out.append((pos, 16 + length))
        pos += 16 + length
    return out


def _swap_first_frames(data: bytes) -> bytes:
    (a_at, a_len), (b_at, b_len) = _frames(data)[:2]
    return data[:a_at] + data[b_at:b_at + b_len] + data[a_at:a_at + a_len] + data[b_at + b_len:]


async def _rewrite(store: ArchiveStore, key: str, change: Callable[[bytes], bytes]) -> None:
    data = await store.get(key)
    await obstore.put_async(raw_store(store), key, change(data))


Tamper = Callable[[Database, ArchiveStore, Archived], Awaitable[Any]]


async def _flip_byte(db: Database, store: ArchiveStore, a: Archived) -> None:
    offset = HEADER_SIZE + 12 + 5  # inside the first frame's event bytes
    await _rewrite(store, a.segment_key(1), lambda d: d[:offset] + bytes([d[offset] ^ 0x20]) + d[offset + 1:])


async def _delete_segment(db: Database, store: ArchiveStore, a: Archived) -> None:
    await obstore.delete_async(raw_store(store), a.segment_key(2))


async def _extra_object(db: Database, store: ArchiveStore, a: Archived) -> None:
    await store.put(f"{a.lineage}/segments/stray", b"not a segment")


async def _reorder_pair(db: Database, store: ArchiveStore, a: Archived) -> None:
    await _rewrite(store, a.segment_key(1), _swap_first_frames)


async def _truncate(db: Database, store: ArchiveStore, a: Archived) -> None:
    await _rewrite(store, a.segment_key(3), lambda d: d[:len(d) // 2])


async def _forge_signature(db: Database, store: ArchiveStore, a: Archived) -> None:
    key = checkpoint_key(a.lineage, a.size)

    def forge(note: bytes) -> bytes:
        text = note.decode()
        # Another root under the same signature: the signature no longer matches the text.
        lines = text.split("\n")
        lines[2] = "A" * 43 + "="
        return "\n".join(lines).encode()

    await _rewrite(store, key, forge)


async def _fork_older_checkpoint(db: Database, store: ArchiveStore, a: Archived) -> None:
    size = a.segments[0].event_count
    # Validly signed by the trusted key, but for a history the newer checkpoints do not extend.
    forged = sign_checkpoint(Checkpoint(a.key.name, size, bytes(32)), a.key)
    await obstore.put_async(raw_store(store), checkpoint_key(a.lineage, size), forged.encode())


async def _edit_database_event(db: Database, store: ArchiveStore, a: Archived) -> int:
    sequence = a.segments[2].events[1].sequence
    async with db.pool.acquire() as conn, conn.transaction():
        await conn.execute("alter table changes disable trigger changes_no_update_or_delete")
        await conn.execute("update changes set event = replace(event, '\"partition\":', '\"partition\": ') "
                           "where sequence = $1", sequence)
        event = orjson.loads(await conn.fetchval("select event from changes where sequence = $1", sequence))
        event["occurred_at"] = "2000-01-01T00:00:00.000Z"
        await conn.execute("update changes set event = $2 where sequence = $1", sequence, orjson.dumps(event).decode())
        await conn.execute("alter table changes enable trigger changes_no_update_or_delete")
    return sequence


def _first_page(a: Archived) -> str:
    return manifest_page_key(a.lineage, 0, 2)  # the fixtures' archiver writes pages of 3 segments


async def _flip_page_byte(db: Database, store: ArchiveStore, a: Archived) -> None:
    await _rewrite(store, _first_page(a), lambda d: d.replace(b'"event_count": ', b'"event_count":  ', 1))


async def _delete_page(db: Database, store: ArchiveStore, a: Archived) -> None:
    await obstore.delete_async(raw_store(store), _first_page(a))


async def _extra_page(db: Database, store: ArchiveStore, a: Archived) -> None:
    await store.put(manifest_page_key(a.lineage, 9_000, 9_002), b"{}")


#: (tampering, the finding kind, the segment index it is about or None, whether the key names it).
TAMPERINGS: dict[str, tuple[Tamper, str, int | None]] = {
    "flipped_byte": (_flip_byte, "crc_mismatch", 1),
    "missing_segment": (_delete_segment, "missing_segment", 2),
    "extra_object": (_extra_object, "orphan_object", None),
    "reordered_pair": (_reorder_pair, "sequence_order", 1),
    "truncated_segment": (_truncate, "truncated", 3),
    "wrong_signature": (_forge_signature, "bad_signature", None),
    "not_extending": (_fork_older_checkpoint, "does_not_extend", None),
    "database_edited": (_edit_database_event, "event_mismatch", None),
    "manifest_page_changed": (_flip_page_byte, "invalid_manifest", None),
    "manifest_page_missing": (_delete_page, "missing_manifest_page", None),
    "manifest_page_extra": (_extra_page, "orphan_object", None),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
async def test_each_tampering_is_reported_precisely(db: Database, store: ArchiveStore, name: str) -> None:
    tamper, kind, index = TAMPERINGS[name]
    archived = await _archived(db, store)
    assert (await _verify(db, store, archived)).ok
    detail = await tamper(db, store, archived)
    report = await _verify(db, store, archived)
    assert not report.ok
    found = [f for f in report.findings if f.kind == kind]
    assert found, report.to_json()
    if index is not None:
        assert found[0].index == index and found[0].key == archived.segment_key(index)
    if name == "flipped_byte":
        assert found[0].offset == HEADER_SIZE and found[0].sequence == archived.segments[1].events[0].sequence
    if name == "reordered_pair":
        assert found[0].sequence == archived.segments[1].events[0].sequence
    if name == "extra_object":
        assert found[0].key == f"{archived.lineage}/segments/stray"
    if name in ("manifest_page_missing", "manifest_page_changed"):
        assert _first_page(archived) in (found[0].key or "") + found[0].message, found[0]
    if name == "manifest_page_extra":
        assert found[0].key == manifest_page_key(archived.lineage, 9_000, 9_002)
    if name == "wrong_signature":
        assert found[0].key == checkpoint_key(archived.lineage, archived.size)
    if name == "not_extending":
        assert found[0].key == checkpoint_key(archived.lineage, archived.segments[0].event_count)
    if name == "database_edited":
        assert [f.sequence for f in found] == [detail]
        assert report.database is not None and report.database.counts == {"event_mismatch": 1}
    else:
        # A broken segment is not compared with the database, and nothing else is blamed on it.
        assert not {"event_mismatch", "not_archived", "missing_in_database"} & _kinds(report), report.to_json()


async def test_a_key_other_than_the_pinned_one_is_refused(db: Database, store: ArchiveStore) -> None:
    archived = await _archived(db, store)
    stranger = generate_signer_key(archived.key.name).verifier()
    report = await verify_archive(StoreSource(store), archived.lineage, trusted=stranger, db=db)
    assert {"public_key_mismatch", "not_signed_by_key"} <= _kinds(report)


# --- the command, as an operator runs it ----------------------------------------------------------


async def _run_cli(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "toastmachine.cli", *args, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, orjson.loads(out) if out.strip() else {}, err.decode()


async def test_the_cli_exits_zero_when_clean_and_one_on_a_discrepancy(
        database_url: str, tmp_path: Path, s3_server: S3Server) -> None:
    db = await Database.connect(database_url, min_size=1, max_size=2)
    try:
        from infra.db import apply_migrations

        await apply_migrations(db)
        local = ArchiveStore.local(tmp_path / "archive")
        server = s3_server
        prefix = "cli-" + os.urandom(4).hex()
        remote = server.store(prefix)
        archived = await _archived(db, local)
        await archive_database(db, remote, key=archived.key)
        env = {"TOASTMACHINE_DATABASE_URL": database_url, "TOASTMACHINE_DATA_DIR": str(tmp_path / "data"),
               "TOASTMACHINE_ARCHIVE_S3_ENDPOINT": server.endpoint, "TOASTMACHINE_ARCHIVE_S3_REGION": "us-east-1",
               "TOASTMACHINE_ARCHIVE_S3_ACCESS_KEY_ID": server.access_key_id,
               "TOASTMACHINE_ARCHIVE_S3_SECRET_ACCESS_KEY": server.secret_access_key,
               "TOASTMACHINE_ARCHIVE_SIGNING_KEY": archived.key.text()}
        remote_url = f"s3://{server.bucket}/{prefix}"
        for url in (str(tmp_path / "archive"), remote_url):
            code, report, err = await _run_cli(env, "archive", "verify", "--from-store", url)
            assert code == 0 and report["ok"], (report, err)
            assert report["archive"]["key_source"] == "pinned"
            assert server.secret_access_key not in err and archived.key.text() not in err
        await _delete_segment(db, remote, archived)
        code, report, _ = await _run_cli(env, "archive", "verify", "--from-store", remote_url)
        assert code == 1 and report["findings"][0]["kind"] == "missing_segment", report
        code, report, _ = await _run_cli(env, "archive", "verify", "--from-store", str(tmp_path / "nothing"))
        assert code == 1 and report["findings"][0]["kind"] == "nothing_verified"
        assert "does not exist" in report["findings"][0]["message"], report
        assert not (tmp_path / "nothing").exists(), "a verifier only reads: a mistyped path is not created"
    finally:
        await db.close()


async def test_the_private_stream_is_verified_too(db: Database, store: ArchiveStore) -> None:
    archived = await _archived(db, store)
    report = await _verify(db, store, archived)
    assert report.ok and report.private is not None and report.private["records_checked"] >= 3
    key = min([o.key async for o in store.list(f"{archived.lineage}/private/segments")])
    offset = HEADER_SIZE + 12 + 3
    await _rewrite(store, key, lambda d: d[:offset] + bytes([d[offset] ^ 0x01]) + d[offset + 1:])
    report = await _verify(db, store, archived)
    found = [f for f in report.findings if f.kind == "crc_mismatch"]
    assert found and found[0].key == key and found[0].index == 0, report.to_json()


def test_the_public_key_option_says_what_is_wrong(tmp_path: Path) -> None:
    """``--public-key`` takes the key or a file holding it; each mistake is named, never a traceback."""
    from toastmachine.recovery_cli import pinned_key

    key = generate_signer_key("toastmachine.archive/test").verifier()
    (tmp_path / "public-key.txt").write_text(key.text() + "\n")
    assert pinned_key(str(tmp_path / "public-key.txt")) == pinned_key(key.text()) == key
    (tmp_path / "junk.txt").write_text("not a key\n")
    (tmp_path / "latin.txt").write_bytes(b"\xff\xfe")
    for value, said in ((str(tmp_path / "missing.txt"), "No such file or directory"),
                        (str(tmp_path / "junk.txt"), "the file does not hold a verifier key"),
                        (str(tmp_path / "latin.txt"), "not UTF-8 text"),
                        (str(tmp_path), "Is a directory"),
                        ("name+0011+AAAA", "--public-key: ")):
        with pytest.raises(ConfigError) as info:
            pinned_key(value)
        assert said in str(info.value), (value, str(info.value))


@pytest.mark.parametrize("poll", ["0", "-1", "nan", "abc", "7200"])
def test_the_mirror_poll_option_refuses_what_would_spin_or_stall(poll: str) -> None:
    from toastmachine.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["mirror", "--from", "x", "--public-key", "k", "--poll", poll])
    assert info.value.code == 2
