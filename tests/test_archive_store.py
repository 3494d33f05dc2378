"""The archive object store, against a real directory and two real S3 servers (SeaweedFS, moto).

Same behaviour suite on each backend: create-only put (identical retry succeeds, different bytes
raise ForkAlarm and leave the stored object untouched), get/head/list, bounded reads, the
create-only probe, and configuration (URL forms, credentials that the server refuses).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from infra.archive_store import (
    STAGING_MAX_AGE,
    ArchiveStore,
    ArchiveStoreError,
    CreateOnlyIgnored,
    ForkAlarm,
    ObjectNotFound,
    ObjectTooLarge,
    PutOutcome,
    S3Options,
    StoreMissing,
)
from infra.config import Settings
from protocol.archive import GENESIS_HASH, ArchivedEvent, Stream, decode_segment, encode_segment, segment_key
from protocol.errors import ConfigError
from tests.archive_fixtures import S3_BACKENDS
from tests.procs import free_port
from tests.s3_server import S3Server, sloppy_s3


@pytest.fixture(params=["directory", *S3_BACKENDS])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ArchiveStore]:
    """A factory of stores on one fresh location (two calls: two clients of the same place), on a
    directory, SeaweedFS and moto."""
    if request.param == "directory":
        return lambda: ArchiveStore.local(tmp_path / "archive")
    server: S3Server = request.getfixturevalue(S3_BACKENDS[request.param])
    prefix = f"run-{uuid.uuid4().hex[:12]}"
    return lambda: server.store(prefix)


def _segment(lineage: uuid.UUID, body: bytes = b'{"n":1}') -> tuple[str, bytes]:
    data = encode_segment(Stream.PUBLIC, lineage, 0, GENESIS_HASH, [ArchivedEvent(1, body)])
    return segment_key(lineage, 0, 1, 1), data


async def test_put_get_head_list_round_trip(make_store: Callable[[], ArchiveStore]) -> None:
    store = make_store()
    lineage = uuid.uuid4()
    key, data = _segment(lineage)
    assert await store.put(key, data) is PutOutcome.CREATED
    assert await store.get(key) == data
    decode_segment(await store.get(key))  # byte-exact: the segment still verifies after the trip
    info = await store.head(key)
    assert info is not None and info.key == key and info.size == len(data)
    assert await store.head(f"{lineage}/segments/missing") is None
    await store.put(f"{lineage}/checkpoints/0000000000000000001", b"note\n")
    listed = sorted([o.key async for o in store.list(str(lineage))])
    assert listed == [f"{lineage}/checkpoints/0000000000000000001", key]
    assert [o async for o in store.list(str(uuid.uuid4()))] == []


async def test_identical_put_is_success_and_writes_nothing(make_store: Callable[[], ArchiveStore]) -> None:
    lineage = uuid.uuid4()
    key, data = _segment(lineage)
    assert await make_store().put(key, data) is PutOutcome.CREATED
    # A second client (an archiver after take-over) retrying the same upload.
    assert await make_store().put(key, data) is PutOutcome.ALREADY_PRESENT
    assert await make_store().get(key) == data


@pytest.mark.parametrize("other", ["different", "shorter", "longer"])
async def test_different_bytes_under_an_existing_key_raise_fork_alarm(
        make_store: Callable[[], ArchiveStore], other: str) -> None:
    store = make_store()
    lineage = uuid.uuid4()
    key, data = _segment(lineage)
    await store.put(key, data)
    forged = {"different": _segment(lineage, b'{"n":2}')[1], "shorter": data[:-1], "longer": data + b"x"}[other]
    with pytest.raises(ForkAlarm) as caught:
        await store.put(key, forged)
    assert caught.value.key == key
    # The stored object is untouched: create-only means the first write wins.
    assert await store.get(key) == data


async def test_get_is_bounded_and_missing_is_typed(make_store: Callable[[], ArchiveStore]) -> None:
    store = make_store()
    key = f"{uuid.uuid4()}/segments/big"
    await store.put(key, b"x" * 1000)
    with pytest.raises(ObjectTooLarge):
        await store.get(key, max_bytes=999)
    assert len(await store.get(key, max_bytes=1000)) == 1000
    with pytest.raises(ObjectNotFound):
        await store.get(f"{uuid.uuid4()}/nothing")


async def test_replace_overwrites_only_when_asked(make_store: Callable[[], ArchiveStore]) -> None:
    store = make_store()
    key = f"{uuid.uuid4()}/manifest.json"
    await store.replace(key, b"one")
    await store.replace(key, b"two")
    assert await store.get(key) == b"two"
    with pytest.raises(ForkAlarm):
        await store.put(key, b"three")


async def test_store_honours_create_only(make_store: Callable[[], ArchiveStore]) -> None:
    await make_store().probe_create_only()


async def test_sync_makes_puts_durable_and_names_a_vanished_object(make_store: Callable[[], ArchiveStore],
                                                                   tmp_path: Path) -> None:
    """``sync`` after puts succeeds on every store (on S3 there is nothing to do); on a directory,
    an object gone before its sync is ObjectNotFound (it cannot be made durable)."""
    store = make_store()
    lineage = uuid.uuid4()
    keys = [f"{lineage}/segments/{n}" for n in range(3)] + [f"{lineage}/checkpoints/1"]
    for key in keys:
        await store.put(key, key.encode())
    await store.replace(f"{lineage}/manifest.json", b"{}")
    await store.sync([*keys, f"{lineage}/manifest.json"])
    assert [await store.get(k) for k in keys] == [k.encode() for k in keys]
    local = ArchiveStore.local(tmp_path / "synced")
    await local.put("a/b", b"x")
    (tmp_path / "synced" / "a" / "b").unlink()
    with pytest.raises(ObjectNotFound):
        await local.sync(["a/b"])


@pytest.mark.parametrize("size", [100, 3 << 20])  # written on the event loop, and in a thread
async def test_a_directory_put_races_safely_and_leaves_only_whole_objects(tmp_path: Path, size: int) -> None:
    """On a directory the store writes files itself (staging file, then a hard link): of puts of one
    key at once, one creates it and the others find it; different bytes at once are one winner and
    fork alarms; no staging file is left; a staging file a crash left behind is never listed or read."""
    store = ArchiveStore.local(tmp_path)
    key = f"{uuid.uuid4()}/segments/0"
    data = bytes(range(256)) * (size // 256)
    outcomes = await asyncio.gather(*(ArchiveStore.local(tmp_path).put(key, data) for _ in range(6)))
    assert sorted(o.name for o in outcomes) == ["ALREADY_PRESENT"] * 5 + ["CREATED"]
    other = f"{uuid.uuid4()}/segments/0"
    raced = await asyncio.gather(*(store.put(other, data + bytes([n])) for n in range(4)), return_exceptions=True)
    assert [type(r).__name__ for r in raced].count("PutOutcome") == 1
    assert all(isinstance(r, PutOutcome | ForkAlarm) for r in raced)
    winner = next(n for n, r in enumerate(raced) if isinstance(r, PutOutcome))
    assert await store.get(other, max_bytes=len(data) + 1) == data + bytes([winner])
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["0", "0"]
    (tmp_path / key).with_name("0#1234567890").write_bytes(b"half")  # a staging file's name
    assert [o.key async for o in store.list(key.split("/")[0])] == [key]
    with pytest.raises(ArchiveStoreError):  # not a key the archive writes: obstore refuses it
        await store.get(key + "#1234567890")


async def test_staging_files_a_crash_left_are_swept_once_old(tmp_path: Path) -> None:
    """Staging files older than the limit are removed, younger ones (a put may still be using them)
    and every object are left; on S3 there is nothing to sweep."""
    store = ArchiveStore.local(tmp_path)
    lineage = str(uuid.uuid4())
    await store.put(f"{lineage}/segments/0", b"segment")
    await store.put("manifest-like", b"m")
    old = [tmp_path / lineage / "segments" / "1#123", tmp_path / "probes#9"]
    young = tmp_path / lineage / "segments" / "2#456"
    for path in [*old, young]:
        path.write_bytes(b"half")
    for path in old:
        os.utime(path, (time.time() - STAGING_MAX_AGE - 60,) * 2)
    not_staging = tmp_path / lineage / "segments" / "3#x1"  # not the staging form: never touched
    not_staging.write_bytes(b"?")
    os.utime(not_staging, (time.time() - STAGING_MAX_AGE - 60,) * 2)
    assert await store.sweep_staging() == (2, 0)
    assert not any(p.exists() for p in old) and young.exists() and not_staging.exists()
    assert await store.get(f"{lineage}/segments/0") == b"segment"
    assert await store.sweep_staging() == (0, 0)
    assert await store.sweep_staging(older_than=0) == (1, 0) and not young.exists()


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
async def test_keys_must_be_plain_relative_paths(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError):
        await ArchiveStore.local(tmp_path).put(key, b"x")


async def test_wrong_credentials_are_refused_without_leaking_them(s3_server: S3Server) -> None:
    store = s3_server.store(secret="definitely-wrong-secret")
    with pytest.raises(ArchiveStoreError) as caught:
        await store.put(f"{uuid.uuid4()}/x", b"x")
    assert not isinstance(caught.value, ForkAlarm)
    assert "definitely-wrong-secret" not in str(caught.value)
    assert s3_server.secret_access_key not in str(caught.value)


async def test_each_s3_failure_says_its_cause_and_nothing_of_the_answer(s3_server: S3Server) -> None:
    """A wrong secret, an unknown access key id, a missing bucket and a server that is not there
    each name their cause (the S3 error code, and what to check), never the server's XML answer,
    the request's address or a credential; a missing bucket is its own error (StoreMissing)."""
    def s3(bucket: str, endpoint: str, key_id: str, secret: str) -> ArchiveStore:
        return ArchiveStore.s3(bucket, "p", S3Options(endpoint, "us-east-1", key_id, secret))

    server = s3_server
    cases = [
        (s3(server.bucket, server.endpoint, server.access_key_id, "definitely-wrong-secret"),
         "SignatureDoesNotMatch", "TOASTMACHINE_ARCHIVE_S3_SECRET_ACCESS_KEY"),
        (s3(server.bucket, server.endpoint, "nosuchkeyid", server.secret_access_key),
         "InvalidAccessKeyId", "TOASTMACHINE_ARCHIVE_S3_ACCESS_KEY_ID"),
        (s3("no-such-bucket-here", server.endpoint, server.access_key_id, server.secret_access_key),
         "the bucket does not exist (NoSuchBucket)", "list (all)"),
        (s3(server.bucket, f"http://127.0.0.1:{free_port()}", server.access_key_id, server.secret_access_key),
         "the server is unreachable", "TOASTMACHINE_ARCHIVE_S3_ENDPOINT"),
    ]
    for store, cause, hint in cases:
        with pytest.raises(ArchiveStoreError) as caught:
            [info async for info in store.list()]
        text = str(caught.value)
        assert text.startswith(f"archive store ({store.description}): list (all) failed: "), text
        said = text[len(f"archive store ({store.description}): "):]
        assert cause in said and hint in said, text
        assert isinstance(caught.value, StoreMissing) == ("NoSuchBucket" in cause), text
        for leak in ("<", "http", "GET", server.secret_access_key, "definitely-wrong-secret", "RequestId"):
            assert leak not in said, (leak, text)


async def test_the_aws_variables_work_and_missing_credentials_are_named(
        s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's fallback: no TOASTMACHINE_ARCHIVE_S3_* settings, the AWS_* variables instead,
    an http:// AWS_ENDPOINT_URL included (it was refused as plain HTTP, every call a GenericError
    'at the default endpoint'). With no credentials at all the failure says so (the client had
    asked the cloud's instance metadata for some: GenericError)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    prefix = f"aws-env-{uuid.uuid4().hex[:8]}"
    anonymous = ArchiveStore.s3(s3_server.bucket, prefix, S3Options())
    assert anonymous.description == f"s3://{s3_server.bucket}/{prefix} at {s3_server.endpoint}"
    with pytest.raises(ArchiveStoreError, match="no credentials"):
        [info async for info in anonymous.list()]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    store = ArchiveStore.s3(s3_server.bucket, prefix, S3Options())
    await store.put("k/v", b"through the AWS variables")
    assert await store.get("k/v") == b"through the AWS variables"


async def test_settings_choose_the_store(tmp_path: Path, s3_server: S3Server) -> None:
    # Unset: DATA_DIR/archive.
    default = ArchiveStore.from_settings(Settings.from_env({"TOASTMACHINE_DATA_DIR": str(tmp_path)}))
    await default.put("k/v", b"1")
    assert (tmp_path / "archive" / "k" / "v").read_bytes() == b"1"
    # file:// URL.
    target = tmp_path / "elsewhere"
    by_url = ArchiveStore.from_settings(Settings.from_env({"TOASTMACHINE_ARCHIVE_URL": f"file://{target}"}))
    await by_url.put("k/v", b"2")
    assert (target / "k" / "v").read_bytes() == b"2"
    # s3:// with endpoint and credentials from the TOASTMACHINE_ARCHIVE_S3_* variables.
    prefix = f"settings-{uuid.uuid4().hex[:8]}"
    settings = Settings.from_env({
        "TOASTMACHINE_ARCHIVE_URL": f"s3://{s3_server.bucket}/{prefix}",
        "TOASTMACHINE_ARCHIVE_S3_ENDPOINT": s3_server.endpoint,
        "TOASTMACHINE_ARCHIVE_S3_REGION": "us-east-1",
        "TOASTMACHINE_ARCHIVE_S3_ACCESS_KEY_ID": s3_server.access_key_id,
        "TOASTMACHINE_ARCHIVE_S3_SECRET_ACCESS_KEY": s3_server.secret_access_key,
    })
    assert settings.redacted()["archive_s3_secret_access_key"] == "***"
    s3 = ArchiveStore.from_settings(settings)
    await s3.put("k/v", b"3")
    assert await s3_server.store(prefix).get("k/v") == b"3"


@pytest.mark.parametrize("url", ["ftp://host/x", "s3://", "s3://user:pw@bucket/x", "file://host/x",
                                 "s3:bucket/x", "S3:bucket", "file:relative", "s3://Bad_Bucket!/x", "s3://ab/x"])
def test_bad_archive_urls_are_refused_at_start(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({"TOASTMACHINE_ARCHIVE_URL": url})
    assert "TOASTMACHINE_ARCHIVE_URL" in str(caught.value)
    assert "pw" not in str(caught.value)


async def test_an_unreachable_store_fails_with_a_typed_error(s3_server: S3Server) -> None:
    """Nothing listens on the endpoint: every operation raises ArchiveStoreError (the archiver backs
    off on it), never a fork alarm and never a hang inside the client's retries."""
    dead = ArchiveStore.s3(s3_server.bucket, "dead", S3Options(f"http://127.0.0.1:{free_port()}", "us-east-1",
                                                                s3_server.access_key_id, s3_server.secret_access_key))
    async with asyncio.timeout(120):
        for op in (dead.put("k/v", b"x"), dead.get("k/v"), dead.head("k/v"), dead.probe_create_only()):
            with pytest.raises(ArchiveStoreError) as caught:
                await op
            assert not isinstance(caught.value, ForkAlarm | ObjectNotFound)
            assert s3_server.secret_access_key not in str(caught.value)
        with pytest.raises(ArchiveStoreError):
            [o async for o in dead.list("k")]


async def test_a_store_that_ignores_create_only_is_refused() -> None:
    """A real HTTP server speaking just enough S3 (PUT) that, like some S3-compatible stores,
    ignores ``If-None-Match: *`` and overwrites: the probe refuses it."""
    async with sloppy_s3() as sloppy:
        with pytest.raises(CreateOnlyIgnored):
            await sloppy.probe_create_only()
        assert len(sloppy.objects) == 1  # type: ignore[attr-defined]  # the same probe key, written twice
