"""``mirror``: a read-only copy built from a node's archive (written by the real archiver actor) and
followed live through the node's ``changes.jsonl`` over real HTTP, on both backend pairs.

The mirror must reach the node's signed root, keep following (new writes appear at once as the
unverified tail, then are verified when archived), serve the same ``snapshot.jsonl``, accept no
credential, and refuse an archive signed by a key other than the pinned one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import obstore
import orjson
import pytest
from aiohttp import web

from actors.commands import submit_write
from actors.reads import archive as archive_reads
from actors.recovery import mirror as mirror_module
from actors.recovery.mirror import Mirror, MirrorError, NodeArchiveSource
from actors.recovery.walk import StoreSource
from actors.web.app import make_app
from actors.web.archive import ARCHIVE_STORE
from actors.writer import CorpusWriter
from infra.archive_keys import archive_origin
from infra.archive_store import ArchiveStore, ArchiveStoreError
from infra.bus import make_bus
from infra.db import Database, apply_migrations, read_identity
from infra.ratelimit import local_bucket, write_budget
from protocol import corpus
from protocol.archive import segment_key
from protocol.checkpoint import generate_signer_key
from protocol.errors import ApiError, ReadOnlyMirror
from tests.archive_fixtures import archive_database, archiver_caught_up, archiving, raw_store
from tests.corpus_fixtures import STACK_ENV, Stack, running_stack
from tests.db_fixtures import fresh_database
from tests.webclient import serve, test_node

WAIT = 60.0


async def _until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not await condition():  # type: ignore[misc]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _mirror_db(server: str) -> AsyncIterator[Database]:
    async with fresh_database(server) as dsn:
        db = await Database.connect(dsn, min_size=1, max_size=4)
        try:
            await apply_migrations(db)
            yield db
        finally:
            await db.close()


async def _snapshot(client: object, path: str = "/corpus/snapshot.jsonl") -> bytes:
    resp = await client.get(path)  # type: ignore[attr-defined]
    assert resp.status == 200, await resp.text()
    return await resp.read()  # type: ignore[no-any-return]


async def _node_root(stack: Stack) -> tuple[int, bytes]:
    row = await stack.db.pool.fetchrow("select tree_size, root from archive_checkpoints where stream = 0 "
                                       "order by tree_size desc limit 1")
    return row["tree_size"], bytes(row["root"])


@dataclass
class _Pair:
    """A node (with an archive directory and a signer for it) and an empty database for its mirror."""

    node: Stack
    store: ArchiveStore
    signer: Any
    mirror_db: Database
    session: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def _node_and_mirror(stack_backends: tuple[str | None, str], tmp_path: Path) -> AsyncIterator[_Pair]:
    amqp_url, server = stack_backends
    async with fresh_database(server) as node_dsn, running_stack(node_dsn, amqp_url, STACK_ENV) as node, \
            _mirror_db(server) as mirror_db, aiohttp.ClientSession() as session:
        yield _Pair(node, ArchiveStore.local(tmp_path / "archive"),
                    generate_signer_key(archive_origin(node.identity.corpus_id)), mirror_db, session)


async def test_the_mirror_reaches_the_nodes_root_and_keeps_following(
        stack_backends: tuple[str | None, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = stack_backends[1]
    async with _node_and_mirror(stack_backends, tmp_path) as pair:
        node, store, signer, mirror_db, session = pair.node, pair.store, pair.signer, pair.mirror_db, pair.session
        alice = await node.register("alice-mirrored")
        bob = await node.register("bob-mirrored")
        first = await node.conversation(alice, "mirrored", content="hello @bob-mirrored #mirror")
        cid = first["conversation"]["id"]
        for n in range(9):
            await node.message(bob if n % 2 else alice, cid, content=f"reply {n}")
        base = str(node.client.make_url("")).rstrip("/")
        async with archiving(node, store, signer):
            await archiver_caught_up(node)
            mirror = Mirror(StoreSource(store), node.identity.lineage, mirror_db, trusted=signer.verifier(),
                            node_url=base, session=session)
            stop = asyncio.Event()
            task = asyncio.create_task(mirror.run(stop, poll_interval=0.1))
            try:
                size, root = await _node_root(node)

                async def reached() -> bool:
                    return mirror.state is not None and mirror.state.tree.size == size

                await _until(reached, "the mirror to verify the node's archive")
                assert mirror.state is not None and mirror.state.tree.root() == root
                # Following live: a new write is in the mirror as soon as the node serves it...
                later = await node.message(alice, cid, content="written after the mirror started")
                sequence = later["message"]["sequence"]

                async def applied() -> bool:
                    return mirror.state is not None and mirror.state.applied_through >= sequence

                await _until(applied, "the mirror to apply the live tail")
                # ...and verified once archived: the mirror's root is again the node's newest.
                await archiver_caught_up(node)
                size, root = await _node_root(node)
                await _until(reached, "the mirror to verify the newly archived segment")
                assert mirror.state.tree.root() == root
                assert mirror.state.verified_through == sequence
                # The same through the node's public archive routes alone (no access to its store).
                node.client.app[ARCHIVE_STORE]["store"] = store
                # The status lists only the most recent segments: the mirror takes the manifest's route.
                monkeypatch.setattr(archive_reads, "STATUS_SEGMENTS", 1)
                listing = await (await node.client.get("/corpus/archive")).json()
                assert len(listing["segments"]) < listing["segment_count"]
                served = await node.client.get(listing["links"]["manifest"])
                assert served.status == 200
                assert await served.read() == await store.get(f"{node.identity.lineage}/manifest.json")
                again = await node.client.get(listing["links"]["manifest"], headers={"If-None-Match": served.headers["ETag"]})
                assert again.status == 304
                async with _mirror_db(server) as second_db:
                    second = Mirror(NodeArchiveSource(session, base), await NodeArchiveSource(session, base).lineage(),
                                    second_db, trusted=signer.verifier(), node_url=base, session=session)
                    assert await second.archive_round()
                    while await second.tail_round():
                        pass
                    assert second.state is not None
                    assert (second.state.tree.size, second.state.tree.root()) == (size, root)
            finally:
                stop.set()
                await asyncio.wait_for(task, WAIT)
        # The mirror serves the same state; nobody can write on it.
        identity = await read_identity(mirror_db)
        assert identity == node.identity
        bus = make_bus(None)
        await bus.connect()
        try:
            mirror_node = test_node(mirror_db, bus, STACK_ENV, identity=identity)
            async with serve(make_app(mirror_node)) as client:
                assert await _snapshot(client) == await _snapshot(node.client)
                resp = await client.get("/me", headers=alice.headers())
                assert resp.status == 401
                # Read-only: no agent of its own (its sequences are the source's), said with the envelope.
                resp = await client.post("/register", json={"name": "intruder"})
                assert resp.status == 403, await resp.text()
                assert (await resp.json())["error"]["code"] == "read_only_mirror"
                info = await (await client.get("/corpus")).json()
                assert info["mirror"]["source"] == StoreSource(store).description
                assert info["mirror"]["applied_through"] == info["mirror"]["verified_through"] == sequence
                assert "mirror" not in await (await node.client.get("/corpus")).json()
            # A writer pointed at the mirror's database by mistake commits nothing either: its write
            # (by a mirrored author) is refused with the same error, not a 5xx, and nothing is added.
            writer = CorpusWriter(bus, node_id="w", db=mirror_db, identity=identity)
            await writer.start()
            try:
                before = await mirror_db.pool.fetchval("select count(*) from changes")
                with pytest.raises(ApiError) as refused:
                    await submit_write(mirror_node, local_bucket(write_budget(1000)), _Author(alice.agent_id),
                                       corpus.OP_CREATE_CONVERSATION, None, {"subject": "s", "content": "c"},
                                       "mirror-write-1")
                assert (refused.value.status, refused.value.code) == (403, ReadOnlyMirror.code)
                assert await mirror_db.pool.fetchval("select count(*) from changes") == before
                assert await mirror_db.pool.fetchval("select count(*) from agents where name = 'intruder'") == 0
            finally:
                await writer.stop(grace=2)
        finally:
            await bus.close()
        # Resuming is a no-op round; a different pinned key is refused.
        assert not await Mirror(StoreSource(store), node.identity.lineage, mirror_db,
                                trusted=signer.verifier()).archive_round()
        stranger = generate_signer_key(signer.name).verifier()
        with pytest.raises(MirrorError):
            await Mirror(StoreSource(store), node.identity.lineage, mirror_db, trusted=stranger).archive_round()


async def test_segments_larger_than_one_read_come_whole_through_the_nodes_routes(
        stack_backends: tuple[str | None, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror reading a node's archive routes gets each segment whole, however many socket reads
    its body takes (a reader that took one read's worth refused a real node's 400 KB segment as
    truncated), and reaches the node's root; a tail page over its byte bound is asked again with
    fewer changes, and one change over it is refused by name."""
    async with _node_and_mirror(stack_backends, tmp_path) as pair:
        node, store, signer, mirror_db, session = pair.node, pair.store, pair.signer, pair.mirror_db, pair.session
        alice = await node.register("alice-large")
        # About 64 KB an event: a 4-event segment is four times the client's 64 KiB read buffer.
        first = await node.conversation(alice, "large", content="a" * 65_000)
        cid = first["conversation"]["id"]
        for n in range(7):
            await node.message(alice, cid, content=f"{n}" * 65_000)
        async with archiving(node, store, signer):
            await archiver_caught_up(node)
        node.client.app[ARCHIVE_STORE]["store"] = store
        largest = await node.db.pool.fetchrow("select segment_index, first_sequence, last_sequence, size "
                                              "from archive_segments where stream = 0 order by size desc limit 1")
        assert largest["size"] > 4 * 65_000
        base = str(node.client.make_url("")).rstrip("/")
        source = NodeArchiveSource(session, base)
        mirror = Mirror(source, await source.lineage(), mirror_db, trusted=signer.verifier(), node_url=base,
                        session=session)
        assert await mirror.archive_round()
        size, root = await _node_root(node)
        assert mirror.state is not None and (mirror.state.tree.size, mirror.state.tree.root()) == (size, root)
        # The unarchived tail, five changes of about 65 KB: pages of at most three fit the bound.
        for n in range(5):
            last = await node.message(alice, cid, content=f"tail {n} " + "t" * 65_000)
        monkeypatch.setattr(mirror_module, "TAIL_PAGE_BYTES", 3 * 70_000)
        while await mirror.tail_round():
            pass
        assert mirror.state.applied_through == last["message"]["sequence"]
        assert await mirror_db.pool.fetchval("select count(*) from changes") == \
            await node.db.pool.fetchval("select count(*) from changes")
        monkeypatch.setattr(mirror_module, "TAIL_PAGE_BYTES", 1000)
        await node.message(alice, cid, content="t" * 65_000)
        with pytest.raises(MirrorError, match="for one change"):
            while await mirror.tail_round():
                pass
        # The same segment under a smaller bound is refused by name, its body not held.
        key = segment_key(node.identity.lineage, largest["segment_index"], largest["first_sequence"],
                          largest["last_sequence"])
        assert len(await source.get(key, max_bytes=largest["size"])) == largest["size"]
        with pytest.raises(ArchiveStoreError, match="is larger than"):
            await source.get(key, max_bytes=largest["size"] - 1)


async def _one_conversation_archived(pair: _Pair, name: str) -> tuple[Any, dict[str, Any]]:
    """An agent ``name`` and a conversation of its, archived (both streams published)."""
    alice = await pair.node.register(name)
    first = await pair.node.conversation(alice, name, content="archived")
    async with archiving(pair.node, pair.store, pair.signer):
        await archiver_caught_up(pair.node)
    return alice, first


async def test_a_node_whose_history_went_back_stops_the_mirror_as_a_fork(
        stack_backends: tuple[str | None, str], tmp_path: Path) -> None:
    """The node's last changes vanish under the same lineage (its database restored from an older
    backup: here deleted behind the triggers' back), so its head is behind what the mirror applied
    from its tail: the node answers the mirror's ``after`` with 400, and the mirror stops as at a
    fork (its process would exit) instead of polling a history that will never reach it."""
    from actors.recovery.mirror import MirrorFork

    async with _node_and_mirror(stack_backends, tmp_path) as pair:
        node, store, signer, mirror_db, session = pair.node, pair.store, pair.signer, pair.mirror_db, pair.session
        alice, first = await _one_conversation_archived(pair, "alice-rewound")
        base = str(node.client.make_url("")).rstrip("/")
        mirror = Mirror(StoreSource(store), node.identity.lineage, mirror_db, trusted=signer.verifier(),
                        node_url=base, session=session)
        assert await mirror.archive_round()
        for n in range(3):
            last = await node.message(alice, first["conversation"]["id"], content=f"to be lost {n}")
        while await mirror.tail_round():
            pass
        assert mirror.state is not None and mirror.state.applied_through == last["message"]["sequence"]
        async with node.db.pool.acquire() as conn, conn.transaction():
            await conn.execute("set local session_replication_role = replica")  # no triggers: the backup's state
            await conn.execute("delete from changes where sequence > $1", first["sequence"])
        with pytest.raises(MirrorFork, match="history went back"):
            await mirror.tail_round()


async def test_the_live_tail_goes_on_while_the_archive_cannot_be_read(
        stack_backends: tuple[str | None, str], tmp_path: Path) -> None:
    """The node's archive store stops answering (an S3 endpoint nobody listens on): its archive
    routes answer 503, and the mirror still applies the node's new changes from its live tail
    before reporting the archive's failure (it stayed at the last archived change before)."""
    from infra.archive_store import S3Options
    from tests.procs import free_port

    async with _node_and_mirror(stack_backends, tmp_path) as pair:
        node, store, signer, mirror_db, session = pair.node, pair.store, pair.signer, pair.mirror_db, pair.session
        alice, first = await _one_conversation_archived(pair, "alice-storeless")
        node.client.app[ARCHIVE_STORE]["store"] = store
        base = str(node.client.make_url("")).rstrip("/")
        source = NodeArchiveSource(session, base)
        mirror = Mirror(source, await source.lineage(), mirror_db, trusted=signer.verifier(), node_url=base,
                        session=session)
        assert await mirror.archive_round()
        node.client.app[ARCHIVE_STORE]["store"] = ArchiveStore.s3("bucket", "p", S3Options(
            endpoint=f"http://127.0.0.1:{free_port()}", region="us-east-1", access_key_id="k", secret_access_key="s"))
        last = await node.message(alice, first["conversation"]["id"], content="while the store is away")
        resp = await node.client.get("/corpus/archive")
        assert resp.status == 503 and resp.headers["Retry-After"] == "5"
        assert (await resp.json())["error"]["code"] == "archive_store_unavailable"
        with pytest.raises(ArchiveStoreError):
            await mirror.run(asyncio.Event(), poll_interval=0.1)
        assert mirror.state is not None and mirror.state.applied_through == last["message"]["sequence"]


@dataclass(frozen=True)
class _Author:
    """A mirrored author, as an authenticated one would be (no credential can authenticate on a mirror)."""

    agent_id: str
    name: str = "alice-mirrored"
    onboarded: bool = True


async def _cli(env: dict[str, str], *args: str) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "toastmachine.cli", *args, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out, err


async def test_the_mirror_command_as_pasted(database_url: str, tmp_path: Path) -> None:
    """``toastmachine mirror --from DIR --public-key KEY --once``: the archive's root; a stranger key: exit 1."""
    from toastmachine.seed import seed_corpus

    source = await Database.connect(database_url, min_size=1, max_size=2)
    try:
        await apply_migrations(source)
        await seed_corpus(source, messages=10, agents=2, random_seed=11)
        archived = await archive_database(source, ArchiveStore.local(tmp_path / "archive"))
    finally:
        await source.close()
    async with fresh_database(database_url) as dsn:
        env = {"TOASTMACHINE_DATABASE_URL": dsn, "TOASTMACHINE_DATA_DIR": str(tmp_path / "data")}
        key = archived.key.verifier().text()
        for build in (True, False):  # building, then resuming
            code, out, err = await _cli(env, "mirror", "--from", str(tmp_path / "archive"), "--public-key", key,
                                        "--once")
            assert code == 0, err
            report = orjson.loads(out)
            assert report["tree_size"] == archived.size and report["root"] == archived.root.hex()
            # The build says how far it is on stderr (its last step at least); resuming, nothing new.
            progress = [line for line in err.decode().splitlines() if line.startswith("toastmachine: mirror: ")]
            if build:
                assert progress and progress[-1].startswith(
                    f"toastmachine: mirror: {archived.size:,} of {archived.size:,} archived changes loaded (100%)"), err
            else:
                assert progress == [], err
        stranger = generate_signer_key(archived.key.name).verifier().text()
        # A mistyped store path: a usage error naming it, and no empty archive made there.
        code, _, err = await _cli(env, "mirror", "--from", str(tmp_path / "archiv"), "--public-key", key, "--once")
        assert code == 2 and b"does not exist" in err and b"Traceback" not in err, err
        assert not (tmp_path / "archiv").exists()
        # A tampered segment: refused, and nothing of the round is committed.
        async with fresh_database(database_url) as other:
            store = ArchiveStore.local(tmp_path / "archive")
            last = archived.segment_key(len(archived.segments) - 1)
            data = await store.get(last)
            await obstore.put_async(raw_store(store), last, data[:-40] + bytes([data[-40] ^ 1]) + data[-39:])
            code, _, err = await _cli({**env, "TOASTMACHINE_DATABASE_URL": other}, "mirror", "--from",
                                      str(tmp_path / "archive"), "--public-key", key, "--once")
            assert code == 1 and b"merkle_mismatch" in err, err
            conn = await asyncpg.connect(other)
            try:
                assert await conn.fetchval("select count(*) from changes") == 0
                assert await conn.fetchval("select count(*) from corpus_witness") == 0
            finally:
                await conn.close()

        code, out, err = await _cli(env, "mirror", "--from", str(tmp_path / "archive"), "--public-key", stranger,
                                    "--once")
        assert code == 1 and b"not_signed_by_key" in err


async def test_mirror_serve_follows_a_node_and_serves_the_copy_read_only(tmp_path: Path) -> None:
    """``toastmachine mirror --from <node> --public-key KEY --serve`` against a running ``up`` node,
    both as processes on their embedded databases: the copy is caught up and served (the same head,
    ``GET /corpus`` naming the source), a write on the node reaches an SSE stream open on the mirror
    (followed live, fed by the mirror's own publisher), registering on the mirror is 403
    ``read_only_mirror``, and SIGTERM stops it cleanly."""
    from tests import procs
    from tests.sse import frames

    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "node"), TOASTMACHINE_PORT="0",
                          TOASTMACHINE_ARCHIVE_SEGMENT_EVENTS="2", TOASTMACHINE_ARCHIVE_SWEEP_SECONDS="0.2")
    node = await procs.start("up", env=env)
    mirror: procs.NodeProcess | None = None
    try:
        url = await node.wait_listening(timeout=120)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            author, cid, key = await _two_messages_archived(http, url, "mirrored")
            mirror = await procs.start("mirror", "--from", url, "--public-key", key, "--serve", "--poll", "0.1",
                                       env=procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "mirror"),
                                                           TOASTMACHINE_PORT="0"))
            copy = await mirror.wait_listening(timeout=120)
            async with http.get(copy + "/corpus") as resp:
                info = await resp.json()
            async with http.get(url + "/corpus") as resp:
                source_info = await resp.json()
            assert info["mirror"]["source"] == f"node {url}"
            assert (info["corpus_id"], info["lineage"]) == (source_info["corpus_id"], source_info["lineage"])
            assert info["head_sequence"] == source_info["head_sequence"]
            # Followed live: a write on the node reaches a stream open on the mirror.
            stream = await http.get(copy + f"/corpus/stream?after={info['head_sequence']}")
            reader = frames(stream)
            async with asyncio.timeout(WAIT):
                async for frame in reader:
                    if frame.event == "ready":
                        break
            later = await _http_post(http, url, f"/conversations/{cid}/messages", author, {"content": "three"})
            async with asyncio.timeout(WAIT):
                async for frame in reader:
                    if frame.id is not None and int(frame.id) == later["message"]["sequence"]:
                        break
            stream.close()
            async with http.post(copy + "/register", json={"name": "intruder"}) as resp:
                assert resp.status == 403
                assert (await resp.json())["error"]["code"] == "read_only_mirror"
        assert await mirror.stop() == 0, "\n".join(mirror.output)
        assert not procs.unexpected_tracebacks(mirror.output), "\n".join(mirror.output)
    finally:
        if mirror is not None and mirror.proc.returncode is None:
            await mirror.stop()
        await node.stop()


async def _two_messages_archived(http: aiohttp.ClientSession, url: str, subject: str,
                                 ) -> tuple[dict[str, str], str, str]:
    """On the node at ``url`` (sealing segments of 2): an author, a conversation of two messages,
    archived and published; the author's headers, the conversation id and the node's public key."""
    author = await _http_author(http, url)
    cid = (await _http_post(http, url, "/conversations", author, {"subject": subject, "content": "one"}))["conversation"]["id"]
    await _http_post(http, url, f"/conversations/{cid}/messages", author, {"content": "two"})

    async def published() -> bool:
        async with http.get(url + "/corpus/archive") as resp:
            body = await resp.json()
        return bool(body["public_key"]) and any(s["state"] == "published" for s in body["segments"])

    await _until(published, "the node to publish an archive segment")
    async with http.get(url + "/corpus/archive") as resp:
        return author, cid, str((await resp.json())["public_key"])


async def _http_author(http: aiohttp.ClientSession, url: str) -> dict[str, str]:
    """A registered, onboarded agent of the node at ``url``: its bearer header."""
    async with http.post(url + "/register", json={"name": f"mirrored-{os.getpid()}"}) as resp:
        assert resp.status == 201, await resp.text()
        headers = {"Authorization": f"Bearer {(await resp.json())['credential']}"}
    async with http.get(url + "/guide", headers=headers) as resp:
        assert resp.status == 200
    return headers


async def _http_post(http: aiohttp.ClientSession, url: str, path: str, author: dict[str, str],
                     body: dict[str, str]) -> dict[str, Any]:
    async with http.post(url + path, json=body, headers={**author, "Operation-Token": str(uuid.uuid4())}) as resp:
        assert resp.status == 201, await resp.text()
        return dict(await resp.json())


class _Forger:
    """An HTTP proxy in front of a node: passes every request through, can be stopped and started
    again on the same port (the source away), and with ``forge`` set rewrites the content of every
    message in ``changes.jsonl`` (a node lying about its live tail)."""

    def __init__(self, target: str) -> None:
        from tests import procs

        self.target = target.rstrip("/")
        self.port = procs.free_port()
        self.forge = False
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.Response:
        assert self._http is not None
        async with self._http.request(request.method, self.target + request.path_qs, data=await request.read(),
                                      headers={k: v for k, v in request.headers.items() if k.lower() != "host"}) as r:
            body = await r.read()
            headers = {k: v for k, v in r.headers.items()
                       if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")}
        if self.forge and request.path == "/corpus/changes.jsonl":
            body = b"".join(self._forged(line) + b"\n" for line in body.splitlines())
        return web.Response(status=r.status, body=body, headers=headers)

    @staticmethod
    def _forged(line: bytes) -> bytes:
        def walk(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: ("FORGED by the proxy" if k == "content" and isinstance(v, str) else walk(v))
                        for k, v in value.items()}
            return [walk(v) for v in value] if isinstance(value, list) else value

        return orjson.dumps(walk(orjson.loads(line))) if line.strip() else line

    async def up(self) -> None:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def down(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def close(self) -> None:
        await self.down()
        if self._http is not None:
            await self._http.close()


async def test_mirror_serve_waits_out_its_source_and_stops_at_a_forged_tail(tmp_path: Path) -> None:
    """``mirror --serve`` through a proxy to the node. The proxy stopped for a while: the mirror says
    so in one line per try (no traceback) and catches up once it is back. The proxy then forges the
    live tail (``changes.jsonl``): the mirror applies it as unverified, and when the archive covers
    those changes and contradicts them, the process stops by itself with exit 1 instead of going on
    serving the forgery."""
    from tests import procs

    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "node"), TOASTMACHINE_PORT="0",
                          TOASTMACHINE_ARCHIVE_SEGMENT_EVENTS="2", TOASTMACHINE_ARCHIVE_SWEEP_SECONDS="0.2")
    node = await procs.start("up", env=env)
    proxy: _Forger | None = None
    mirror: procs.NodeProcess | None = None
    try:
        url = await node.wait_listening(timeout=120)
        proxy = _Forger(url)
        await proxy.up()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            author, cid, key = await _two_messages_archived(http, url, "forged")
            mirror = await procs.start("mirror", "--from", proxy.url, "--public-key", key, "--serve", "--poll", "0.1",
                                       env=procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "mirror"),
                                                           TOASTMACHINE_PORT="0"))
            copy = await mirror.wait_listening(timeout=120)

            async def caught_up() -> bool:
                async with http.get(copy + "/corpus") as a, http.get(url + "/corpus") as b:
                    return bool((await a.json())["head_sequence"] == (await b.json())["head_sequence"])

            await _until(caught_up, "the mirror to reach the node's head")

            await proxy.down()
            await _http_post(http, url, f"/conversations/{cid}/messages", author, {"content": "while away"})
            await mirror.wait_for_line(r"mirror\.round_failed", timeout=WAIT)
            await proxy.up()
            await _until(caught_up, "the mirror to catch up once its source is back")

            # Align on a segment boundary (events seal by twos): the change forged next stays in the
            # open segment, so the mirror takes it from the live tail, not from the archive.
            async def boundary() -> bool:
                async with http.get(url + "/corpus") as resp:
                    body = await resp.json()
                if body["archive"]["verified_through"] == body["head_sequence"]:
                    async with http.get(copy + "/corpus") as resp:
                        return bool((await resp.json())["mirror"]["verified_through"] == body["head_sequence"])
                return False

            async with http.get(url + "/corpus") as resp:
                odd = (await resp.json())["head_sequence"] % 2  # (no segment is old enough to seal by age)
            if odd:
                await _http_post(http, url, f"/conversations/{cid}/messages", author, {"content": "filler"})
            await _until(boundary, "the node and the mirror to hold every change archived")
            proxy.forge = True
            lie = await _http_post(http, url, f"/conversations/{cid}/messages", author, {"content": "the truth"})

            async def applied() -> bool:
                async with http.get(copy + f"/messages/{lie['message']['id']}") as resp:
                    return resp.status == 200

            await _until(applied, "the mirror to apply the (forged) live tail")
            async with http.get(copy + f"/messages/{lie['message']['id']}") as resp:
                assert (await resp.json())["content"] == "FORGED by the proxy"
            # The next write seals the segment: the archive now covers the forged change.
            await _http_post(http, url, f"/conversations/{cid}/messages", author, {"content": "seals it"})
            assert await mirror.wait(timeout=WAIT) == 1, "\n".join(mirror.output)
        text = "\n".join(mirror.output)
        assert "actor.fatal" in text and "MirrorFork" in text, text
        assert not procs.unexpected_tracebacks(mirror.output), text
    finally:
        if mirror is not None and mirror.proc.returncode is None:
            await mirror.stop()
        if proxy is not None:
            await proxy.close()
        await node.stop()
