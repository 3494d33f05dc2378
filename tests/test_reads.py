"""The public read routes of SPEC §3 over real HTTP: conversations, messages, search, tags,
relationships, agents, and their negotiation (JSON, JSON-LD, Markdown, HTML), ETag/304 and paging.

Every test runs on the embedded database with the in-process bus and on PostgreSQL with RabbitMQ
(the ``stack`` fixture). What a read returns is written through the public write routes first, and
expectations are computed from what those writes answered.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import orjson
from multidict import CIMultiDictProxy

from tests.corpus_fixtures import Agent, Stack

JSON = "application/json"
JSONLD = "application/ld+json"
MARKDOWN = "text/markdown"
HTML = "text/html"
KINDS = ("post", "claim", "challenge", "verification", "status-update", "question", "proposal")


# --- helpers ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    """An HTTP answer: status, body (decoded JSON, text, or None when empty), headers (any case)."""

    status: int
    body: Any
    headers: CIMultiDictProxy[str]


async def _get(stack: Stack, path: str, *, accept: str | None = None, params: Any = None,
               headers: dict[str, str] | None = None) -> Reply:
    """GET ``path``; the body decoded when it is JSON, else its text (None when empty)."""
    send = dict(headers or {})
    if accept is not None:
        send["Accept"] = accept
    resp = await stack.client.get(path, params=params, headers=send)
    raw = await resp.read()
    body: Any = raw.decode() if raw else None
    if raw and resp.content_type in (JSON, JSONLD):
        body = orjson.loads(raw)
    return Reply(resp.status, body, resp.headers)


async def _ok(stack: Stack, path: str, **kw: Any) -> Any:
    reply = await _get(stack, path, **kw)
    assert reply.status == 200, (path, reply.status, reply.body)
    return reply.body


def _error(reply: Reply, status: int, code: str) -> dict[str, Any]:
    assert reply.status == status, (reply.status, reply.body)
    assert reply.headers["Content-Type"].startswith(JSON), reply.headers
    assert set(reply.body) == {"error"}, reply.body
    err: dict[str, Any] = reply.body["error"]
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["how_to_proceed"], str) and err["how_to_proceed"]
    return err


async def _invalid(stack: Stack, path: str, field_name: str, **kw: Any) -> None:
    """``path`` answers 400 invalid_parameter naming ``field_name``."""
    err = _error(await _get(stack, path, **kw), 400, "invalid_parameter")
    assert err["field"] == field_name, (path, err)


def _query(url: str) -> dict[str, str]:
    """The query parameters of a (relative) link, one value each."""
    parsed = parse_qs(urlsplit(url).query, keep_blank_values=True)
    assert all(len(v) == 1 for v in parsed.values()), url
    return {k: v[0] for k, v in parsed.items()}


def _links(reply: Reply) -> dict[str, str]:
    """The Link header as {rel: url}."""
    header = reply.headers.get("Link")
    if not header:
        return {}
    found = re.findall(r'<([^>]*)>; rel="([a-z]+)"', header)
    assert ", ".join(f'<{u}>; rel="{r}"' for u, r in found) == header, header
    return {rel: url for url, rel in found}


def _ids(items: Iterable[dict[str, Any]]) -> list[str]:
    return [i["id"] for i in items]


async def _walk(stack: Stack, path: str, *, key: str = "items",
                between: Callable[[], Any] | None = None) -> tuple[list[dict[str, Any]], int]:
    """Every item of a collection, following ``next`` to the end; also the number of pages.

    Each page is checked: ``Link`` rel=next equals the body's next, ``X-Next-Cursor`` is the last
    item's sequence exactly when a cursor link follows. ``between`` (an async callable) runs
    concurrently with every page request after the first.
    """
    items: list[dict[str, Any]] = []
    pages = 0
    url: str | None = path
    while url is not None:
        if between is not None and pages:
            reply, _ = await asyncio.gather(_get(stack, url), between())
        else:
            reply = await _get(stack, url)
        assert reply.status == 200, (url, reply.body)
        pages += 1
        assert pages < 200, "paging does not end"
        page = reply.body[key]
        items.extend(page)
        url = reply.body["next"]
        links = _links(reply)
        assert links.get("next") == url and links.get("prev") == reply.body.get("prev"), (links, reply.body)
        if url is None:
            assert "X-Next-Cursor" not in reply.headers
        else:
            q = _query(url)
            if "after" in q or "before" in q:
                cursor = q.get("after") if key == "messages" or "after" in q else q["before"]
                assert reply.headers["X-Next-Cursor"] == cursor
                last = page[-1]
                assert int(cursor) == last.get("sequence", last.get("last_sequence")), (cursor, last)
    return items, pages


@dataclass(slots=True)
class Written:
    """What a test wrote, as the write routes answered it."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    conversations: dict[str, dict[str, Any]] = field(default_factory=dict)

    def keep(self, reply: dict[str, Any]) -> dict[str, Any]:
        if "conversation" in reply:
            self.conversations[reply["conversation"]["id"]] = reply["conversation"]
        self.messages.append(reply["message"])
        return reply["message"]  # type: ignore[no-any-return]

    def newest_first(self, keep: Callable[[dict[str, Any]], bool] = lambda m: True) -> list[str]:
        return [m["id"] for m in sorted(self.messages, key=lambda m: -m["sequence"]) if keep(m)]


async def _corpus(stack: Stack) -> tuple[Written, dict[str, Agent]]:
    """Three agents, two conversations, messages with kinds, tags, mentions and a payload."""
    alice, bob, carol = await stack.register("alice"), await stack.register("Bob"), await stack.register("carol")
    w = Written()
    c1 = await stack.conversation(alice, "one", content="hello @bob #intro #Ops", kinds=["question"])
    cid1 = c1["conversation"]["id"]
    w.keep(c1)
    w.keep(await stack.message(bob, cid1, content="a claim #ops", kinds=["claim", "post"]))
    c2 = await stack.conversation(bob, "two", content="hi @alice and @CAROL #intro", kinds=["proposal"])
    cid2 = c2["conversation"]["id"]
    w.keep(c2)
    w.keep(await stack.message(carol, cid2, content="status #ops for @bob", kinds=["status-update"]))
    w.keep(await stack.message(alice, cid2, payload={"x": 1}))
    w.keep(await stack.message(carol, cid1, content="challenge #other", kinds=["challenge", "question"]))
    return w, {"alice": alice, "bob": bob, "carol": carol}


# --- GET /messages: filters ---------------------------------------------------------------------


async def test_message_filters_and_their_combinations(stack: Stack) -> None:
    w, _ = await _corpus(stack)
    cid1, cid2 = list(w.conversations)
    by_seq = sorted(w.messages, key=lambda m: m["sequence"])
    # The stored representation is the one the write answered; kinds in canonical order.
    everything = await _ok(stack, "/messages")
    assert everything["items"] == sorted(w.messages, key=lambda m: -m["sequence"])
    assert everything["next"] is None and "total" not in everything
    assert by_seq[1]["kinds"] == ["post", "claim"] and by_seq[5]["kinds"] == ["challenge", "question"]
    assert by_seq[0]["tags"] == ["intro", "ops"]
    assert [x["name"] for x in by_seq[2]["mentions"]] == ["alice", "carol"]

    def author(name: str) -> Callable[[dict[str, Any]], bool]:
        return lambda m: m["author"]["name"].lower() == name

    def mentions(name: str) -> Callable[[dict[str, Any]], bool]:
        return lambda m: any(x["name"].lower() == name for x in m["mentions"])

    cases: list[tuple[dict[str, str], Callable[[dict[str, Any]], bool]]] = [
        ({"conversation": cid1}, lambda m: m["conversation_id"] == cid1),
        ({"conversation": cid2.upper()}, lambda m: m["conversation_id"] == cid2),
        ({"conversation": str(uuid.uuid4())}, lambda m: False),
        ({"author": "bob"}, author("bob")),
        ({"author": "BOB"}, author("bob")),
        ({"author": "nobody-at-all"}, lambda m: False),
        ({"kinds": "claim"}, lambda m: "claim" in m["kinds"]),
        ({"kinds": "post"}, lambda m: "post" in m["kinds"]),
        ({"kinds": "question,proposal"}, lambda m: bool({"question", "proposal"} & set(m["kinds"]))),
        ({"kinds": "proposal,question"}, lambda m: bool({"question", "proposal"} & set(m["kinds"]))),
        ({"kinds": "verification"}, lambda m: False),
        ({"tag": "ops"}, lambda m: "ops" in m["tags"]),
        ({"tag": "Ops"}, lambda m: False),  # tags are stored lowercased; the filter is exact
        ({"tag": "intro"}, lambda m: "intro" in m["tags"]),
        ({"mention": "bob"}, mentions("bob")),
        ({"mention": "Carol"}, mentions("carol")),
        ({"mention": "nobody-at-all"}, lambda m: False),
        ({"conversation": cid2, "mention": "bob", "kinds": "status-update"},
         lambda m: m["conversation_id"] == cid2 and mentions("bob")(m) and "status-update" in m["kinds"]),
        ({"tag": "ops", "author": "Bob"}, lambda m: "ops" in m["tags"] and author("bob")(m)),
        ({"tag": "intro", "mention": "carol"}, lambda m: "intro" in m["tags"] and mentions("carol")(m)),
        ({"conversation": cid1, "kinds": "question", "author": "carol"},
         lambda m: m["conversation_id"] == cid1 and "question" in m["kinds"] and author("carol")(m)),
        ({"author": "alice", "kinds": "claim"}, lambda m: False),
    ]
    for params, keep in cases:
        expected = w.newest_first(keep)
        body = await _ok(stack, "/messages", params=params)
        assert _ids(body["items"]) == expected, params
        asc = await _ok(stack, "/messages", params={**params, "after": "0"})
        assert _ids(asc["items"]) == expected[::-1], params
        # Every filter survives paging: one item per page, following next.
        paged, _ = await _walk(stack, "/messages?" + urlencode({**params, "limit": "1"}))
        assert _ids(paged) == expected, params
    # A non-empty filter combination exists for each case that should match something.
    assert sum(1 for _, keep in cases if w.newest_first(keep)) >= 14


async def test_kinds_are_any_of_and_canonicalised_in_links(stack: Stack) -> None:
    await _corpus(stack)
    body = await _ok(stack, "/messages", params={"kinds": "question,claim", "limit": "1"})
    # The next link carries the kinds in canonical order, whatever order they were sent in.
    assert _query(body["next"])["kinds"] == "claim,question"
    for bad in ("bogus", "", "post,", ",post", "post,post", "Post", "post, claim", "claim,claim,post"):
        await _invalid(stack, "/messages", "kinds", params={"kinds": bad})


async def test_filter_values_are_validated(stack: Stack) -> None:
    for params, name in [
        ({"conversation": "not-a-uuid"}, "conversation"), ({"conversation": ""}, "conversation"),
        ({"author": "ab"}, "author"), ({"author": "has space"}, "author"), ({"author": "x" * 33}, "author"),
        ({"mention": "é-accent"}, "mention"), ({"tag": ""}, "tag"), ({"tag": "a\x01b"}, "tag"),
        ({"tag": "t" * 201}, "tag"), ({"order": "up"}, "order"), ({"order": "ASC"}, "order"),
        ({"unknown": "1"}, "unknown"), ({"Limit": "1"}, "Limit"), ({"q": "x"}, "q"),
    ]:
        await _invalid(stack, "/messages", name, params=params)


# --- GET /messages: paging rules ----------------------------------------------------------------


async def _line(stack: Stack, n: int) -> tuple[Agent, str, list[int], list[str]]:
    """One agent, one conversation of ``n`` messages (the root included): (agent, cid, sequences, ids)."""
    agent = await stack.register()
    first = await stack.conversation(agent, "a line", content="message 0")
    cid = first["conversation"]["id"]
    sequences, ids = [first["sequence"]], [first["message"]["id"]]
    for i in range(1, n):
        reply = await stack.message(agent, cid, content=f"message {i}")
        sequences.append(reply["sequence"])
        ids.append(reply["message"]["id"])
    return agent, cid, sequences, ids


async def test_cursor_and_offset_rules(stack: Stack) -> None:
    _, _, seqs, _ = await _line(stack, 7)
    assert seqs == sorted(seqs)

    async def sequences(params: dict[str, str]) -> list[int]:
        return [m["sequence"] for m in (await _ok(stack, "/messages", params=params))["items"]]

    assert await sequences({}) == seqs[::-1]  # newest first by default
    assert await sequences({"order": "desc"}) == seqs[::-1]
    assert await sequences({"order": "asc"}) == seqs
    assert await sequences({"after": str(seqs[2])}) == seqs[3:]  # exclusive, ascending
    assert await sequences({"after": str(seqs[2]), "order": "asc"}) == seqs[3:]
    assert await sequences({"after": str(seqs[-1])}) == []
    assert await sequences({"before": str(seqs[4])}) == seqs[:4][::-1]  # exclusive, newest first
    assert await sequences({"before": str(seqs[4]), "order": "asc"}) == seqs[:4]
    assert await sequences({"before": str(seqs[0])}) == []
    assert await sequences({"after": str(seqs[1]), "before": str(seqs[5])}) == seqs[2:5]
    assert await sequences({"before": "0"}) == []
    assert await sequences({"after": "0"}) == seqs
    assert await sequences({"after": str(2**53 - 1)}) == []
    # before + offset: continuation by offset, next keeps before and moves the offset.
    body = await _ok(stack, "/messages", params={"before": str(seqs[5]), "offset": "1", "limit": "2"})
    assert [m["sequence"] for m in body["items"]] == [seqs[3], seqs[2]]
    assert _query(body["next"]) == {"before": str(seqs[5]), "offset": "3", "limit": "2"}
    assert _query(body["prev"]) == {"before": str(seqs[5]), "offset": "0", "limit": "2"}
    rest, _ = await _walk(stack, body["next"])
    assert [m["sequence"] for m in rest] == [seqs[1], seqs[0]]
    assert await sequences({"offset": "2", "limit": "2"}) == [seqs[4], seqs[3]]
    # Cursor walks inside a window, both ways: the window's bounds stay in every next link.
    windows: list[tuple[dict[str, Any], list[int]]] = [
        ({"before": seqs[5], "order": "asc"}, seqs[:5]),
        ({"before": seqs[5]}, seqs[:5][::-1]),
        ({"after": seqs[0], "before": seqs[6]}, seqs[1:6]),
        ({"order": "asc", "after": seqs[3]}, seqs[4:])]
    for params, expected in windows:
        walked, pages = await _walk(stack, "/messages?" + urlencode({**params, "limit": 2}))
        assert [m["sequence"] for m in walked] == expected, params
        assert pages == max(1, -(-len(expected) // 2)), params
    assert await sequences({"offset": "7"}) == []
    # after cannot take an offset or a descending order.
    await _invalid(stack, "/messages", "offset", params={"after": "1", "offset": "0"})
    await _invalid(stack, "/messages", "order", params={"after": "1", "order": "desc"})
    # limit: 1..1000.
    assert await sequences({"limit": "1"}) == [seqs[-1]]
    assert await sequences({"limit": "1000"}) == seqs[::-1]
    for bad in ("0", "1001", "abc", "-1", "", "1.5", " 5", "+5", "1e3", "١"):
        await _invalid(stack, "/messages", "limit", params={"limit": bad})
    # Sequences are non-negative integers, the field named.
    for name in ("after", "before"):
        for bad in ("-1", "1.5", "abc", "", " 1", "1 ", "0x10", "+1", "99999999999999999999", str(2**53), "１"):
            await _invalid(stack, "/messages", name, params={name: bad})
    for bad in ("-1", "x", "100001"):
        await _invalid(stack, "/messages", "offset", params={"offset": bad})
    # A repeated parameter is ambiguous: 400 naming it, whatever the values (only /tags takes the first).
    for repeated in ([("limit", "2"), ("limit", "abc")], [("limit", "abc"), ("limit", "2")],
                     [("limit", "2"), ("limit", "2")], [("limit", "2"), ("after", "0"), ("limit", "3")]):
        await _invalid(stack, "/messages", "limit", params=repeated)
    await _invalid(stack, "/messages", "after", params=[("after", str(seqs[4])), ("after", "0")])
    await _invalid(stack, "/messages", "kinds", params=[("kinds", "post"), ("kinds", "claim")])


async def test_limit_defaults_to_100(stack: Stack) -> None:
    agent = await stack.register()
    first = await stack.conversation(agent, "many")
    cid = first["conversation"]["id"]
    for _ in range(4):
        await asyncio.gather(*(stack.message(agent, cid, content="m") for _ in range(25)))
    body = await _ok(stack, "/messages")
    assert len(body["items"]) == 100
    assert body["next"] is not None
    rest = await _ok(stack, body["next"])
    assert len(rest["items"]) == 1 and rest["next"] is None
    assert rest["items"][0]["sequence"] == first["sequence"]
    whole = await _ok(stack, "/messages", params={"limit": "1000"})
    assert len(whole["items"]) == 101 and whole["next"] is None


async def test_following_next_visits_every_message_once_in_both_directions(stack: Stack) -> None:
    _, cid, seqs, ids = await _line(stack, 10)
    other = await stack.register()
    await stack.conversation(other, "elsewhere")
    for limit in (1, 3, 4, 10):
        down, pages = await _walk(stack, f"/messages?conversation={cid}&limit={limit}")
        assert _ids(down) == ids[::-1], limit
        assert pages == max(1, -(-10 // limit)), limit
        up, _ = await _walk(stack, f"/messages?conversation={cid}&after=0&limit={limit}")
        assert _ids(up) == ids, limit
        asc, _ = await _walk(stack, f"/messages?conversation={cid}&order=asc&limit={limit}")
        assert _ids(asc) == ids, limit
        offset, _ = await _walk(stack, f"/messages?conversation={cid}&offset=0&limit={limit}")
        assert _ids(offset) == ids[::-1], limit
    first = await _get(stack, f"/messages?conversation={cid}&limit=3")
    assert first.headers["X-Next-Cursor"] == str(seqs[-3])
    assert _query(first.body["next"]) == {"conversation": cid, "before": str(seqs[-3]), "limit": "3"}
    assert first.headers["Link"] == f'<{first.body["next"]}>; rel="next"'
    assert "prev" not in first.body


async def test_cursor_pages_never_skip_or_repeat_while_writes_land(stack: Stack) -> None:
    _, cid, _, _ = await _line(stack, 6)
    writers = [await stack.register() for _ in range(3)]

    # Forward: the walk also picks up what was written while it ran, each message once, in order.
    # (Three writes per page of two: the writes stop after five pages, or the walk never ends.)
    rounds = [5]

    async def write_some() -> None:
        if rounds[0] > 0:
            rounds[0] -= 1
            await asyncio.gather(*(stack.message(w, cid, content="concurrent") for w in writers))

    up, _ = await _walk(stack, "/messages?after=0&limit=2", between=write_some)
    everything = [r["message_id"] for r in await stack.db.pool.fetch(
        "select message_id from message_feed order by sequence")]
    assert _ids(up) == [str(i) for i in everything]
    assert len(everything) > 6
    # Backward: exactly the messages older than the first page's cursor, none twice, none missed.
    head = await _ok(stack, "/messages?limit=1")
    top = head["items"][0]["sequence"]
    rounds[0] = 5
    down, _ = await _walk(stack, "/messages?limit=2", between=write_some)
    assert down[0]["sequence"] >= top
    first_top = down[0]["sequence"]
    expected = [str(r["message_id"]) for r in await stack.db.pool.fetch(
        "select message_id from message_feed where sequence <= $1 order by sequence desc", first_top)]
    assert _ids(down) == expected


# --- GET /conversations -------------------------------------------------------------------------


async def test_conversations_newest_activity_first_with_total_and_paging(stack: Stack) -> None:
    alice, bob = await stack.register("alice"), await stack.register("bob")
    made = [await stack.conversation(a, f"subject {i}") for i, a in enumerate((alice, bob, alice))]
    cids = [m["conversation"]["id"] for m in made]
    body = await _ok(stack, "/conversations")
    assert _ids(body["items"]) == cids[::-1]
    assert body["total"] == 3 and body["next"] is None
    assert body["items"][-1] == made[0]["conversation"]  # the representation the write answered
    # Appending to the oldest moves it to the top, with its activity.
    reply = await stack.message(bob, cids[0], content="bump")
    body = await _ok(stack, "/conversations")
    assert _ids(body["items"]) == [cids[0], cids[2], cids[1]]
    top = body["items"][0]
    assert (top["message_count"], top["last_sequence"]) == (2, reply["sequence"])
    assert top["created_sequence"] == made[0]["sequence"] and top["root_message_id"] == made[0]["message"]["id"]
    assert set(top) == {"id", "subject", "author", "root_message_id", "created_sequence", "created_at",
                        "message_count", "last_sequence"}
    # Cursor paging on last_sequence.
    walked, pages = await _walk(stack, "/conversations?limit=1")
    assert _ids(walked) == [cids[0], cids[2], cids[1]] and pages == 3
    page = await _get(stack, "/conversations?limit=1")
    assert page.headers["X-Next-Cursor"] == str(reply["sequence"])
    assert _query(page.body["next"]) == {"before": str(reply["sequence"]), "limit": "1"}
    before = await _ok(stack, "/conversations", params={"before": str(reply["sequence"])})
    assert _ids(before["items"]) == [cids[2], cids[1]] and before["total"] == 3
    # Offset paging.
    off = await _ok(stack, "/conversations", params={"offset": "1", "limit": "1"})
    assert _ids(off["items"]) == [cids[2]] and off["total"] == 3
    assert _query(off["next"]) == {"offset": "2", "limit": "1"}
    assert _query(off["prev"]) == {"offset": "0", "limit": "1"}
    walked, _ = await _walk(stack, "/conversations?offset=0&limit=2")
    assert _ids(walked) == [cids[0], cids[2], cids[1]]
    past = await _ok(stack, "/conversations", params={"offset": "10"})
    assert past["items"] == [] and past["total"] == 3 and past["next"] is None
    # Filter by the conversation's author (total counts the filter).
    mine = await _ok(stack, "/conversations", params={"author": "ALICE"})
    assert _ids(mine["items"]) == [cids[0], cids[2]] and mine["total"] == 2
    for params, name in [({"before": "-1"}, "before"), ({"before": "x"}, "before"), ({"limit": "0"}, "limit"),
                         ({"offset": "-2"}, "offset"), ({"author": "a"}, "author"), ({"after": "1"}, "after")]:
        await _invalid(stack, "/conversations", name, params=params)


async def test_one_conversation_with_its_messages_paged_by_after(stack: Stack) -> None:
    _, cid, seqs, ids = await _line(stack, 5)
    other = await stack.register()
    await stack.conversation(other, "unrelated")
    body = await _ok(stack, f"/conversations/{cid}")
    assert body["conversation"]["id"] == cid
    assert body["conversation"]["message_count"] == 5
    assert body["conversation"]["last_sequence"] == seqs[-1]
    assert body["conversation"]["created_sequence"] == seqs[0]
    assert _ids(body["messages"]) == ids and body["next"] is None  # oldest first
    page = await _get(stack, f"/conversations/{cid}?limit=2")
    assert _ids(page.body["messages"]) == ids[:2]
    assert _query(page.body["next"]) == {"after": str(seqs[1]), "limit": "2"}
    assert page.headers["X-Next-Cursor"] == str(seqs[1])
    assert page.headers["Link"] == f'<{page.body["next"]}>; rel="next"'
    walked, pages = await _walk(stack, f"/conversations/{cid}?limit=2", key="messages")
    assert _ids(walked) == ids and pages == 3
    after = await _ok(stack, f"/conversations/{cid}", params={"after": str(seqs[2])})
    assert _ids(after["messages"]) == ids[3:]
    # Any spelling of the UUID, answered in canonical form.
    upper = await _ok(stack, f"/conversations/{cid.upper()}")
    assert upper["conversation"]["id"] == cid
    _error(await _get(stack, f"/conversations/{uuid.uuid4()}"), 404, "conversation_not_found")
    _error(await _get(stack, f"/conversations/{ids[0]}"), 404, "conversation_not_found")  # a message id
    for bad in ("nope", "123", cid + "0", "%20"):
        await _invalid(stack, f"/conversations/{bad}", "id")
    for params, name in [({"after": "-1"}, "after"), ({"limit": "1001"}, "limit"), ({"offset": "1"}, "offset"),
                         ({"before": "5"}, "before")]:
        await _invalid(stack, f"/conversations/{cid}", name, params=params)


# --- GET /messages/{id} -------------------------------------------------------------------------


async def test_one_message_payload_null_absent_and_schema(stack: Stack) -> None:
    alice = await stack.register("alice")
    bob = await stack.register("bob")
    root = await stack.conversation(alice, "payloads", content="text only @bob #t")
    cid = root["conversation"]["id"]
    null = await stack.message(alice, cid, payload=None)
    value = await stack.message(alice, cid, payload={"b": [1, 2.5, "x"], "a": None}, content="both")
    schema = await stack.message(bob, cid, payload={"statement": "it works", "confidence": 0.5},
                                 schema_name="claim", schema_version=1, kinds=["claim"],
                                 reply_to=root["message"]["id"])
    got = {name: await _get(stack, f"/messages/{w['message']['id']}")
           for name, w in (("root", root), ("null", null), ("value", value), ("schema", schema))}
    for name, w in (("root", root), ("null", null), ("value", value), ("schema", schema)):
        assert got[name].status == 200
        assert got[name].body == w["message"], name  # the same representation as the write answered
        assert "Last-Modified" in got[name].headers
    assert "payload" not in got["root"].body
    assert "payload" in got["null"].body and got["null"].body["payload"] is None
    assert "content" not in got["null"].body
    assert got["value"].body["payload"] == {"b": [1, 2.5, "x"], "a": None}
    assert got["schema"].body["schema_validated"] is True
    assert (got["schema"].body["schema_name"], got["schema"].body["schema_version"]) == ("claim", 1)
    assert got["schema"].body["reply_to"] == root["message"]["id"]
    for name in ("root", "null", "value"):
        body = got[name].body
        assert not {"schema_validated", "schema_name", "schema_version", "reply_to"} & set(body), name
    assert got["root"].body["mentions"] == [{"agent_id": bob.agent_id, "name": "bob"}]
    assert got["root"].body["tags"] == ["t"]
    # The raw bytes keep the difference too: "payload":null is in the text, absent is absent.
    raw = await (await stack.client.get(f"/messages/{null['message']['id']}")).read()
    assert b'"payload":null' in raw
    raw = await (await stack.client.get(f"/messages/{root['message']['id']}")).read()
    assert b'"payload"' not in raw
    # Lists show the same representations.
    listed = await _ok(stack, "/messages", params={"conversation": cid, "after": "0"})
    assert listed["items"] == [root["message"], null["message"], value["message"], schema["message"]]
    conv = await _ok(stack, f"/conversations/{cid}")
    assert conv["messages"] == listed["items"]
    _error(await _get(stack, f"/messages/{uuid.uuid4()}"), 404, "message_not_found")
    await _invalid(stack, "/messages/not-an-id", "id")
    await _invalid(stack, f"/messages/{root['message']['id']}?limit=1", "limit")


# --- GET /relationships -------------------------------------------------------------------------


async def test_relationships_filters_retractions_and_paging(stack: Stack) -> None:
    alice, bob, carol = (await stack.register("alice"), await stack.register("bob"),
                         await stack.register("carol"))
    root = await stack.conversation(alice, "rels", content="a question", kinds=["question"])
    cid, a = root["conversation"]["id"], root["message"]["id"]
    b = (await stack.message(bob, cid, content="a claim", kinds=["claim"]))["message"]["id"]
    c = (await stack.message(carol, cid, content="no"))["message"]["id"]

    async def assert_(agent: Agent, rtype: str, source: str, target: str) -> dict[str, Any]:
        reply = await stack.post(agent, "/relationships", {"type": rtype, "source_message_id": source,
                                                           "target_message_id": target})
        assert reply.status == 201, reply.body
        return reply.body["relationship"]  # type: ignore[no-any-return]

    r1 = await assert_(bob, "extends", b, a)
    r2 = await assert_(alice, "supports", a, c)
    r3 = await assert_(carol, "contradicts", c, b)
    retraction = await stack.post(bob, f"/relationships/{r1['id']}/retractions")
    assert retraction.status == 201, retraction.body
    rx = retraction.body["retraction"]

    async def listed(**params: str) -> list[dict[str, Any]]:
        return (await _ok(stack, "/relationships", params=params))["items"]  # type: ignore[no-any-return]

    active = await listed()
    assert active == [r2, r3]  # the representations the writes answered, in sequence order
    assert all(r["retracted"] is False and "retraction" not in r for r in active)
    every = await listed(include_retracted="true")
    assert _ids(every) == [r1["id"], r2["id"], r3["id"]]
    assert every[0]["retracted"] is True
    assert every[0]["retraction"] == {"id": rx["id"], "sequence": rx["sequence"], "created_at": rx["created_at"]}
    assert {k: v for k, v in every[0].items() if k not in ("retracted", "retraction")} == {
        k: v for k, v in r1.items() if k not in ("retracted", "retraction")}
    assert await listed(include_retracted="false") == active
    assert _ids(await listed(message=b)) == [r3["id"]]
    assert _ids(await listed(message=b, include_retracted="true")) == [r1["id"], r3["id"]]
    assert _ids(await listed(message=a)) == [r2["id"]]
    assert _ids(await listed(source=a)) == [r2["id"]]
    assert _ids(await listed(target=b)) == [r3["id"]]
    assert _ids(await listed(source=b, include_retracted="true")) == [r1["id"]]
    assert await listed(source=b) == []
    assert _ids(await listed(type="contradicts")) == [r3["id"]]
    assert _ids(await listed(type="extends", include_retracted="true")) == [r1["id"]]
    assert await listed(type="retracts") == []
    assert _ids(await listed(author="CAROL")) == [r3["id"]]
    assert _ids(await listed(author="alice", target=c)) == [r2["id"]]
    assert await listed(author="alice", target=b) == []
    assert await listed(message=str(uuid.uuid4())) == []
    # Paging: cursor on the assertion's sequence, or offset.
    walked, pages = await _walk(stack, "/relationships?include_retracted=true&limit=1")
    assert _ids(walked) == [r1["id"], r2["id"], r3["id"]] and pages == 3
    page = await _get(stack, "/relationships?include_retracted=true&limit=2")
    assert _query(page.body["next"]) == {"include_retracted": "true", "limit": "2", "after": str(r2["sequence"])}
    assert page.headers["X-Next-Cursor"] == str(r2["sequence"])
    assert _ids(await listed(after=str(r2["sequence"]), include_retracted="true")) == [r3["id"]]
    off = await _ok(stack, "/relationships", params={"offset": "1", "limit": "1", "include_retracted": "true"})
    assert _ids(off["items"]) == [r2["id"]]
    assert _query(off["next"])["offset"] == "2" and _query(off["prev"])["offset"] == "0"
    walked, _ = await _walk(stack, "/relationships?offset=0&limit=1")
    assert _ids(walked) == [r2["id"], r3["id"]]
    for params, name in [({"include_retracted": "yes"}, "include_retracted"), ({"include_retracted": ""},
                          "include_retracted"), ({"type": "likes"}, "type"), ({"message": "x"}, "message"),
                         ({"source": "1"}, "source"), ({"target": ""}, "target"), ({"author": "!!!"}, "author"),
                         ({"after": "1", "offset": "0"}, "offset"), ({"after": "-5"}, "after"),
                         ({"limit": "0"}, "limit"), ({"conversation": cid}, "conversation")]:
        await _invalid(stack, "/relationships", name, params=params)


# --- GET /agents --------------------------------------------------------------------------------


async def test_agent_directory_and_activity(stack: Stack) -> None:
    alice = await stack.register("alice")
    bob = await stack.register("bob")
    carol = await stack.register("Carol")
    await stack.register("dave", onboard=False)
    c1 = await stack.conversation(alice, "one")
    cid1 = c1["conversation"]["id"]
    await stack.message(alice, cid1, content="again")
    c2 = await stack.conversation(alice, "two")
    bob_msg = await stack.message(bob, cid1, content="hello")
    rel = await stack.post(bob, "/relationships", {"type": "extends", "source_message_id": bob_msg["message"]["id"],
                                                   "target_message_id": c2["message"]["id"]})
    assert rel.status == 201, rel.body

    body = await _ok(stack, "/agents")
    assert [a["name"] for a in body["items"]] == ["alice", "bob", "Carol", "dave"]  # case-insensitive order
    assert body["total"] == 4 and body["next"] is None
    by_name = {a["name"]: a for a in body["items"]}
    assert by_name["alice"]["activity"] == {"message_count": 3, "conversation_count": 2,
                                            "last_sequence": c2["sequence"]}
    assert by_name["bob"]["activity"] == {"message_count": 1, "conversation_count": 1,
                                          "last_sequence": rel.body["sequence"]}  # the assertion counts
    assert by_name["Carol"]["activity"] == {"message_count": 0, "conversation_count": 0}  # absent, not null
    assert by_name["dave"]["activity"] == by_name["Carol"]["activity"]
    assert by_name["Carol"]["agent_id"] == carol.agent_id
    assert set(by_name["Carol"]) == {"agent_id", "name", "created_at", "activity"}  # no description: absent
    # A retraction is activity too.
    retraction = await stack.post(bob, f"/relationships/{rel.body['relationship']['id']}/retractions")
    assert retraction.status == 201
    bob_now = await _ok(stack, "/agents/BOB")
    assert bob_now["activity"]["last_sequence"] == retraction.body["sequence"]
    assert bob_now["activity"]["message_count"] == 1
    # Sorts.
    by_count = await _ok(stack, "/agents", params={"sort": "message_count"})
    assert [a["name"] for a in by_count["items"]] == ["alice", "bob", "Carol", "dave"]
    await stack.message(carol, cid1, content="late")
    await stack.message(carol, c2["conversation"]["id"], content="later")
    by_count = await _ok(stack, "/agents", params={"sort": "message_count"})
    assert [a["name"] for a in by_count["items"]] == ["alice", "Carol", "bob", "dave"]
    by_recent = await _ok(stack, "/agents", params={"sort": "last_sequence"})
    assert [a["name"] for a in by_recent["items"]] == ["Carol", "bob", "alice", "dave"]  # no activity last
    assert (await _ok(stack, "/agents/carol"))["activity"]["conversation_count"] == 2
    # Offset paging, sort kept in the links.
    page = await _ok(stack, "/agents", params={"sort": "last_sequence", "limit": "3"})
    assert page["total"] == 4 and len(page["items"]) == 3 and page["prev"] is None
    assert _query(page["next"]) == {"sort": "last_sequence", "limit": "3", "offset": "3"}
    walked, pages = await _walk(stack, "/agents?sort=last_sequence&limit=3")
    assert [a["name"] for a in walked] == ["Carol", "bob", "alice", "dave"] and pages == 2
    last = await _ok(stack, page["next"])
    assert _query(last["prev"]) == {"sort": "last_sequence", "limit": "3", "offset": "0"}
    past = await _ok(stack, "/agents", params={"offset": "50"})
    assert past["items"] == [] and past["total"] == 4
    # One agent, by any case of its name.
    for spelling in ("Carol", "carol", "CAROL"):
        assert (await _ok(stack, f"/agents/{spelling}"))["agent_id"] == carol.agent_id
    _error(await _get(stack, "/agents/nobody-here"), 404, "agent_not_found")
    for bad in ("ab", "has%20space", "x" * 33, "%C3%A9t%C3%A9", "a.b.c"):
        await _invalid(stack, f"/agents/{bad}", "name")
    for params, name in [({"sort": "age"}, "sort"), ({"sort": ""}, "sort"), ({"limit": "1001"}, "limit"),
                         ({"offset": "-1"}, "offset"), ({"name": "alice"}, "name")]:
        await _invalid(stack, "/agents", name, params=params)
    await _invalid(stack, "/agents/alice?x=1", "x")


# --- GET /search --------------------------------------------------------------------------------


async def test_search_ranking_words_stemming_syntax_filters_and_paging(stack: Stack) -> None:
    alice, bob = await stack.register("alice"), await stack.register("bob")
    root = await stack.conversation(alice, "search", content="retry the operation token retry retry #ops")
    cid = root["conversation"]["id"]
    m = {"dense": root["message"]["id"]}
    for name, agent, content, kinds in [
        ("sparse", bob, ("retry once, then give up: a long list of other unrelated words follows here "
                         "and none of them matter at all for anything"), ["claim"]),
        ("far", alice, "operation one two three four five six seven eight nine ten token", ["post"]),
        ("table", bob, "it is on the table", ["question"]),
        ("engine", alice, "the engine runs hot", ["post"]),
        ("script", bob, "nothing to see", ["post"]),
    ]:
        m[name] = (await stack.message(agent, cid, content=content, kinds=kinds))["message"]["id"]
    payload_only = (await stack.message(alice, cid, payload={"retry": "retry"}))["message"]["id"]
    other = await stack.conversation(bob, "other", content="retry elsewhere @alice")
    m["other"] = other["message"]["id"]

    async def hits(q: str, **params: str) -> list[str]:
        body = await _ok(stack, "/search", params={"q": q, **params})
        assert body["total"] == len(body["items"]) or body["next"] is not None
        ranks = [h["rank"] for h in body["items"]]
        assert ranks == sorted(ranks, reverse=True)
        return [h["message"]["id"] for h in body["items"]]

    # Ranking: more occurrences rank higher; adjacent terms rank above distant ones.
    found = await hits("retry")
    assert found[0] == m["dense"] and set(found) == {m["dense"], m["sparse"], m["other"]}
    assert payload_only not in found  # search covers content only
    assert (await hits("operation token"))[:2] == [m["dense"], m["far"]]
    # Short common words are findable.
    assert await hits("is on") == [m["table"]]
    assert set(await hits("the")) == {m["dense"], m["table"], m["engine"]}
    assert await hits("it") == [m["table"]]
    # Stemming: other forms of a word.
    assert await hits("running") == [m["engine"]]
    assert await hits("engines") == [m["engine"]]
    assert set(await hits("retrying")) == {m["dense"], m["sparse"], m["other"]}
    # websearch syntax: quoted phrase, exclusion, or.
    assert await hits('"operation token"') == [m["dense"]]
    assert set(await hits("retry -token")) == {m["sparse"], m["other"]}
    assert set(await hits("engine or table")) == {m["engine"], m["table"]}
    assert await hits("engine table") == []
    assert set(await hits("table OR engine -hot")) == {m["table"]}  # table | (engine & !hot)
    assert set(await hits("engine OR table -hot")) == {m["engine"], m["table"]}
    assert await hits("zebra") == []
    # The message filters.
    assert set(await hits("retry", author="bob")) == {m["sparse"], m["other"]}
    assert await hits("retry", conversation=cid, author="BOB") == [m["sparse"]]
    assert await hits("retry", kinds="claim,question") == [m["sparse"]]
    assert await hits("retry", tag="ops") == [m["dense"]]
    assert await hits("retry", mention="alice") == [m["other"]]
    assert await hits("retry", tag="none") == []
    # Offset paging: next keeps q and the filters, total counts every hit.
    first = await _ok(stack, "/search", params={"q": "retry", "author": "bob", "limit": "1"})
    assert first["total"] == 2 and len(first["items"]) == 1
    assert _query(first["next"]) == {"q": "retry", "author": "bob", "limit": "1", "offset": "1"}
    walked, pages = await _walk(stack, "/search?" + urlencode({"q": "the", "limit": "2"}))
    assert pages == 2
    assert [h["message"]["id"] for h in walked] == await hits("the")
    last = await _ok(stack, "/search", params={"q": "the", "limit": "2", "offset": "2"})
    assert last["next"] is None and last["total"] == 3
    assert _query(last["prev"]) == {"q": "the", "limit": "2", "offset": "0"}
    past = await _ok(stack, "/search", params={"q": "the", "offset": "99"})
    assert past["items"] == [] and past["total"] == 3 and past["next"] is None
    hit = (await _ok(stack, "/search", params={"q": "engine"}))["items"][0]
    assert set(hit) == {"rank", "message"} and hit["rank"] > 0
    assert hit["message"] == (await _ok(stack, f"/messages/{m['engine']}"))
    # q is required and must say something.
    await _invalid(stack, "/search", "q")
    for blank in ("", "   ", "\t", "x" * 501, "a\x00b"):
        await _invalid(stack, "/search", "q", params={"q": blank})
    for params, name in [({"after": "1"}, "after"), ({"order": "asc"}, "order"), ({"kinds": "nope"}, "kinds"),
                         ({"limit": "0"}, "limit"), ({"offset": "x"}, "offset"), ({"author": "a"}, "author")]:
        await _invalid(stack, "/search", name, params={"q": "retry", **params})
    # Only punctuation or operators: a valid query that matches nothing, not an error.
    for odd in ("!!!", '"', "-", "or", "&|!()", "'", ":*"):
        body = await _ok(stack, "/search", params={"q": odd})
        assert body["items"] == [] or body["total"] >= 0


async def test_search_phrases_and_exclusions_with_common_words(stack: Stack) -> None:
    """A phrase or an exclusion is matched word for word: stop-words in it count."""
    alice = await stack.register("alice")
    root = await stack.conversation(alice, "words", content="it is on the table")
    cid = root["conversation"]["id"]
    scrambled = await stack.message(alice, cid, content="the table is on fire")
    retry_the = await stack.message(alice, cid, content="retry the thing")
    retry = await stack.message(alice, cid, content="retry once")
    phrase = await _ok(stack, "/search", params={"q": '"on the table"'})
    excluded = await _ok(stack, "/search", params={"q": "retry -the"})
    assert [h["message"]["id"] for h in phrase["items"]] == [root["message"]["id"]]
    assert scrambled["message"]["id"] not in [h["message"]["id"] for h in phrase["items"]]
    assert [h["message"]["id"] for h in excluded["items"]] == [retry["message"]["id"]]
    assert retry_the["message"]["id"] not in [h["message"]["id"] for h in excluded["items"]]
    # A dash standing apart still excludes (as PostgreSQL reads it), word for word; two cancel out.
    for q, expected in (("retry - the", [retry]), ("retry  -  the", [retry]), ("a - the", [])):
        found = await _ok(stack, "/search", params={"q": q})
        assert [h["message"]["id"] for h in found["items"]] == [e["message"]["id"] for e in expected], q
    found = await _ok(stack, "/search", params={"q": "retry -- once"})  # as "retry once": best match first
    assert found["items"][0]["message"]["id"] == retry["message"]["id"]
    # A dash inside a phrase is part of it, not an exclusion (found by review).
    version = await stack.message(alice, cid, content="ships in version - 2 soon")
    found = await _ok(stack, "/search", params={"q": '"version - 2"'})
    assert [h["message"]["id"] for h in found["items"]] == [version["message"]["id"]]


async def test_search_refuses_queries_that_would_rank_everything_and_stops_one_that_runs_too_long(
        stack: Stack, monkeypatch: Any) -> None:
    """Only exclusions match (and rank) every message; past 16 words a query only costs more: both
    are refused before any statement. A search that outlasts its timeout is cancelled on the
    server and answered 503."""
    from actors.reads import queries

    alice = await stack.register("alice")
    await stack.conversation(alice, "words", content="retry the thing or not")
    for q, why in (("-timeout -retry", "no word to match"), ('-"the thing" !!! -or', "no word to match"),
                   ("- zzz", "no word to match"), ("-  - - zzz", "no word to match"),
                   ("(-zzz)", "no word to match"), ("!-zzz", "no word to match"), ("(- zzz)", "no word to match"),
                   (" ".join(f"w{i}" for i in range(17)), "at most 16")):
        reply = await _get(stack, "/search", params={"q": q})
        assert reply.status == 400 and reply.body["error"]["field"] == "q", (q, reply.body)
        assert why in reply.body["error"]["message"], reply.body
    for q in (" ".join(["retry"] * 16), "retry or thing -not", "or"):
        assert (await _get(stack, "/search", params={"q": q})).status == 200, q
    # A search that cannot finish in time: the messages table locked by another session.
    monkeypatch.setattr(queries, "SEARCH_TIMEOUT", 0.5)
    async with stack.db.pool.acquire() as locker, locker.transaction():
        await locker.execute("lock table messages in access exclusive mode")
        reply = await _get(stack, "/search", params={"q": "retry"})
        assert reply.status == 503 and reply.body["error"]["code"] == "search_timeout", reply.body
        waiting = await locker.fetchval("select count(*) from pg_stat_activity where wait_event_type = 'Lock' "
                                        "and query like '%websearch_to_tsquery%'")
        assert waiting == 0  # cancelled on the server, not left waiting behind the lock
    assert (await _get(stack, "/search", params={"q": "retry"})).status == 200


async def test_search_finds_words_between_angle_brackets(stack: Stack) -> None:
    """PostgreSQL's parser would read '<...>' as an HTML tag and drop it; agents write code."""
    alice = await stack.register("alice")
    root = await stack.conversation(alice, "code", content="returns Vec<String> when x<y holds and y>z")
    for q in ("String", "holds", "vec string"):
        body = await _ok(stack, "/search", params={"q": q})
        assert [h["message"]["id"] for h in body["items"]] == [root["message"]["id"]], q


# --- GET /tags ----------------------------------------------------------------------------------


async def _tag_corpus(stack: Stack) -> None:
    """Tags with the counts (messages, conversations) of :data:`TAG_STATS`."""
    agent = await stack.register()
    c1 = (await stack.conversation(agent, "c1", content="#AI #ai #ml: #ai repeated counts once"))
    cid1 = c1["conversation"]["id"]
    await stack.message(agent, cid1, content="#ai #a-z")
    await stack.message(agent, cid1, content="#Ai again")
    c2 = await stack.conversation(agent, "c2", content="#ai #a_z #a1 #aa #ab")
    await stack.message(agent, c2["conversation"]["id"], content="#ml #ab")
    await stack.conversation(agent, "c3", content="#ab")
    await stack.message(agent, (await stack.conversation(agent, "c4", content="#a1"))["conversation"]["id"],
                        content="#ab #a1")
    await stack.conversation(agent, "c5", content="no tags here, # not a tag, a#b neither")


TAG_STATS = {"ai": (4, 2), "a1": (3, 2), "ab": (4, 3), "ml": (2, 2), "a-z": (1, 1), "a_z": (1, 1), "aa": (1, 1)}


async def test_tags_contract(stack: Stack) -> None:
    await _tag_corpus(stack)
    # The stored messages agree: a tag counts once per message, conversations distinctly.
    rows = await stack.db.pool.fetch("select tags, conversation_id from messages")
    actual: dict[str, tuple[int, set[Any]]] = {}
    for r in rows:
        for t in r["tags"]:
            n, convs = actual.get(t, (0, set()))
            actual[t] = (n + 1, convs | {r["conversation_id"]})
    stats = {t: (n, len(c)) for t, (n, c) in actual.items()}
    assert stats == TAG_STATS

    async def tags(**params: str) -> dict[str, Any]:
        reply = await _get(stack, "/tags", params=params)
        assert reply.status == 200, reply.body
        assert reply.headers["Cache-Control"] == "no-store"
        for item in reply.body["items"]:
            assert set(item) == {"tag", "count", "conversation_count"}
            assert (item["count"], item["conversation_count"]) == stats[item["tag"]], item
        return reply.body  # type: ignore[no-any-return]

    def names(body: dict[str, Any]) -> list[str]:
        return [i["tag"] for i in body["items"]]

    binary = sorted(stats, key=lambda t: t.encode())
    assert binary[:4] == ["a-z", "a1", "a_z", "aa"]  # byte order, not a locale's
    body = await tags()
    assert names(body) == binary and body["total"] == len(stats) and body["next"] is None
    assert names(await tags(sort="tag")) == binary
    by_count = sorted(stats, key=lambda t: (-stats[t][0], t.encode()))
    by_convs = sorted(stats, key=lambda t: (-stats[t][1], t.encode()))
    assert by_count != by_convs
    assert names(await tags(sort="count")) == by_count
    assert names(await tags(sort="conversation_count")) == by_convs
    # Exact tag: no trimming, no case folding, no wildcards; unknown names are an empty 200 with total 0.
    assert (await tags(tag="ai"))["items"] == [{"tag": "ai", "count": stats["ai"][0],
                                                "conversation_count": stats["ai"][1]}]
    assert stats["ai"] == (4, 2)  # '#AI #ai ... #ai' in one message counts once
    for miss in ("AI", "Ai", " ai", "ai ", "a%", "a_", "a*", "a.", "nope", "é"):
        body = await tags(tag=miss)
        assert body["items"] == [] and body["total"] == 0 and body["next"] is None, miss
    # Literal prefix.
    assert names(await tags(prefix="a")) == [t for t in binary if t.startswith("a")]
    assert names(await tags(prefix="a_")) == ["a_z"]  # '_' is not a one-character wildcard
    assert names(await tags(prefix="a-")) == ["a-z"]
    assert names(await tags(prefix="ai")) == ["ai"]
    for miss in ("A", "a%", "%", "_", "*", " a", "a.", "ai "):
        body = await tags(prefix=miss)
        assert body["items"] == [] and body["total"] == 0, miss
    assert names(await tags(prefix="a", sort="count")) == [t for t in by_count if t.startswith("a")]
    # Thresholds, combined with AND after aggregation.
    assert names(await tags(min_count="3")) == [t for t in binary if stats[t][0] >= 3]
    assert names(await tags(min_conversation_count="3")) == [t for t in binary if stats[t][1] >= 3]
    assert names(await tags(min_count="4", min_conversation_count="3")) == ["ab"]  # not ab + ai (OR)
    both = await tags(min_count="4", min_conversation_count="4")
    assert both["items"] == [] and both["total"] == 0
    assert names(await tags(min_count="3", min_conversation_count="2")) == [
        t for t in binary if stats[t][0] >= 3 and stats[t][1] >= 2]
    assert names(await tags(min_count="0")) == binary
    assert (await tags(min_count=str(2**31 - 1)))["total"] == 0
    # total counts qualifying tags before pagination; pages and links keep filters and sort.
    qualifying = [t for t in by_count if t.startswith("a") and stats[t][0] >= 1]
    first = await tags(prefix="a", sort="count", min_count="1", limit="2")
    assert first["total"] == len(qualifying) and names(first) == qualifying[:2] and first["prev"] is None
    assert _query(first["next"]) == {"prefix": "a", "sort": "count", "min_count": "1", "limit": "2", "offset": "2"}
    second = await tags(**_query(first["next"]))
    assert names(second) == qualifying[2:4] and second["total"] == len(qualifying)
    assert _query(second["prev"]) == {"prefix": "a", "sort": "count", "min_count": "1", "limit": "2",
                                      "offset": "0"}
    reply = await _get(stack, first["next"])
    assert _links(reply) == {"prev": second["prev"], "next": second["next"]}
    walked, _ = await _walk(stack, "/tags?" + urlencode({"prefix": "a", "sort": "count", "min_count": "1",
                                                         "limit": "2"}))
    assert [t["tag"] for t in walked] == qualifying
    walked, _ = await _walk(stack, "/tags?min_conversation_count=2&sort=conversation_count&limit=1")
    assert [t["tag"] for t in walked] == [t for t in by_convs if stats[t][1] >= 2]
    past = await tags(prefix="a", offset="50")
    assert past["items"] == [] and past["total"] == len([t for t in stats if t.startswith("a")])
    assert past["next"] is None and past["prev"] is not None
    exact_past = await tags(tag="ai", offset="1")
    assert exact_past["items"] == [] and exact_past["total"] == 1
    # Counts move with writes.
    agent = await stack.register()
    await stack.conversation(agent, "c6", content="#ml #brand-new")
    stats["ml"] = (stats["ml"][0] + 1, stats["ml"][1] + 1)
    stats["brand-new"] = (1, 1)
    assert (await tags(tag="ml"))["items"][0]["count"] == 3
    assert (await tags(tag="brand-new"))["total"] == 1
    # The tag contract: a repeated parameter counts once, the first occurrence wins.
    first_wins = await _ok(stack, "/tags", params=[("tag", "ai"), ("tag", "ml"), ("sort", "count"),
                                                   ("sort", "bogus"), ("limit", "5"), ("limit", "x")])
    assert names(first_wins) == ["ai"]
    first_wins = await _ok(stack, "/tags", params=[("prefix", "a_"), ("prefix", "zzz"), ("min_count", "1"),
                                                   ("min_count", "-5")])
    assert names(first_wins) == ["a_z"]
    await _invalid(stack, "/tags", "sort", params=[("sort", "bogus"), ("sort", "count")])
    # Errors.
    for params, name in [({"tag": "ai", "prefix": "a"}, "prefix"), ({"sort": "name"}, "sort"),
                         ({"sort": "-count"}, "sort"), ({"min_count": "-1"}, "min_count"),
                         ({"min_count": "x"}, "min_count"), ({"min_count": str(2**31)}, "min_count"),
                         ({"min_conversation_count": "1.0"}, "min_conversation_count"), ({"tag": ""}, "tag"),
                         ({"prefix": ""}, "prefix"), ({"tag": "a\nb"}, "tag"), ({"limit": "1001"}, "limit"),
                         ({"offset": "-1"}, "offset"), ({"q": "ai"}, "q"), ({"after": "1"}, "after")]:
        await _invalid(stack, "/tags", name, params=params)


# --- negotiation, caching, links ----------------------------------------------------------------


async def _routes(stack: Stack) -> tuple[list[tuple[str, bool]], str]:
    """Every read route with data behind it: [(path, serves HTML)], and the conversation id."""
    alice = await stack.register("alice")
    root = await stack.conversation(alice, "negotiation", content="hello #greeting", kinds=["claim"])
    cid, mid = root["conversation"]["id"], root["message"]["id"]
    second = await stack.message(alice, cid, content="hello again")
    rel = await stack.post(alice, "/relationships", {"type": "extends", "source_message_id": second["message"]["id"],
                                                     "target_message_id": mid})
    assert rel.status == 201
    return [
        ("/conversations", True), (f"/conversations/{cid}", True), ("/messages", True), (f"/messages/{mid}", True),
        ("/agents", True), ("/agents/alice", True), ("/search?q=hello", True), ("/tags", True),
        ("/relationships", True), ("/corpus", True),
    ], cid


async def test_negotiation_matrix(stack: Stack) -> None:
    routes, _ = await _routes(stack)
    for path, browsable in routes:
        plain = await _get(stack, path)
        assert plain.status == 200, (path, plain.body)
        assert plain.headers["Content-Type"].startswith(JSON), path
        assert plain.headers["Vary"] == "Accept"
        assert re.fullmatch(r'"[0-9a-f]{32}"', plain.headers["ETag"]), path
        for accept in ("*/*", "application/*", "application/json", "application/json; charset=utf-8",
                       "text/plain;q=0.5, application/json", "application/xml;q=1, */*;q=0.1"):
            same = await _get(stack, path, accept=accept)
            assert same.status == 200 and same.headers["Content-Type"].startswith(JSON), (path, accept)
            assert same.body == plain.body and same.headers["ETag"] == plain.headers["ETag"]

        ld = await _get(stack, path, accept=JSONLD)
        assert ld.status == 200 and ld.headers["Content-Type"].startswith(JSONLD), path
        assert ld.body["@context"]["@vocab"] and ld.body["@type"] and ld.body["@id"] == path
        assert {k: v for k, v in ld.body.items() if not k.startswith("@")} == plain.body
        assert ld.headers["ETag"] != plain.headers["ETag"]
        assert ld.headers["Vary"] == "Accept"

        md = await _get(stack, path, accept="text/markdown")
        assert md.status == 200 and md.headers["Content-Type"].startswith(MARKDOWN), path
        assert md.body.startswith("# ") and md.headers["Vary"] == "Accept"

        page = await _get(stack, path, accept="text/html,application/xhtml+xml,*/*;q=0.8")
        if browsable:
            assert page.status == 200 and page.headers["Content-Type"].startswith(HTML), path
            assert page.body.startswith("<!DOCTYPE html>") and "<script" not in page.body
            assert "Content-Security-Policy" in page.headers
            # The HTML ETag ignores the per-response nonce.
            again = await _get(stack, path, accept=HTML)
            assert again.headers["ETag"] == page.headers["ETag"]
        else:
            # */* in the browser's header still gets JSON; HTML alone is refused.
            assert page.status == 200 and page.headers["Content-Type"].startswith(JSON), path
            refused = await _get(stack, path, accept=HTML)
            _error(refused, 406, "not_acceptable")
            assert refused.headers.get("Vary") == "Accept"
        for unsupported in ("image/png", "text/plain", "application/xml", "application/json;q=0", "image/*",
                            "text/csv, application/pdf", "application/json;q=NaN", "*/*;q=inf",
                            "application/json;q=1.5", "application/json;q=-1"):
            refused = await _get(stack, path, accept=unsupported)
            _error(refused, 406, "not_acceptable")
            assert refused.headers.get("Vary") == "Accept", (path, unsupported)

        # A repeated parameter: 400 naming it, except on /tags (the first occurrence wins there).
        if path.count("/") == 1:
            sep = "&" if "?" in path else "?"
            doubled = await _get(stack, f"{path}{sep}limit=1&limit=1")
            if path == "/tags":
                assert doubled.status == 200 and len(doubled.body["items"]) == 1
            else:
                assert _error(doubled, 400, "invalid_parameter")["field"] == "limit", path
        # ETag + If-None-Match: 304 with an empty body, for each representation.
        for wanted in (None, JSONLD, MARKDOWN, HTML if browsable else None):
            first = await _get(stack, path, accept=wanted)
            etag = first.headers["ETag"]
            for inm in (etag, f"W/{etag}", f'"other", {etag}', "*"):
                hit = await _get(stack, path, accept=wanted, headers={"If-None-Match": inm})
                assert hit.status == 304 and hit.body is None, (path, wanted, inm)
                assert hit.headers["ETag"] == etag and hit.headers["Vary"] == "Accept"
            miss = await _get(stack, path, accept=wanted, headers={"If-None-Match": '"stale"'})
            assert miss.status == 200 and (wanted == HTML or miss.body == first.body)


async def test_writes_change_list_etags(stack: Stack) -> None:
    routes, cid = await _routes(stack)
    before = {path: (await _get(stack, path)).headers["ETag"] for path, _ in routes}
    bob = await stack.register("bob")
    await stack.message(bob, cid, content="hello once more #greeting")
    after = {path: (await _get(stack, path)).headers["ETag"] for path, _ in routes}
    for path in ("/conversations", f"/conversations/{cid}", "/messages", "/agents", "/search?q=hello", "/tags"):
        assert before[path] != after[path], path
        stale = await _get(stack, path, headers={"If-None-Match": before[path]})
        assert stale.status == 200, path
    # Nothing about these changed.
    for path in ("/agents/alice", "/relationships"):
        assert before[path] == after[path], path
        assert (await _get(stack, path, headers={"If-None-Match": before[path]})).status == 304


async def test_link_header_matches_the_body(stack: Stack) -> None:
    _, cid, _, _ = await _line(stack, 4)
    await stack.register("idle-one")
    for path in ("/messages?limit=1", "/messages?after=0&limit=1", "/messages?offset=1&limit=1",
                 "/conversations?limit=1&offset=0", f"/conversations/{cid}?limit=1", "/agents?limit=1&offset=1",
                 "/search?q=message&limit=1&offset=1", "/tags?limit=1", "/relationships?limit=1"):
        for accept in (None, JSONLD):
            reply = await _get(stack, path, accept=accept)
            assert reply.status == 200, (path, reply.body)
            assert _links(reply) == {rel: reply.body[rel] for rel in ("prev", "next") if reply.body.get(rel)}, path
            if reply.body.get("next") and accept == JSONLD:
                assert reply.body["@context"]["next"]["@type"] == "@id"


async def test_html_escapes_what_agents_wrote(stack: Stack) -> None:
    evil = "<script>alert(1)</script>"
    resp = await stack.client.post("/register", json={"name": "mallory", "description": f'{evil} "quoted" & co'})
    assert resp.status == 201
    body = await resp.json()
    mallory = Agent(agent_id=body["agent_id"], name=body["name"], credential=body["credential"])
    assert (await stack.client.get("/guide", headers=mallory.headers())).status == 200
    root = await stack.conversation(mallory, f"subject {evil}", content=f"content {evil} #xss <b>bold</b>")
    cid, mid = root["conversation"]["id"], root["message"]["id"]
    await stack.message(mallory, cid, payload={"html": evil, "attr": '"><img src=x onerror=alert(1)>'})
    for path in ("/conversations", f"/conversations/{cid}", "/messages", f"/messages/{mid}", "/agents",
                 "/agents/mallory", "/search?q=content"):
        page = await _get(stack, path, accept=HTML)
        assert page.status == 200, path
        text = page.body
        assert "<script" not in text.lower(), path
        assert "<b>bold" not in text and "<img" not in text, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text, path
        assert "default-src 'none'" in page.headers["Content-Security-Policy"]
    page = (await _get(stack, f"/messages/{mid}", accept=HTML)).body
    assert "&lt;b&gt;bold&lt;/b&gt;" in page
    convo = (await _get(stack, f"/conversations/{cid}", accept=HTML)).body
    assert "&lt;img src=x onerror=alert(1)&gt;" in convo  # the payload, escaped in its <pre>
    # The HTML title (from the subject) is escaped too.
    assert "<title>subject &lt;script&gt;" in convo
    # Markdown does not pass raw markup through either.
    md = (await _get(stack, "/conversations", accept=MARKDOWN)).body
    assert "<script>" not in md


# --- the pages a person browses (issue 9, items 4, 5 and 7) -------------------------------------


async def test_tags_relationships_and_corpus_have_pages(stack: Stack) -> None:
    alice, bob = await stack.register("alice"), await stack.register("bob")
    root = await stack.conversation(alice, "pages", content="a claim #alpha #beta", kinds=["claim"])
    cid, mid = root["conversation"]["id"], root["message"]["id"]
    other = (await stack.message(bob, cid, content="more on #alpha"))["message"]["id"]
    rel = await stack.post(bob, "/relationships", {"type": "extends", "source_message_id": other,
                                                   "target_message_id": mid})
    assert rel.status == 201, rel.body
    tags = await _ok(stack, "/tags", accept=HTML)
    assert tags.startswith("<!DOCTYPE html>") and "<h1><bdi>Tags</bdi></h1>" in tags
    assert '<a href="/messages?tag=alpha">#<bdi>alpha</bdi></a></td><td>2</td><td>1</td>' in tags
    rels = await _ok(stack, "/relationships", accept=HTML)
    assert (f'<a href="/messages/{other}">source</a></td><td>extends</td>'
            f'<td><a href="/messages/{mid}">target</a></td>') in rels
    corpus = await _get(stack, "/corpus", accept=HTML)
    assert corpus.status == 200 and corpus.headers["Content-Type"].startswith(HTML)
    assert corpus.headers["X-Corpus-Id"] == str(stack.identity.corpus_id)
    assert corpus.headers["Cache-Control"] == "no-store" and corpus.headers["Vary"] == "Accept"
    assert f'<dd id="corpus-corpus_id">{stack.identity.corpus_id}</dd>' in corpus.body
    assert f'<dd id="corpus-head-sequence">{rel.body["sequence"]}</dd>' in corpus.body
    assert '<a href="/corpus/changes.jsonl">changes</a>' in corpus.body
    assert "default-src 'none'" in corpus.headers["Content-Security-Policy"]
    md = await _ok(stack, "/corpus", accept=MARKDOWN)
    assert md.startswith("# Corpus") and f"- lineage: {stack.identity.lineage}" in md
    # Every page has the same navigation, which links each of these pages.
    for page in (tags, rels, corpus.body):
        for href in ("/", "/conversations", "/messages", "/agents", "/tags", "/relationships", "/corpus", "/guide"):
            assert f'<a href="{href}">' in page, href
        assert '<link rel="icon" href="/favicon.svg" type="image/svg+xml">' in page


async def test_routes_without_parameters_refuse_an_unknown_one(stack: Stack) -> None:
    """As every read does: /guide, /me and /openapi.json took ``?x=1`` silently."""
    agent = await stack.register("paramless")
    for path in ("/guide", "/me", "/openapi.json", "/corpus"):
        reply = await _get(stack, path + "?x=1", headers=agent.headers())
        assert reply.status == 400 and reply.body["error"]["field"] == "x", (path, reply.body)
        assert (await _get(stack, path, headers=agent.headers())).status == 200, path


async def test_corpus_and_openapi_refuse_what_they_cannot_produce(stack: Stack) -> None:
    for path in ("/corpus", "/openapi.json"):
        for accept in ("image/png", "text/plain", "application/json;q=0", "text/csv, application/pdf"):
            refused = await _get(stack, path, accept=accept)
            _error(refused, 406, "not_acceptable")
            assert refused.headers["Vary"] == "Accept", (path, accept)
        for accept in (None, "*/*", "application/json", "image/png;q=0.9, application/*;q=0.1"):
            served = await _get(stack, path, accept=accept)
            assert served.status == 200 and served.headers["Content-Type"].startswith(JSON), (path, accept)
    # /openapi.json has no page: a browser's */* gets the JSON document, text/html alone a 406.
    _error(await _get(stack, "/openapi.json", accept=HTML), 406, "not_acceptable")


async def test_a_message_page_shows_its_relationships_with_links(stack: Stack) -> None:
    alice, bob = await stack.register("alice"), await stack.register("bob")
    root = await stack.conversation(alice, "claims", content="The sky is blue.", kinds=["claim"])
    cid, mid = root["conversation"]["id"], root["message"]["id"]
    made = {}
    for name, who, kinds in (("verify", bob, ["verification"]), ("doubt", bob, ["challenge"]),
                             ("more", alice, ["post"]), ("later", alice, ["post"])):
        made[name] = (await stack.message(who, cid, content=f"{name} <b>text</b>", kinds=kinds))["message"]
    asserted = {}
    for rtype, source, target, who in (("supports", "verify", None, bob), ("contradicts", "doubt", None, bob),
                                       ("extends", "more", None, alice), ("supersedes", "later", None, alice),
                                       ("retracts", "later", "more", alice)):
        body = {"type": rtype, "source_message_id": made[source]["id"],
                "target_message_id": made[target]["id"] if target else mid}
        reply = await stack.post(who, "/relationships", body)
        assert reply.status == 201, reply.body
        asserted[rtype] = reply.body["relationship"]["id"]
    retracted = await stack.post(bob, f"/relationships/{asserted['contradicts']}/retractions", {})
    assert retracted.status == 201
    page = await _ok(stack, f"/messages/{mid}", accept=HTML)
    section = page.split('<section class="related" id="relationships">')[1].split("</section>")[0]
    incoming = section.split('data-direction="incoming"')[1]
    for label, name, rtype in (("Supported by", "verify", "supports"), ("Contradicted by", "doubt", "contradicts"),
                               ("Extended by", "more", "extends"), ("Superseded by", "later", "supersedes")):
        m = made[name]
        item = incoming.split(f'data-relationship="{asserted[rtype]}"')[1].split("</li>")[0]
        assert f'<a href="/messages/{m["id"]}">#{m["sequence"]}</a>' in item, (rtype, item)
        assert f"{name} &lt;b&gt;text&lt;/b&gt;" in item and "<b>" not in item
        assert incoming.index(label) < incoming.index(f'data-relationship="{asserted[rtype]}"')
    assert "(retracted)" in incoming.split(f'data-relationship="{asserted["contradicts"]}"')[1].split("</li>")[0]
    assert 'data-direction="outgoing"' not in section  # the root relates to nothing itself
    assert f'href="/relationships?message={mid}&amp;include_retracted=true"' in section
    # The other side: what a message relates to, and what retracts it.
    later = await _ok(stack, f"/messages/{made['later']['id']}", accept=HTML)
    outgoing = later.split('data-direction="outgoing"')[1]
    assert "Supersedes" in outgoing and "Retracts" in outgoing
    assert f'<a href="/messages/{mid}">#{root["message"]["sequence"]}</a>' in outgoing
    more = await _ok(stack, f"/messages/{made['more']['id']}", accept=HTML)
    assert "Retracted by" in more.split('data-direction="incoming"')[1]
    quiet = await _ok(stack, f"/messages/{made['verify']['id']}", accept=HTML)
    assert 'data-direction="incoming"' not in quiet and "Supports" in quiet
    # The data representations of a message are unchanged: the relationships are the page's alone.
    assert set(await _ok(stack, f"/messages/{mid}")) == set(root["message"])


async def test_an_empty_search_in_a_browser_shows_the_form(stack: Stack) -> None:
    for params in ({}, {"q": ""}, {"q": "   "}):
        page = await _get(stack, "/search", params=params, accept="text/html,application/xhtml+xml,*/*;q=0.8")
        assert page.status == 200 and page.headers["Content-Type"].startswith(HTML), params
        assert '<form method="get" action="/search" role="search">' in page.body
        assert '<p class="notice" role="status">Type one or more words' in page.body
        assert '<form class="search" method="get" action="/search" role="search">' in page.body
        # A data client still gets the 400 that names q.
        await _invalid(stack, "/search", "q", params=params)
        await _invalid(stack, "/search", "q", params=params, accept=MARKDOWN)
    # Other mistakes stay errors for a browser too, and a real search keeps its words in the box.
    _error(await _get(stack, "/search", params={"q": "x", "bogus": "1"}, accept=HTML), 400, "invalid_parameter")
    found = await _ok(stack, "/search", params={"q": 'a "b"'}, accept=HTML)
    assert 'name="q" value="a &quot;b&quot;"' in found


async def test_counts_are_written_with_the_right_plural(stack: Stack) -> None:
    alice = await stack.register("alice")
    one = await stack.conversation(alice, "single", content="just one #solo")
    two = await stack.conversation(alice, "double", content="first #pair")
    await stack.message(alice, two["conversation"]["id"], content="second #pair")
    assert "· 1 message ·" in await _ok(stack, f"/conversations/{one['conversation']['id']}", accept=HTML)
    assert "· 2 messages ·" in await _ok(stack, f"/conversations/{two['conversation']['id']}", accept=HTML)
    md = await _ok(stack, "/tags", accept=MARKDOWN)
    assert "\\#solo: 1 message in 1 conversation\n" in md and "\\#pair: 2 messages in 1 conversation\n" in md
    listed = await _ok(stack, "/conversations", accept=MARKDOWN)
    assert ": 1 message, last sequence" in listed and ": 2 messages, last sequence" in listed
    assert "3 messages in 2 conversations" in await _ok(stack, "/agents/alice", accept=MARKDOWN)


async def test_markdown_escapes_raw_html_in_content(stack: Stack) -> None:
    from markdown_it import MarkdownIt

    alice = await stack.register("alice")
    evil = "<script>alert(1)</script> & <img src=x onerror=alert(2)>"
    root = await stack.conversation(alice, "markdown", content=f"{evil}\nsecond line <b>bold</b>")
    cid, mid = root["conversation"]["id"], root["message"]["id"]
    # A renderer that passes raw HTML through (the CommonMark default) still shows only text.
    renderer = MarkdownIt("commonmark", {"html": True})
    for path in (f"/messages/{mid}", f"/conversations/{cid}", "/messages", "/search?q=alert"):
        md = await _ok(stack, path, accept=MARKDOWN)
        assert "<script" not in md and "<img" not in md and "<b>" not in md, path
        assert "> &lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;img src=x onerror=alert(2)&gt;" in md, path
        rendered = renderer.render(md)
        assert "<script" not in rendered and "<img" not in rendered and "<b>" not in rendered, path
        assert html_unescape_text(rendered).count(evil) == 1, path


async def test_markdown_keeps_only_web_links_in_content(stack: Stack) -> None:
    from markdown_it import MarkdownIt

    alice = await stack.register("alice")
    unsafe = ["[a](javascript:alert(1))", "[b](  JaVaScRiPt:alert(2))", "[c](<javascript:alert(3)>)",
              "![d](data:text/html;base64,PHNjcmlwdD4=)", "[e](javascript\\:alert(5))", "[f](vbscript:x)",
              "[g](\njavascript:alert(7))", "[h]\n\n[h]: javascript:alert(8)", "[i](file:///etc/passwd)",
              # Reference definitions inside containers define links too (found by a walkthrough).
              "- [j]: javascript:alert(10)\n\n[click][j]", "1. [k]: javascript:alert(11)\n\n[k]",
              "* [l]:\n  javascript:alert(12)\n\n[l]", "> [m]: javascript:alert(13)\n\n[m]",
              "- > 2) [n]: vbscript:alert(14)\n\n[n]"]
    safe = ["[ok](https://example.org/x)", "[rel](/messages)", "[mail](mailto:a@example.org)"]
    root = await stack.conversation(alice, "links", content="\n\n".join(unsafe + safe))
    cid, mid = root["conversation"]["id"], root["message"]["id"]
    # A renderer that checks no link target at all: only the web links may come out as links.
    renderer = MarkdownIt("commonmark")
    renderer.validateLink = lambda _url: True
    for path in (f"/messages/{mid}", f"/conversations/{cid}"):
        md = await _ok(stack, path, accept=MARKDOWN)
        targets = [t.attrGet("href") or t.attrGet("src") for block in renderer.parse(md) for t in block.children or []
                   if t.type in ("link_open", "image")]
        assert sorted(map(str, targets)) == ["/messages", "https://example.org/x", "mailto:a@example.org"], path
        for written in ("alert(1)", "alert(2)", "alert(3)", "base64,PHNjcmlwdD4=", "alert(7)", "alert(8)", "passwd",
                        "alert(10)", "alert(11)", "alert(12)", "alert(13)", "alert(14)"):
            assert written in md, (path, written)  # shown as text, not dropped


def html_unescape_text(rendered: str) -> str:
    """The text of rendered HTML: tags dropped, character references decoded."""
    import html as html_module

    return html_module.unescape(re.sub(r"<[^>]+>", "", rendered))


async def test_pages_isolate_the_direction_of_corpus_text(stack: Stack) -> None:
    mallory = await stack.register("mallory")
    override = "\u202egnp.exe"  # RIGHT-TO-LEFT OVERRIDE: shows as "exe.png" and drags what follows
    subject = "שלום עולם"  # a right-to-left subject is fine; it must not reorder the page around it
    root = await stack.conversation(mallory, subject, content=f"look {override} #tag")
    cid, mid = root["conversation"]["id"], root["message"]["id"]
    page = await _ok(stack, f"/messages/{mid}", accept=HTML)
    assert f'<div class="content" dir="auto">look {override} #tag</div>' in page
    assert '<a href="/agents/mallory"><bdi>mallory</bdi></a>' in page
    assert '#<bdi>tag</bdi></a>' in page
    convo = await _ok(stack, f"/conversations/{cid}", accept=HTML)
    assert f"<h1><bdi>{subject}</bdi></h1>" in convo
    listed = await _ok(stack, "/conversations", accept=HTML)
    assert f'<a href="/conversations/{cid}"><bdi>{subject}</bdi></a>' in listed
    front = (await stack.client.get("/", headers={"Accept": HTML}))
    text = await front.text()
    assert f'<a class="subject" dir="auto" href="/conversations/{cid}">{subject}</a>' in text
    assert f'<span class="excerpt" dir="auto">look {override} #tag</span>' in text
