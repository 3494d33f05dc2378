"""``GET /corpus``, ``GET /corpus/changes.jsonl`` and ``GET /corpus/snapshot.jsonl`` over real HTTP.

Every test runs on the embedded database with the in-process bus and on PostgreSQL with RabbitMQ
(the ``stack`` fixture). What the export sends is checked against the ``changes`` table itself, and
a mirror is rebuilt from a snapshot plus the changes after its boundary and compared with the state.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import aiohttp
import orjson
import pytest

from actors.web.app import make_app
from protocol.errors import LineageMismatch
from tests.corpus_fixtures import Agent, Stack
from tests.webclient import serve, test_node

JSONL = "application/x-ndjson"
KIND_RANK = {"conversation": 0, "message": 1, "relationship": 2}


async def _get(stack: Stack, path: str, headers: dict[str, str] | None = None) -> tuple[aiohttp.ClientResponse, bytes]:
    resp = await stack.client.get(path, headers=headers or {})
    return resp, await resp.read()


def _lines(body: bytes) -> list[dict[str, Any]]:
    assert body == b"" or body.endswith(b"\n")
    return [orjson.loads(line) for line in body.split(b"\n")[:-1]]


def _error(resp: aiohttp.ClientResponse, body: bytes, status: int, code: str) -> dict[str, Any]:
    assert resp.status == status, (resp.status, body)
    err = orjson.loads(body)["error"]
    assert err["code"] == code, err
    assert err["message"] and err["how_to_proceed"]
    return err  # type: ignore[no-any-return]


async def _stored(stack: Stack) -> list[bytes]:
    rows = await stack.db.pool.fetch("select event from changes order by sequence")
    return [r["event"].encode() for r in rows]


async def _history(stack: Stack) -> tuple[Agent, Agent]:
    """A small history with every change type, a mention, payloads (null too) and a reply."""
    alice = await stack.register("alice")
    bob = await stack.register("bob")
    first = await stack.conversation(alice, "first", content="hello @bob #intro", kinds=["question"])
    cid, root = first["conversation"]["id"], first["message"]["id"]
    claim = await stack.message(bob, cid, content="a claim", kinds=["claim"], reply_to=root,
                                schema_name="claim", schema_version=1,
                                payload={"statement": "it works", "confidence": 0.5})
    await stack.message(alice, cid, payload=None)
    second = await stack.conversation(bob, "second", payload={"b": [1, 2.5, "x"]})
    rel = await stack.post(bob, "/relationships", {"type": "extends", "source_message_id": claim["message"]["id"],
                                                   "target_message_id": root})
    assert rel.status == 201, rel.body
    rel2 = await stack.post(alice, "/relationships", {"type": "supports", "source_message_id": root,
                                                      "target_message_id": second["message"]["id"]})
    assert rel2.status == 201, rel2.body
    retracted = await stack.post(bob, f"/relationships/{rel.body['relationship']['id']}/retractions")
    assert retracted.status == 201, retracted.body
    return alice, bob


# --- changes.jsonl -----------------------------------------------------------------------------


async def test_paging_with_next_yields_the_whole_history_once_in_order(stack: Stack) -> None:
    await _history(stack)
    stored = await _stored(stack)
    assert len(stored) == 7
    got: list[bytes] = []
    after, pages = 0, 0
    while True:
        resp, body = await _get(stack, f"/corpus/changes.jsonl?after={after}&limit=3")
        assert resp.status == 200, body
        pages += 1
        got.extend(line + b"\n" for line in body.split(b"\n")[:-1])
        after = int(resp.headers["X-Corpus-Next"])
        if resp.headers["X-Corpus-Has-More"] == "false":
            break
    assert pages == 3
    assert [line.rstrip(b"\n") for line in got] == stored  # verbatim, each once, ascending
    # Following the Link header instead of building the URL gives the same pages.
    path, via_link = "/corpus/changes.jsonl?limit=3", []
    for _ in range(5):
        resp, body = await _get(stack, path)
        via_link.extend(body.split(b"\n")[:-1])
        path = re.fullmatch(r'<([^>]+)>; rel="next"', resp.headers["Link"]).group(1)  # type: ignore[union-attr]
        if resp.headers["X-Corpus-Has-More"] == "false":
            break
    assert via_link == stored
    # The default page holds everything here; the whole history in one request.
    resp, body = await _get(stack, "/corpus/changes.jsonl")
    assert body.split(b"\n")[:-1] == stored


async def test_every_header(stack: Stack) -> None:
    identity = stack.identity
    resp, body = await _get(stack, "/corpus/changes.jsonl")
    assert resp.status == 200 and body == b""
    assert resp.headers["X-Corpus-Id"] == str(identity.corpus_id)
    assert resp.headers["X-Corpus-Lineage"] == str(identity.lineage)
    assert (resp.headers["X-Corpus-After"], resp.headers["X-Corpus-At"], resp.headers["X-Corpus-Next"],
            resp.headers["X-Corpus-Has-More"], resp.headers["X-Corpus-Earliest"]) == ("0", "0", "0", "false", "0")
    await _history(stack)
    sequences = [r["sequence"] for r in await stack.db.pool.fetch("select sequence from changes order by sequence")]
    resp, body = await _get(stack, f"/corpus/changes.jsonl?after={sequences[1]}&limit=2")
    assert resp.status == 200
    assert resp.headers["Content-Type"] == JSONL
    assert resp.headers["Cache-Control"] == "no-store"
    assert "Content-Length" not in resp.headers  # streamed (chunked), not built in memory
    assert resp.headers["X-Corpus-Id"] == str(identity.corpus_id)
    assert resp.headers["X-Corpus-Lineage"] == str(identity.lineage)
    assert resp.headers["X-Corpus-After"] == str(sequences[1])
    assert resp.headers["X-Corpus-At"] == str(sequences[-1])
    assert resp.headers["X-Corpus-Next"] == str(sequences[3])
    assert resp.headers["X-Corpus-Has-More"] == "true"
    assert resp.headers["X-Corpus-Earliest"] == str(sequences[0])
    assert resp.headers["Link"] == f'</corpus/changes.jsonl?after={sequences[3]}&limit=2>; rel="next"'
    assert [e["sequence"] for e in _lines(body)] == sequences[2:4]
    # The last page: no more, next is its last sequence.
    resp, body = await _get(stack, f"/corpus/changes.jsonl?after={sequences[-3]}&limit=2")
    assert resp.headers["X-Corpus-Has-More"] == "false"
    assert resp.headers["X-Corpus-Next"] == str(sequences[-1])
    # HEAD: the same headers, no body.
    head = await stack.client.head(f"/corpus/changes.jsonl?after={sequences[1]}&limit=2")
    assert head.status == 200 and await head.read() == b""
    assert head.headers["X-Corpus-Next"] == str(sequences[3])


async def test_after_at_the_head_is_an_empty_page_and_past_it_a_400(stack: Stack) -> None:
    """At the head: an empty page whose next link polls from there. Past it: not a position in this
    history (another's, or computed), refused as the stream refuses it, instead of an empty page
    whose link a follower would poll for ever without seeing a change."""
    await _history(stack)
    head = await stack.db.pool.fetchval("select max(sequence) from changes")
    resp, body = await _get(stack, f"/corpus/changes.jsonl?after={head}&limit=5")
    assert resp.status == 200 and body == b""
    assert resp.headers["X-Corpus-After"] == resp.headers["X-Corpus-Next"] == str(head)
    assert resp.headers["X-Corpus-At"] == str(head)
    assert resp.headers["X-Corpus-Has-More"] == "false"
    assert resp.headers["Link"] == f'</corpus/changes.jsonl?after={head}&limit=5>; rel="next"'
    resp, body = await _get(stack, f"/corpus/changes.jsonl?after={head + 1000}&limit=5")
    err = _error(resp, body, 400, "invalid_parameter")
    assert err["field"] == "after" and f"beyond the head of this history ({head})" in err["message"]


@pytest.mark.parametrize(("query", "field"), [
    ("after=-1", "after"), ("after=abc", "after"), ("after=1.5", "after"), ("after=", "after"),
    ("after=%C2%B2", "after"), ("after=1234567890123456789", "after"),
    ("limit=0", "limit"), ("limit=10001", "limit"), ("limit=x", "limit"), ("limit=-5", "limit"),
    ("cursor=5", "cursor"), ("after=1&after=2", "after"), ("lineage=not-a-uuid", "lineage"),
])
async def test_bad_parameters_are_400_naming_the_field(stack: Stack, query: str, field: str) -> None:
    resp, body = await _get(stack, f"/corpus/changes.jsonl?{query}")
    assert _error(resp, body, 400, "invalid_parameter")["field"] == field


async def test_limit_bounds(stack: Stack) -> None:
    await _history(stack)
    stored = await _stored(stack)
    for limit, count in ((1, 1), (10_000, len(stored))):
        resp, body = await _get(stack, f"/corpus/changes.jsonl?limit={limit}")
        assert resp.status == 200
        assert len(_lines(body)) == count


async def test_only_jsonl_is_produced(stack: Stack) -> None:
    for accept in (JSONL, "application/jsonl", "*/*", "application/*"):
        resp, _ = await _get(stack, "/corpus/changes.jsonl", {"Accept": accept})
        assert resp.status == 200, accept
    resp, body = await _get(stack, "/corpus/changes.jsonl", {"Accept": "text/html"})
    _error(resp, body, 406, "not_acceptable")
    resp, body = await _get(stack, "/corpus/snapshot.jsonl", {"Accept": "application/json"})
    _error(resp, body, 406, "not_acceptable")


async def test_a_cursor_from_another_lineage_is_refused(stack: Stack) -> None:
    await _history(stack)
    ours, other = str(stack.identity.lineage), str(uuid.uuid4())
    for path, headers in ((f"/corpus/changes.jsonl?after=3&lineage={other}", {}),
                          ("/corpus/changes.jsonl?after=3", {"X-Corpus-Lineage": other})):
        resp, body = await _get(stack, path, headers)
        err = _error(resp, body, 409, "lineage_mismatch")
        assert err["lineage"] == ours
        assert "/corpus/snapshot.jsonl" in err["how_to_proceed"]
        assert resp.headers["X-Corpus-Lineage"] == ours
    resp, body = await _get(stack, f"/corpus/changes.jsonl?after=3&limit=2&lineage={ours.upper()}")
    assert resp.status == 200
    # The lineage the client asked with travels on in the next link.
    assert resp.headers["Link"] == (f'</corpus/changes.jsonl?after={resp.headers["X-Corpus-Next"]}&limit=2'
                                    f'&lineage={ours}>; rel="next"')
    resp, _ = await _get(stack, "/corpus/changes.jsonl", {"X-Corpus-Lineage": ours})
    assert resp.status == 200


async def _long_history(stack: Stack) -> None:
    """10,000 changes of ~2 KB (20 MB: more than every socket buffer between server and client, so an
    export of them all stays open while its client does not read), written straight into the
    history; the export does not care what the envelopes say."""
    alice = await stack.register()
    await stack.db.pool.execute(
        "insert into changes (sequence, type, partition, conversation_id, author_id, occurred_at, event) "
        "select s, 'message.appended', 0, gen_random_uuid(), $1, now(), "
        "       json_build_object('sequence', s, 'pad', repeat('x', 2000))::text "
        "from (select nextval('change_sequence') as s from generate_series(1, 10000)) as g",
        uuid.UUID(alice.agent_id))


async def test_a_large_page_is_streamed_while_the_client_reads(stack: Stack) -> None:
    await _long_history(stack)
    resp = await stack.client.get("/corpus/changes.jsonl?limit=10000")
    assert resp.status == 200 and resp.headers["X-Corpus-Has-More"] == "false"
    first = await resp.content.readline()
    assert orjson.loads(first)["sequence"] == 1
    # The client has read one line of 20 MB: the server must still be inside its cursor's transaction.
    busy = await stack.db.pool.fetchval(
        "select count(*) from pg_stat_activity where state <> 'idle' and query like '%convert_to(event%' "
        "and datname = current_database() and pid <> pg_backend_pid()")
    assert busy == 1
    chunks, rest = 0, [first]
    async for chunk in resp.content.iter_any():
        chunks += 1
        rest.append(chunk)
    lines = b"".join(rest).split(b"\n")[:-1]
    assert chunks > 1
    assert [orjson.loads(line)["sequence"] for line in lines] == list(range(1, 10_001))


def _from(address: str) -> dict[str, str]:
    """The headers of a client at ``address`` behind the test's trusted proxy (127.0.0.1)."""
    return {"X-Forwarded-For": address}


@pytest.mark.stack_env(TOASTMACHINE_DB_POOL_SIZE="4", TOASTMACHINE_EXPORT_MAX_PER_CLIENT="1",
                       TOASTMACHINE_TRUSTED_PROXIES="127.0.0.1")
async def test_one_client_cannot_hold_every_export_place(stack: Stack) -> None:
    """Two places on the node (half of a pool of 4), one per client. A client whose export is left
    unread waits for its own place with a second one, while another client gets the node's other
    place at once; the second export starts as soon as the first is closed. A third client waits for
    a place on the full node and gets the one freed. A client still over its share when the wait
    ends is answered 503 export_busy."""
    from actors.web.export import EXPORT_SLOTS

    slots = stack.client.app[EXPORT_SLOTS]
    await _long_history(stack)
    path = "/corpus/changes.jsonl?limit=10000"

    async def started(address: str) -> aiohttp.ClientResponse:
        resp = await stack.client.get(path, headers=_from(address))
        assert resp.status == 200 and await resp.content.readline()  # started, then left unread
        return resp

    held = await started("192.0.2.1")
    again = asyncio.ensure_future(started("192.0.2.1"))
    await _until(lambda: slots.waiting == 1)
    other = await started("192.0.2.2")  # not held up by the first client's wait
    held.close()  # its place frees as the server sees the connection go
    second = await again
    third = asyncio.ensure_future(started("192.0.2.3"))
    await _until(lambda: slots.waiting == 1)  # the node is full: the second and the other client
    other.close()
    last = await third
    assert slots.held == 2
    slots.wait = 0.2
    refused, body = await _get(stack, path, _from("192.0.2.1"))
    err = _error(refused, body, 503, "export_busy")
    assert refused.headers["Retry-After"] == "2" and "already has 1" in err["message"]
    assert len(await second.read()) > 20_000_000
    last.close()


async def _until(predicate: Any, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


# --- snapshot.jsonl ----------------------------------------------------------------------------


async def _snapshot(stack: Stack) -> tuple[int, list[dict[str, Any]]]:
    resp, body = await _get(stack, "/corpus/snapshot.jsonl")
    assert resp.status == 200, body
    assert resp.headers["Content-Type"] == JSONL and resp.headers["Cache-Control"] == "no-store"
    assert resp.headers["X-Corpus-Id"] == str(stack.identity.corpus_id)
    assert resp.headers["X-Corpus-Lineage"] == str(stack.identity.lineage)
    lines = _lines(body)
    keys = [(line["sequence"], KIND_RANK[line["kind"]]) for line in lines]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    return int(resp.headers["X-Corpus-At"]), lines


def _apply(state: dict[tuple[str, str], dict[str, Any]], event: dict[str, Any]) -> None:
    """What a mirror does with one change."""
    data = event["data"]
    if event["type"] == "conversation.created":
        state["conversation", data["conversation"]["id"]] = {"kind": "conversation", "sequence": event["sequence"],
                                                             "data": data["conversation"]}
    if event["type"] in ("conversation.created", "message.appended"):
        message = data["message"]
        state["message", message["id"]] = {"kind": "message", "sequence": event["sequence"], "data": message}
        conversation = state["conversation", message["conversation_id"]]["data"]
        if event["type"] == "message.appended":
            conversation["message_count"] += 1
            conversation["last_sequence"] = event["sequence"]
    elif event["type"] == "relationship.asserted":
        state["relationship", data["relationship"]["id"]] = {"kind": "relationship", "sequence": event["sequence"],
                                                             "data": data["relationship"]}
    elif event["type"] == "relationship.retracted":
        retraction = data["retraction"]
        relationship = state["relationship", retraction["relationship_id"]]["data"]
        relationship["retracted"] = True
        relationship["retraction"] = {k: retraction[k] for k in ("id", "sequence", "created_at")}


def _ordered(state: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(state.values(), key=lambda line: (line["sequence"], KIND_RANK[line["kind"]]))


async def test_snapshot_then_changes_after_its_boundary_equals_the_live_state(stack: Stack) -> None:
    alice, bob = await _history(stack)
    at, lines = await _snapshot(stack)
    stored = [orjson.loads(e) for e in await _stored(stack)]
    assert at == stored[-1]["sequence"]
    assert [line["kind"] for line in lines] == ["conversation", "message", "message", "message", "conversation",
                                                "message", "relationship", "relationship"]
    # The snapshot's resources are the representations the history carries, with state applied.
    rebuilt: dict[tuple[str, str], dict[str, Any]] = {}
    for event in stored:
        _apply(rebuilt, event)
    assert lines == _ordered(rebuilt)
    message = next(line["data"] for line in lines if line["kind"] == "message")
    assert [m["name"] for m in message["mentions"]] == ["bob"]
    retracted = [line["data"] for line in lines if line["kind"] == "relationship" and line["data"]["retracted"]]
    assert len(retracted) == 1 and set(retracted[0]["retraction"]) == {"id", "sequence", "created_at"}

    # More history after the snapshot: appends to old and new conversations, an assertion, retractions.
    state = {(line["kind"], line["data"]["id"]): line for line in lines}
    cid = lines[0]["data"]["id"]
    await stack.message(bob, cid, content="later, @alice", kinds=["challenge"])
    third = await stack.conversation(alice, "third")
    await stack.message(bob, third["conversation"]["id"], payload={"n": 1})
    live_rel = next(line["data"] for line in lines if line["kind"] == "relationship" and not line["data"]["retracted"])
    assert (await stack.post(alice, f"/relationships/{live_rel['id']}/retractions")).status == 201
    new_rel = await stack.post(alice, "/relationships", {"type": "replies-to", "target_message_id": lines[1]["data"]["id"],
                                                         "source_message_id": third["message"]["id"]})
    assert new_rel.status == 201

    # A mirror: the snapshot, then changes.jsonl?after=<X-Corpus-At>, page by page.
    after = at
    while True:
        resp, body = await _get(stack, f"/corpus/changes.jsonl?after={after}&limit=2")
        for event in _lines(body):
            _apply(state, event)
        after = int(resp.headers["X-Corpus-Next"])
        if resp.headers["X-Corpus-Has-More"] == "false":
            break
    at2, fresh = await _snapshot(stack)
    assert at2 == after > at
    assert _ordered(state) == fresh
    assert next(line for line in fresh if line["data"]["id"] == cid)["data"]["message_count"] == 4


async def test_empty_snapshot_and_its_parameters(stack: Stack) -> None:
    at, lines = await _snapshot(stack)
    assert at == 0 and lines == []
    resp, body = await _get(stack, "/corpus/snapshot.jsonl?after=3")
    assert _error(resp, body, 400, "invalid_parameter")["field"] == "after"


# --- GET /corpus -------------------------------------------------------------------------------


async def test_corpus_info(stack: Stack) -> None:
    resp, body = await _get(stack, "/corpus")
    info = orjson.loads(body)
    assert resp.status == 200
    assert info == {
        "corpus_id": str(stack.identity.corpus_id), "lineage": str(stack.identity.lineage),
        "head_sequence": 0, "earliest_sequence": 0,
        "counts": {"agents": 0, "conversations": 0, "messages": 0, "relationships": 0, "changes": 0},
        "archive": {"archived_through": 0, "verified_through": 0},
        "links": {"changes": "/corpus/changes.jsonl", "snapshot": "/corpus/snapshot.jsonl",
                  "stream": "/corpus/stream", "archive": "/corpus/archive"},
    }
    await _history(stack)
    await stack.register("quiet")  # agents with no activity count too
    sequences = [r["sequence"] for r in await stack.db.pool.fetch("select sequence from changes order by sequence")]
    info = orjson.loads((await _get(stack, "/corpus"))[1])
    assert (info["head_sequence"], info["earliest_sequence"]) == (sequences[-1], sequences[0])
    assert info["counts"] == {"agents": 3, "conversations": 2, "messages": 4, "relationships": 2, "changes": 7}


# --- identity ----------------------------------------------------------------------------------


async def test_a_node_with_an_identity_error_refuses_sync_with_503(stack: Stack) -> None:
    node = test_node(stack.db, stack.bus, identity_error=LineageMismatch("configured lineage differs"))
    async with serve(make_app(node)) as client:
        for path in ("/corpus", "/corpus/changes.jsonl?after=0", "/corpus/snapshot.jsonl"):
            resp = await client.get(path)
            body = await resp.read()
            _error(resp, body, 503, "lineage_unavailable")
            assert "X-Corpus-Lineage" not in resp.headers


async def _status_counts(stack: Stack, route: str) -> dict[str, float]:
    text = await (await stack.client.get("/metrics")).text()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^toastmachine_http_requests_total\{{method="GET",route="{re.escape(route)}",status="(\d+)"\}} (\S+)$',
        text, re.MULTILINE)}


@pytest.mark.parametrize("path", ["/corpus/changes.jsonl", "/corpus/snapshot.jsonl"])
async def test_an_export_read_to_its_end_then_closed_counts_as_delivered(stack: Stack, path: str) -> None:
    """A client that reads the whole chunked body and closes the connection at once (curl does)
    got its 200: the handler cancelled while it ends its transaction is not a client gone (499)."""
    await _history(stack)
    assert stack.client.server.port is not None
    rounds = 10
    for _ in range(rounds):
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.client.server.port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        async with asyncio.timeout(30):
            received = await reader.readuntil(b"\r\n0\r\n\r\n")  # the terminating chunk
        assert received.startswith(b"HTTP/1.1 200 ")
        writer.close()
        await writer.wait_closed()
    async with asyncio.timeout(30):  # the last handler may still be ending: its count follows
        while sum((counts := await _status_counts(stack, path)).values()) < rounds:
            await asyncio.sleep(0.02)
    assert counts == {"200": rounds}, counts


async def _http_chunks(resp: aiohttp.ClientResponse) -> list[bytes]:
    """The body as the server chunked it (chunked transfer coding), one item per HTTP chunk."""
    chunks: list[bytes] = []
    part = b""
    async for data, end_of_chunk in resp.content.iter_chunks():
        part += data
        if end_of_chunk:
            chunks.append(part)
            part = b""
    if part:
        chunks.append(part)
    return chunks


async def test_big_events_are_written_and_held_a_mebibyte_at_a_time(stack: Stack) -> None:
    """A page of large events is read and written about CHUNK_BYTES at a time once its first fetch
    (FIRST_FETCH_ROWS lines) showed how large they are, not FETCH_ROWS lines at once (which, near
    the 100 KiB event cap, held 100 MB per export); small ones go FETCH_ROWS at a time. The
    snapshot's chunks are bounded by bytes too. The bytes are the history's, in order."""
    from actors.web.export import CHUNK_BYTES, FIRST_FETCH_ROWS

    alice = await stack.register("alice")
    cid = (await stack.conversation(alice))["conversation"]["id"]
    big = "z" * 60_000
    for start in range(0, 100, 10):
        await asyncio.gather(*(stack.message(alice, cid, content=f"{start + i} {big}") for i in range(10)))
    for start in range(0, 300, 50):
        await asyncio.gather(*(stack.message(alice, cid, content=f"small {start + i}") for i in range(50)))
    stored = await _stored(stack)
    largest = max(len(line) for line in stored) + 1
    resp = await stack.client.get("/corpus/changes.jsonl?limit=10000")
    assert resp.status == 200
    chunks = await _http_chunks(resp)
    assert b"".join(chunks) == b"".join(line + b"\n" for line in stored)
    sizes = [len(c) for c in chunks]
    assert sizes[0] <= FIRST_FETCH_ROWS * largest, sizes
    assert max(sizes[1:]) <= CHUNK_BYTES + largest, sizes  # ~6 MB of large events: a few chunks of ~1 MB
    resp = await stack.client.get("/corpus/snapshot.jsonl")
    assert resp.status == 200
    chunks = await _http_chunks(resp)
    lines = _lines(b"".join(chunks))
    assert sum(line["kind"] == "message" for line in lines) == 401
    assert max(len(chunk) for chunk in chunks) <= CHUNK_BYTES + largest, [len(c) for c in chunks]


async def test_the_database_lost_right_after_the_status_line_cuts_the_connection(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The status line and headers are out when the export's database connection is terminated: the
    client gets an incomplete body (an error) at once, never a hang (the cursor used to be opened only
    after the status line, outside the streaming's own error handling). Both routes."""
    from actors.web import export

    await _history(stack)
    original = export._start

    async def start_then_lose_the_database(request: Any, headers: dict[str, str]) -> Any:
        response = await original(request, headers)
        await stack.db.pool.execute(
            "select pg_terminate_backend(pid) from pg_stat_activity where datname = current_database()"
            " and state like 'idle in transaction%' and pid <> pg_backend_pid()")
        return response

    monkeypatch.setattr(export, "_start", start_then_lose_the_database)
    for path in ("/corpus/changes.jsonl?limit=3", "/corpus/snapshot.jsonl"):
        resp = await stack.client.get(path)
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async with asyncio.timeout(15):
                await resp.read()
    monkeypatch.undo()
    resp, body = await _get(stack, "/corpus/changes.jsonl")  # the node serves the next one
    assert resp.status == 200 and len(_lines(body)) == len(await _stored(stack))
