"""Property tests: arbitrary query strings, path segments and negotiation headers at every read route.

Whatever a client sends, a read answers 2xx, 304 (only when it sent If-None-Match) or 4xx with the
JSON error envelope ``{"error": {"code", "message", "how_to_proceed"}}``: never a 5xx, never an
error without guidance. Hypothesis drives many requests inside one test, against one ``stack``
(both backends) seeded once with a small corpus, so the queries hit real rows.
"""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import quote

import orjson
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from yarl import URL

from tests.corpus_fixtures import Stack

#: Every read route with its parameters (path templates take one segment).
ROUTES: dict[str, tuple[str, ...]] = {
    "/conversations": ("author", "before", "limit", "offset"),
    "/conversations/{}": ("after", "limit"),
    "/messages": ("conversation", "author", "kinds", "tag", "mention", "after", "before", "order", "limit",
                  "offset"),
    "/messages/{}": (),
    "/search": ("q", "conversation", "author", "kinds", "tag", "mention", "limit", "offset"),
    "/tags": ("tag", "prefix", "sort", "min_count", "min_conversation_count", "limit", "offset"),
    "/relationships": ("message", "source", "target", "type", "author", "include_retracted", "after", "limit",
                       "offset"),
    "/agents": ("sort", "limit", "offset"),
    "/agents/{}": (),
}
NAMES = sorted({n for params in ROUTES.values() for n in params} | {"q", "x", "", "limit[]", "LIMIT"})
#: Values that reach deep into the parsers: edge numbers, known words, ids, lists, wildcards.
SPECIAL = [
    "", " ", "0", "1", "-1", "-0", "+1", "01", "1.0", "1e3", "NaN", "inf", "0x10", "١٢", "１",
    str(2**31 - 1), str(2**31), str(2**53 - 1), str(2**53), str(2**63), str(2**64), "9" * 40,
    "100", "1000", "1001", "100000", "100001", "asc", "desc", "true", "false", "True", "tag", "count",
    "conversation_count", "name", "message_count", "last_sequence", "post", "claim,question", "post,post",
    "post,", ",", "supports", "retracts", "alice", "ALICE", "bob", "ab", "x" * 33, "a%", "%", "_", "*",
    "ai", "AI", '"quoted phrase"', "-the", "the or is", "!!!", "&|!", ":*", "'", "\\", "\x00", "\n",
    "\u202e", "🦀", "é", "ß", "İ", "00000000-0000-0000-0000-000000000000",
    "3F2B8C1E6D4A4F5E9A7B2C1D0E9F8A7B", "{3f2b8c1e-6d4a-4f5e-9a7b-2c1d0e9f8a7b}",
    "urn:uuid:3f2b8c1e-6d4a-4f5e-9a7b-2c1d0e9f8a7b", "x" * 201, "x" * 501, "q " * 300,
]
ACCEPTS = [
    None, "", "*/*", "application/json", "application/ld+json", "text/markdown", "text/html", "image/png",
    "text/*", "application/*;q=0", "*/*;q=0", "application/json;q=nan", "text/html;q=-1, */*;q=inf",
    "text/markdown;q=0.5, application/ld+json;q=0.5", ",,,", ";", "/", "*/", "text/html;level=1;q=0.1",
]

text_values = st.text(max_size=60)
values = st.one_of(
    st.sampled_from(SPECIAL),
    text_values,
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.uuids().map(str),
    st.lists(st.sampled_from(["post", "claim", "question", "proposal", "bogus", "", "POST"]), max_size=5)
    .map(",".join),
)
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=12))
#: Valid values per parameter, so that many requests get past validation and run real queries.
PLAUSIBLE: dict[str, st.SearchStrategy[str]] = {
    "limit": st.integers(1, 1000).map(str), "offset": st.integers(0, 30).map(str),
    "after": st.integers(0, 40).map(str), "before": st.integers(0, 40).map(str),
    "order": st.sampled_from(["asc", "desc"]), "include_retracted": st.sampled_from(["true", "false"]),
    "kinds": st.lists(st.sampled_from(["post", "claim", "question", "proposal", "challenge"]), min_size=1,
                      max_size=3, unique=True).map(",".join),
    "sort": st.sampled_from(["tag", "count", "conversation_count", "name", "message_count", "last_sequence"]),
    "author": st.sampled_from(["alice", "BOB", "idle-agent", "nobody-here"]),
    "mention": st.sampled_from(["bob", "Alice", "nobody-here"]),
    "tag": st.sampled_from(["ai", "a_z", "AI", "missing"]), "prefix": st.sampled_from(["a", "a_", "", "z"]),
    "q": st.sampled_from(["the", "is on", "running", '"the table"', "hello -bob", "hello or table", "ai", "-"]),
    "type": st.sampled_from(["contradicts", "supports", "extends"]),
    "min_count": st.integers(0, 3).map(str), "min_conversation_count": st.integers(0, 3).map(str),
}
#: Printable ASCII, as header values must be.
header_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60)
segments = st.one_of(
    st.sampled_from(["alice", "ALICE", "nobody-here", "ab", "x" * 33, "", ".", "..", "%", "a/b", "?x=1", "#",
                     "00000000-0000-0000-0000-000000000000", "not-a-uuid", "é" * 10, "\x00", " alice"]),
    st.uuids().map(str),
    st.uuids().map(lambda u: u.hex.upper()),
    st.text(max_size=80),
)

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


async def _seed(stack: Stack) -> dict[str, str]:
    """A small corpus, written once per stack: ids to substitute into paths and queries."""
    row = await stack.db.pool.fetchrow(
        "select m.id as message, m.conversation_id as conversation from messages m order by m.created_at limit 1")
    if row is None:
        alice = await stack.register("alice")
        bob = await stack.register("bob")
        root = await stack.conversation(alice, "fuzz <b>", content="hello @bob #ai #a_z the runs", kinds=["claim"])
        cid = root["conversation"]["id"]
        reply = await stack.message(bob, cid, content="is on the table #AI", payload=None, reply_to=root["message"]["id"])
        rel = await stack.post(bob, "/relationships", {"type": "contradicts", "source_message_id": reply["message"]["id"],
                                                       "target_message_id": root["message"]["id"]})
        assert rel.status == 201, rel.body
        retracted = await stack.post(bob, f"/relationships/{rel.body['relationship']['id']}/retractions")
        assert retracted.status == 201, retracted.body
        await stack.register("idle-agent")
        return {"message": root["message"]["id"], "conversation": cid}
    return {"message": str(row["message"]), "conversation": str(row["conversation"])}


async def _check(stack: Stack, url: str | URL, headers: dict[str, str]) -> None:
    """One request: never a 5xx; a 4xx carries the error envelope; a 2xx is well-formed."""
    resp = await stack.client.get(url, headers=headers, allow_redirects=False)
    body = await resp.read()
    where = (str(url), headers, resp.status, body[:300])
    event(f"status {resp.status}")
    assert resp.status < 500, where
    if resp.status >= 400:
        assert resp.content_type == "application/json", where
        decoded = orjson.loads(body)
        assert set(decoded) == {"error"}, where
        err = decoded["error"]
        assert {"code", "message", "how_to_proceed"} <= set(err), where
        assert all(isinstance(err[k], str) and err[k] for k in ("code", "message", "how_to_proceed")), where
        assert "Traceback" not in err["message"] and "SELECT" not in err["message"].upper(), where
    elif resp.status == 304:
        assert "If-None-Match" in headers and body == b"", where
    else:
        assert 200 <= resp.status < 300, where
        if resp.content_type in ("application/json", "application/ld+json"):
            orjson.loads(body)


def _fill(template: str, segment: str) -> str:
    return template.replace("{}", quote(segment, safe="")) if "{}" in template else template


@given(data=st.data())
@SETTINGS
async def test_arbitrary_query_parameters(stack: Stack, data: st.DataObject) -> None:
    ids = await _seed(stack)
    template = data.draw(st.sampled_from(sorted(ROUTES)), label="route")
    known = ROUTES[template]
    segment = {"/conversations/{}": ids["conversation"], "/messages/{}": ids["message"],
               "/agents/{}": "alice"}.get(template, "")
    id_values = st.sampled_from([ids["message"], ids["conversation"], ids["message"].upper()])
    pairs: list[tuple[str, str]] = []
    if len(known) > 0 and data.draw(st.booleans(), label="plausible"):
        # Mostly valid parameters of this route: real queries with combined filters.
        chosen = data.draw(st.lists(st.sampled_from(known), max_size=5, unique=True), label="names")
        for name in chosen:
            strategy = id_values if name in ("conversation", "message", "source", "target") else PLAUSIBLE[name]
            pairs.append((name, data.draw(st.one_of(strategy, strategy, values), label=name)))
    else:
        pick_name = st.one_of(st.sampled_from(known), names) if known else names
        pairs = data.draw(st.lists(st.tuples(pick_name, st.one_of(values, id_values)), max_size=4), label="params")
    if data.draw(st.booleans(), label="repeat") and pairs:
        pairs.append((pairs[0][0], data.draw(values, label="repeated")))
    headers: dict[str, str] = {}
    how = data.draw(st.integers(0, 5), label="accept kind")
    if how == 0:
        headers["Accept"] = data.draw(header_text, label="accept")
    elif how <= 2:
        accept = data.draw(st.sampled_from(ACCEPTS), label="accept")
        if accept is not None:
            headers["Accept"] = accept
    if data.draw(st.booleans(), label="conditional"):
        headers["If-None-Match"] = data.draw(st.one_of(st.just("*"), header_text), label="etag")
    url = URL(_fill(template, segment)).with_query(pairs)
    await _check(stack, url, headers)


@given(data=st.data())
@SETTINGS
async def test_arbitrary_path_segments(stack: Stack, data: st.DataObject) -> None:
    await _seed(stack)
    template = data.draw(st.sampled_from([t for t in ROUTES if "{}" in t]), label="route")
    segment = data.draw(segments, label="segment")
    query = data.draw(st.sampled_from(["", "?limit=1", "?after=0", "?x=1", "?limit=abc"]), label="query")
    await _check(stack, _fill(template, segment) + query, {})


#: Raw query strings, sent without re-encoding: stray '%', '&&', '=', ';' and '+' included.
raw_queries = st.lists(st.sampled_from(list("abcdefgilmnopqrstu0123456789-_.~%&=;+,*!'()") +
                                       ["%00", "%ZZ", "%e9", "%C3%A9", "%F0%9F%A6%80", "%2B", "%26", "limit=",
                                        "after=", "offset=", "q=", "kinds=", "tag=", "&"]),
                       max_size=40).map("".join)


@given(data=st.data())
@SETTINGS
async def test_raw_query_strings(stack: Stack, data: st.DataObject) -> None:
    await _seed(stack)
    template = data.draw(st.sampled_from(sorted(ROUTES)), label="route")
    raw = data.draw(raw_queries, label="query")
    path = _fill(template, {"/agents/{}": "alice"}.get(template, str(uuid.UUID(int=1))))
    await _check(stack, URL(f"{path}?{raw}", encoded=True), {})


def test_every_read_route_is_fuzzed() -> None:
    # The route table above stays in step with the handlers' declared parameters.
    from actors.reads import queries as reads

    declared: dict[str, Any] = {
        "/conversations": reads.CONVERSATION_LIST_PARAMS, "/conversations/{}": reads.CONVERSATION_PARAMS,
        "/messages": reads.MESSAGE_PARAMS, "/search": reads.SEARCH_PARAMS, "/tags": reads.TAG_PARAMS,
        "/relationships": reads.RELATIONSHIP_PARAMS, "/agents": reads.AGENT_PARAMS,
    }
    for route, params in declared.items():
        assert set(ROUTES[route]) == set(params), route
