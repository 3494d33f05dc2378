"""Exact data (issue 9, item 4): numbers, nesting and "non-blank", through HTTP and the bus.

Runs on both stacks (embedded database + in-process bus, PostgreSQL + RabbitMQ). A payload's numbers
come back exactly, in one canonical form, from every place that shows it (the write answer, the
read routes, the change history, the snapshot), or the write is refused with 422 naming the number's
JSON Pointer and nothing is stored. One nesting limit holds at the edge and in the writer.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest

from infra.bus.base import COMMANDS_EXCHANGE
from protocol import corpus
from protocol.commands import WriteCommand, WriteResult
from protocol.messages import ErrorReply
from tests.corpus_fixtures import Agent, Reply, Stack

JSON = {"Content-Type": "application/json"}
#: The documented nesting limit (README, docs/contract.md): the body itself is the first level.
MAX_JSON_DEPTH = 64


async def _count_changes(stack: Stack) -> int:
    return int(await stack.db.pool.fetchval("select count(*) from changes"))


async def _append_raw(stack: Stack, agent: Agent, conversation_id: str, body: bytes) -> Reply:
    return await stack.post(agent, f"/conversations/{conversation_id}/messages", data=body, headers=JSON)


def _refusal(reply: Reply, code: str) -> dict[str, Any]:
    assert reply.status == 422, (reply.status, reply.body)
    error = reply.body["error"]
    assert error["code"] == code, reply.body
    assert error["message"] and error["how_to_proceed"]
    return error  # type: ignore[no-any-return]


async def _text(stack: Stack, path: str) -> str:
    resp = await stack.client.get(path)
    assert resp.status == 200, await resp.text()
    return await resp.text()


async def test_payload_numbers_come_back_exactly_in_one_canonical_form_everywhere(stack: Stack) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    sent = (b'{"content": "numbers", "payload": {"e": 1E2, "u64": 18446744073709551615, '
            b'"i64": -9223372036854775808, "tenth": 0.1, "tiny": 5e-324, "trailing": 1.50}}')
    canonical = ('{"e":100.0,"i64":-9223372036854775808,"tenth":0.1,"tiny":5e-324,"trailing":1.5,'
                 '"u64":18446744073709551615}')
    reply = await _append_raw(stack, alice, cid, sent)
    assert reply.status == 201, reply.body
    mid = reply.body["message"]["id"]
    seq = reply.body["sequence"]

    resp = await stack.post(alice, f"/conversations/{cid}/messages", data=sent, headers=JSON)
    assert resp.status == 201  # a second, independent write of the same bytes: same stored form
    places = {
        "write answer": orjson.dumps(reply.body).decode(),
        "GET /messages/{id}": await _text(stack, f"/messages/{mid}"),
        "GET /conversations/{id}": await _text(stack, f"/conversations/{cid}"),
        "changes.jsonl": await _text(stack, f"/corpus/changes.jsonl?after={seq - 1}&limit=1"),
        "snapshot.jsonl": await _text(stack, "/corpus/snapshot.jsonl"),
        "stored event": await stack.db.pool.fetchval("select event::text from changes where sequence = $1", seq),
    }
    for place, text in places.items():
        assert canonical in text.replace(", ", ",").replace(": ", ":"), (place, text)


#: Numbers whose stored form would differ in value, and what the refusal says about each.
NOT_EXACT: list[tuple[bytes, str]] = [
    (b"123456789012345678901234567890", "integers are stored exactly only from -2**63 to 2**64-1"),
    (b"-9223372036854775809", "integers are stored exactly only"),
    (b"9" * 5_000, "integers are stored exactly only"),  # longer than Python converts by default
    (b"1e-400", "would become 0.0"),
    (b"1e400", "beyond the range"),
    (b"123456789.123456789", "would become 123456789.12345679"),
]


@pytest.mark.parametrize(("literal", "why"), NOT_EXACT, ids=[literal[:24].decode() for literal, _ in NOT_EXACT])
async def test_a_number_that_cannot_be_stored_exactly_is_refused_with_its_pointer(
        stack: Stack, literal: bytes, why: str) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    before = await _count_changes(stack)
    reply = await _append_raw(stack, alice, cid, b'{"payload": {"ok": 1, "n": ' + literal + b"}}")
    error = _refusal(reply, "number_not_exact")
    assert error["pointer"] == "/payload/n" and error["field"] == "payload"
    assert why in error["message"] and literal.decode()[:40] in error["message"]
    assert len(error["message"]) < 300  # a bounded echo of what was sent
    # Deeper in the payload the pointer names the exact place (RFC 6901 escapes included).
    reply = await _append_raw(stack, alice, cid, b'{"payload": {"a/b": [0, {"c": ' + literal + b"}]}}")
    assert _refusal(reply, "number_not_exact")["pointer"] == "/payload/a~1b/1/c"
    assert await _count_changes(stack) == before


async def test_a_key_named_twice_is_refused_with_its_pointer_and_nothing_is_stored(stack: Stack) -> None:
    """A JSON library keeps one of two values under the same key (orjson the last): storing it would
    drop the other silently. Spelled the same or escaped differently, at any depth: refused."""
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    before = await _count_changes(stack)
    for body, pointer in ((b'{"content": "a", "content": "b"}', "/content"),
                          (b'{"payload": {"n": 1, "\\u006e": 2}}', "/payload/n"),
                          (b'{"payload": [{"ok": 1}, {"a/b": {"x": 1, "y": ":", "x": 2}}]}', "/payload/1/a~1b/x")):
        error = _refusal(await _append_raw(stack, alice, cid, body), "duplicate_key")
        assert error["pointer"] == pointer and error["field"] == pointer.split("/")[1], body
    # Colons in strings and the same key in different objects are fine.
    reply = await _append_raw(stack, alice, cid, b'{"content": "at 12:30: see http://x", '
                                                 b'"payload": [{"k": "a:b"}, {"k": "c"}]}')
    assert reply.status == 201, reply.body
    assert reply.body["message"]["payload"] == [{"k": "a:b"}, {"k": "c"}]
    assert await _count_changes(stack) == before + 1


def _nested(levels: int) -> bytes:
    """A message body nesting ``levels`` levels in all: the body, then ``levels - 1`` in the payload."""
    inner = levels - 1
    return b'{"payload": ' + b"[" * inner + b"]" * inner + b"}"


async def test_one_nesting_limit_at_the_edge_named_in_the_refusal(stack: Stack) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    reply = await _append_raw(stack, alice, cid, _nested(MAX_JSON_DEPTH))
    assert reply.status == 201, reply.body
    before = await _count_changes(stack)
    # Today's failures were three different stories: 250 passed, 300 "recursion limit", 1,100 "not JSON".
    for levels in (MAX_JSON_DEPTH + 1, 250, 300, 1_100, 100_000):
        reply = await _append_raw(stack, alice, cid, _nested(levels))
        error = _refusal(reply, "json_too_deep")
        assert error["limit"] == MAX_JSON_DEPTH and str(MAX_JSON_DEPTH) in error["message"], levels
    # Nesting in a field that is not allowed anyway is measured the same way, before anything else.
    _refusal(await stack.post(alice, "/conversations", data=b'{"x": ' + b"[" * 70 + b"]" * 70 + b"}",
                              headers=JSON), "json_too_deep")
    assert await _count_changes(stack) == before


async def test_the_writer_applies_the_same_nesting_limit_to_what_it_takes_off_the_bus(stack: Stack) -> None:
    """A command that did not come through the edge (a forged or outdated sender) meets the same rule."""
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]

    async def send(levels: int) -> ErrorReply | WriteResult:
        body = orjson.loads(_nested(levels))
        command = WriteCommand(operation=corpus.OP_APPEND_MESSAGE, target=cid, body=body,
                               author_id=alice.agent_id, author_name=alice.name, token=str(uuid.uuid4()))
        scope = stack.identity.scope
        reply = await stack.bus.request(COMMANDS_EXCHANGE, scope.command_key(corpus.OP_APPEND_MESSAGE), command,
                                        timeout=10, headers=scope.headers())
        assert isinstance(reply.message, (ErrorReply, WriteResult)), reply.message
        return reply.message

    accepted = await send(MAX_JSON_DEPTH)
    assert isinstance(accepted, WriteResult) and accepted.status == 201, accepted
    refused = await send(MAX_JSON_DEPTH + 1)
    assert isinstance(refused, ErrorReply), refused
    assert (refused.status, refused.code) == (422, "json_too_deep"), refused
    assert refused.extra.get("limit") == MAX_JSON_DEPTH


INVISIBLE = ["\u200b", "\u200b\u200c\u200d\u2060", "\ufeff", "\u3164", "\u115f\u1160", "\uffa0", "\u2800",
             " \u2028 \u2029 ", "\u00a0\u3000", "\u180e", "\u034f\ufe0f", "\u00ad", "\U000e0041"]


@pytest.mark.parametrize("text", INVISIBLE, ids=[t.encode("unicode_escape").decode() for t in INVISIBLE])
async def test_invisible_subjects_and_contents_are_blank(stack: Stack, text: str) -> None:
    alice = await stack.register()
    before = await _count_changes(stack)
    reply = await stack.post(alice, "/conversations", {"subject": text, "content": "visible"})
    assert _refusal(reply, "validation_failed")["field"] == "subject"
    reply = await stack.post(alice, "/conversations", {"subject": "visible", "content": text})
    assert _refusal(reply, "validation_failed")["field"] == "content"
    cid = (await stack.conversation(alice))["conversation"]["id"]
    reply = await stack.post(alice, f"/conversations/{cid}/messages", {"content": text})
    assert _refusal(reply, "validation_failed")["field"] == "content"
    assert await _count_changes(stack) == before + 1


@pytest.mark.parametrize("mark", ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068",
                                  "\u2069"])
async def test_bidirectional_overrides_are_refused_in_subjects(stack: Stack, mark: str) -> None:
    alice = await stack.register()
    reply = await stack.post(alice, "/conversations", {"subject": f"invoice {mark}fdp.exe", "content": "x"})
    error = _refusal(reply, "validation_failed")
    assert error["field"] == "subject" and "bidirectional" in error["message"]


async def test_visible_text_with_invisible_characters_in_it_is_still_fine(stack: Stack) -> None:
    alice = await stack.register()
    body = await stack.conversation(alice, "\u200bcafe\u0301 \U0001f44d\U0001f3fd", content="a\u200bb \u05e9\u05dc\u05d5\u05dd")
    assert body["conversation"]["subject"] == "\u200bcafe\u0301 \U0001f44d\U0001f3fd"
    assert body["message"]["content"] == "a\u200bb \u05e9\u05dc\u05d5\u05dd"
