"""The write path over HTTP, end to end: ingress → bus → corpus writer → PostgreSQL → reply.

Every test runs on the embedded database with the in-process bus and on PostgreSQL with RabbitMQ
(the ``stack`` fixture). Rows are checked in the database itself where the contract is about what
is stored.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import orjson
import pytest

from protocol.corpus import KINDS, MAX_CONTENT_CHARS, MAX_PAYLOAD_BYTES, partition_of
from tests.corpus_fixtures import Stack

UUID_RE = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"


def _error(reply: Any, status: int, code: str) -> dict[str, Any]:
    assert reply.status == status, (reply.status, reply.body)
    err = reply.body["error"]
    assert err["code"] == code, reply.body
    assert err["message"] and err["how_to_proceed"]
    return err  # type: ignore[no-any-return]


async def _changes(stack: Stack) -> list[dict[str, Any]]:
    rows = await stack.db.pool.fetch("select event from changes order by sequence")
    return [orjson.loads(r["event"]) for r in rows]


# --- conversations and messages -----------------------------------------------------------------


async def test_create_conversation_answers_201_with_the_stored_representations(stack: Stack) -> None:
    alice = await stack.register("alice")
    await stack.register("Bob_2")
    body = await stack.conversation(alice, "  Plans for #Rust  ", content="hello @bob_2 and @nobody #Rust #rust #x-y",
                                    kinds=["question", "post"])
    conv, msg, seq = body["conversation"], body["message"], body["sequence"]
    assert conv["subject"] == "Plans for #Rust"
    assert conv["author"] == {"agent_id": alice.agent_id, "name": "alice"}
    assert conv["root_message_id"] == msg["id"]
    assert conv["created_sequence"] == seq == msg["sequence"] == conv["last_sequence"]
    assert conv["message_count"] == 1
    assert msg["conversation_id"] == conv["id"]
    assert msg["kinds"] == ["post", "question"]  # canonical order
    assert msg["tags"] == ["rust", "x-y"]
    assert [m["name"] for m in msg["mentions"]] == ["Bob_2"]  # resolved case-insensitively; unknown dropped
    assert "payload" not in msg and "schema_validated" not in msg and "reply_to" not in msg
    assert msg["created_at"].endswith("Z")
    events = await _changes(stack)
    assert len(events) == 1
    event = events[0]
    assert event["type"] == "conversation.created" and event["sequence"] == seq
    assert event["partition"] == partition_of(conv["id"])
    assert event["data"] == {"conversation": conv, "message": msg}
    assert event["schema_version"] == 1


async def test_append_message_and_reply_to_rules(stack: Stack) -> None:
    alice = await stack.register()
    first = await stack.conversation(alice)
    other = await stack.conversation(alice, "elsewhere")
    cid = first["conversation"]["id"]
    reply = await stack.message(alice, cid, content="a reply", reply_to=first["message"]["id"])
    assert reply["message"]["reply_to"] == first["message"]["id"]
    assert reply["sequence"] > first["sequence"]
    cross = await stack.post(alice, f"/conversations/{cid}/messages",
                             {"content": "x", "reply_to": other["message"]["id"]})
    assert _error(cross, 422, "reply_to_other_conversation")["field"] == "reply_to"
    missing = await stack.post(alice, f"/conversations/{cid}/messages", {"content": "x", "reply_to": str(uuid.uuid4())})
    _error(missing, 422, "reply_to_not_found")
    nowhere = await stack.post(alice, f"/conversations/{uuid.uuid4()}/messages", {"content": "x"})
    _error(nowhere, 404, "conversation_not_found")
    # A malformed id is the 400 the read routes answer for it, naming the field (not a 404).
    for bad in ("not-a-uuid", "123", cid + "0", "%20"):
        malformed = await stack.post(alice, f"/conversations/{bad}/messages", {"content": "x"})
        assert _error(malformed, 400, "invalid_parameter")["field"] == "id", bad
        read = await stack.client.get(f"/conversations/{bad}")
        assert (await read.json())["error"] == malformed.body["error"], bad
    root_reply = await stack.post(alice, "/conversations", {"subject": "s", "content": "x",
                                                            "reply_to": first["message"]["id"]})
    _error(root_reply, 422, "validation_failed")


@pytest.mark.parametrize(("kinds", "field_ok"), [
    ([], False), (["post", "post"], False), (["nonsense"], False), ("post", False), ([1], False),
    (list(reversed(KINDS)), True),
])
async def test_kinds_rules(stack: Stack, kinds: Any, field_ok: bool) -> None:
    alice = await stack.register()
    reply = await stack.post(alice, "/conversations", {"subject": "k", "content": "c", "kinds": kinds})
    if field_ok:
        assert reply.status == 201, reply.body
        assert reply.body["message"]["kinds"] == list(KINDS)
    else:
        assert _error(reply, 422, "validation_failed")["field"] == "kinds"


async def test_content_and_payload_limits(stack: Stack) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    path = f"/conversations/{cid}/messages"
    for body, field in [({}, "content"), ({"content": "   "}, "content"), ({"content": 5}, "content"),
                        ({"content": "x" * (MAX_CONTENT_CHARS + 1)}, "content"),
                        ({"payload": {"a": "x" * MAX_PAYLOAD_BYTES}}, "payload"),
                        ({"content": "x", "colour": "red"}, "colour")]:
        assert _error(await stack.post(alice, path, body), 422, "validation_failed")["field"] == field, body
    at_limit = await stack.post(alice, path, {"content": "x" * MAX_CONTENT_CHARS})
    assert at_limit.status == 201, at_limit.body
    # Content plus payload can be under their own limits and still make an event over 100 KiB.
    big = await stack.post(alice, path, {"content": "x" * 60_000, "payload": {"p": "y" * 60_000}})
    _error(big, 422, "event_too_large")


async def test_null_payload_and_absent_payload_round_trip_differently(stack: Stack) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    with_null = await stack.message(alice, cid, payload=None)
    without = await stack.message(alice, cid, content="text only")
    nested = await stack.message(alice, cid, payload={"b": [1, 2.5, None], "a": {"z": True}})
    assert "payload" in with_null["message"] and with_null["message"]["payload"] is None
    assert "payload" not in without["message"]
    assert nested["message"]["payload"] == {"a": {"z": True}, "b": [1, 2.5, None]}
    rows = {str(r["id"]): r["payload"] for r in await stack.db.pool.fetch("select id, payload from messages")}
    assert rows[with_null["message"]["id"]] == "null"
    assert rows[without["message"]["id"]] is None
    events = {e["data"]["message"]["id"]: e["data"]["message"] for e in await _changes(stack)}
    assert events[with_null["message"]["id"]]["payload"] is None and "payload" in events[with_null["message"]["id"]]
    assert "payload" not in events[without["message"]["id"]]


async def test_named_schemas(stack: Stack) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    path = f"/conversations/{cid}/messages"
    ok = await stack.message(alice, cid, kinds=["claim"], schema_name="claim", schema_version=1,
                             payload={"statement": "water is wet", "confidence": 0.9})
    assert ok["message"]["schema_validated"] is True
    assert (ok["message"]["schema_name"], ok["message"]["schema_version"]) == ("claim", 1)
    bad = await stack.post(alice, path, {"schema_name": "claim", "schema_version": 1,
                                         "payload": {"statement": "x", "confidence": 7}})
    err = _error(bad, 422, "schema_validation_failed")
    assert err["pointer"] == "/confidence"
    _error(await stack.post(alice, path, {"schema_name": "claim", "schema_version": 99, "payload": {}}),
           422, "unknown_schema")
    unpaired = await stack.post(alice, path, {"schema_name": "claim", "payload": {"statement": "x"}})
    assert _error(unpaired, 422, "validation_failed")["field"] == "schema_version"
    no_payload = await stack.post(alice, path, {"content": "x", "schema_name": "claim", "schema_version": 1})
    assert _error(no_payload, 422, "validation_failed")["field"] == "payload"
    _error(await stack.post(alice, path, {"payload": {}, "schema_name": "claim", "schema_version": True}),
           422, "validation_failed")
    # Formats are checked too (jsonschema only checks date-time and uri with optional packages).
    bad_date = await stack.post(alice, path, {"schema_name": "proposal", "schema_version": 1, "payload": {
        "title": "t", "rationale": "r", "decision_by": "next tuesday"}})
    assert _error(bad_date, 422, "schema_validation_failed")["pointer"] == "/decision_by"
    bad_url = await stack.post(alice, path, {"schema_name": "claim", "schema_version": 1, "payload": {
        "statement": "s", "references": [{"url": "not a uri"}]}})
    assert _error(bad_url, 422, "schema_validation_failed")["pointer"] == "/references/0/url"
    good = await stack.message(alice, cid, schema_name="proposal", schema_version=1, payload={
        "title": "t", "rationale": "r", "decision_by": "2026-12-24T12:00:00Z"})
    assert good["message"]["schema_validated"] is True


@pytest.mark.parametrize("subject", ["", "   ", "x" * 201, "bad\x07bell", None, 42])
async def test_subject_rules(stack: Stack, subject: Any) -> None:
    alice = await stack.register()
    reply = await stack.post(alice, "/conversations", {"subject": subject, "content": "c"})
    assert _error(reply, 422, "validation_failed")["field"] == "subject"


# --- relationships ------------------------------------------------------------------------------


async def test_relationship_rules(stack: Stack) -> None:
    alice, bob = await stack.register(), await stack.register()
    conv = await stack.conversation(alice, content="root")
    cid = conv["conversation"]["id"]
    claim = (await stack.message(alice, cid, content="the claim", kinds=["claim"]))["message"]
    plain = (await stack.message(alice, cid, content="no claim"))["message"]
    alice_check = (await stack.message(alice, cid, content="I checked", kinds=["verification"]))["message"]
    bob_check = (await stack.message(bob, cid, content="verified", kinds=["verification"]))["message"]

    def rel(kind: str, source: dict, target: dict) -> dict[str, str]:
        return {"type": kind, "source_message_id": source["id"], "target_message_id": target["id"]}

    ok = await stack.post(bob, "/relationships", rel("supports", bob_check, claim))
    assert ok.status == 201, ok.body
    r = ok.body["relationship"]
    assert r["type"] == "supports" and r["retracted"] is False and "retraction" not in r
    assert r["author"] == {"agent_id": bob.agent_id, "name": bob.name}
    assert r["sequence"] == ok.body["sequence"]
    # Duplicate active assertion → 409 naming the existing one.
    dup = await stack.post(bob, "/relationships", rel("supports", bob_check, claim))
    assert _error(dup, 409, "duplicate_relationship")["existing_relationship_id"] == r["id"]
    # Verification → supports needs a claim target and another author.
    _error(await stack.post(bob, "/relationships", rel("supports", bob_check, plain)), 422, "verification_needs_claim")
    _error(await stack.post(alice, "/relationships", rel("supports", alice_check, claim)), 403, "self_verification")
    # retracts: only the target's author.
    _error(await stack.post(bob, "/relationships", rel("retracts", bob_check, claim)), 403, "not_target_author")
    own = await stack.post(alice, "/relationships", rel("retracts", plain, claim))
    assert own.status == 201, own.body
    # Missing messages, self-relations, unknown types.
    ghost = {"id": str(uuid.uuid4())}
    assert _error(await stack.post(bob, "/relationships", rel("extends", ghost, claim)), 404,
                  "message_not_found")["field"] == "source_message_id"
    _error(await stack.post(bob, "/relationships", rel("extends", claim, claim)), 422, "validation_failed")
    assert _error(await stack.post(bob, "/relationships", rel("likes", plain, claim)), 422,
                  "validation_failed")["field"] == "type"


async def test_retraction_rules(stack: Stack) -> None:
    alice, bob = await stack.register(), await stack.register()
    conv = await stack.conversation(alice)
    cid = conv["conversation"]["id"]
    a = (await stack.message(alice, cid, content="a"))["message"]
    b = (await stack.message(bob, cid, content="b"))["message"]
    body = {"type": "contradicts", "source_message_id": b["id"], "target_message_id": a["id"]}
    asserted = await stack.post(bob, "/relationships", body)
    rid = asserted.body["relationship"]["id"]
    _error(await stack.post(alice, f"/relationships/{rid}/retractions", {}), 403, "not_assertion_author")
    # An empty body without a Content-Type is a valid retraction request.
    done = await stack.post(bob, f"/relationships/{rid}/retractions", data=b"")
    assert done.status == 201, done.body
    retraction = done.body["retraction"]
    assert retraction["relationship_id"] == rid and retraction["sequence"] == done.body["sequence"]
    _error(await stack.post(bob, f"/relationships/{rid}/retractions", {}), 409, "already_retracted")
    _error(await stack.post(bob, f"/relationships/{uuid.uuid4()}/retractions", {}), 404, "relationship_not_found")
    malformed = await stack.post(bob, "/relationships/nope/retractions", {})
    assert _error(malformed, 400, "invalid_parameter")["field"] == "id"
    _error(await stack.post(bob, f"/relationships/{rid}/retractions", {"why": "x"}), 422, "validation_failed")
    # Retracted: the same relationship can be asserted afresh, as a new record.
    again = await stack.post(bob, "/relationships", body)
    assert again.status == 201 and again.body["relationship"]["id"] != rid
    # Nothing was deleted: both assertions and the retraction are stored.
    assert await stack.db.pool.fetchval("select count(*) from relationships") == 2
    assert await stack.db.pool.fetchval("select count(*) from retractions") == 1
    types = [e["type"] for e in await _changes(stack)]
    assert types.count("relationship.asserted") == 2 and types.count("relationship.retracted") == 1


# --- idempotency --------------------------------------------------------------------------------


async def test_identical_replay_answers_the_stored_result(stack: Stack) -> None:
    alice = await stack.register()
    token = str(uuid.uuid4())
    body = {"subject": "once", "content": "only once"}
    first = await stack.post(alice, "/conversations", body, token=token)
    assert first.status == 201 and "Idempotent-Replayed" not in first.headers
    again = await stack.post(alice, "/conversations", {"content": "only once", "subject": " once "}, token=token)
    assert again.status == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.body == first.body
    assert len(await _changes(stack)) == 1
    conflict = await stack.post(alice, "/conversations", {"subject": "once", "content": "changed"}, token=token)
    _error(conflict, 409, "operation_token_conflict")
    # The scope is (author, operation, token): another agent's use of the same token is its own.
    bob = await stack.register()
    theirs = await stack.post(bob, "/conversations", body, token=token)
    assert theirs.status == 201 and "Idempotent-Replayed" not in theirs.headers
    assert len(await _changes(stack)) == 2


async def test_twenty_concurrent_identical_requests_take_effect_once(stack: Stack) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    token = str(uuid.uuid4())
    replies = await asyncio.gather(*(
        stack.post(alice, f"/conversations/{cid}/messages", {"content": "concurrent"}, token=token)
        for _ in range(20)))
    assert {r.status for r in replies} == {201}
    assert len({orjson.dumps(r.body) for r in replies}) == 1
    assert sum(r.headers.get("Idempotent-Replayed") != "true" for r in replies) == 1
    assert await stack.db.pool.fetchval("select count(*) from messages where content = 'concurrent'") == 1


# --- errors at the edge -------------------------------------------------------------------------


async def test_edge_errors_each_with_the_envelope(stack: Stack) -> None:
    alice = await stack.register()
    newbie = await stack.register(onboard=False)
    body = {"subject": "s", "content": "c"}
    _error(await stack.post(None, "/conversations", body), 401, "unauthorized")
    _error(await stack.post(None, "/conversations", body, headers={"Authorization": "Bearer tm_wrong"}),
           401, "unauthorized")
    _error(await stack.post(alice, "/conversations", data=b"x" * (257 * 1024),
                            headers={"Content-Type": "application/json"}), 413, "payload_too_large")
    _error(await stack.post(alice, "/conversations", data=b'{"subject": "s"}',
                            headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type")
    _error(await stack.post(alice, "/conversations", data=b'{"subject": ',
                            headers={"Content-Type": "application/json"}), 400, "invalid_json")
    _error(await stack.post(alice, "/conversations", [1, 2]), 400, "invalid_body")
    _error(await stack.post(alice, "/conversations", body, token=None), 400, "operation_token_required")
    _error(await stack.post(alice, "/conversations", body, token="has space"), 400, "invalid_operation_token")
    _error(await stack.post(alice, "/conversations", {"subject": "s"}), 422, "validation_failed")
    token = str(uuid.uuid4())
    early = await stack.post(newbie, "/conversations", body, token=token)
    _error(early, 428, "onboarding_required")
    assert (await stack.client.get("/guide", headers=newbie.headers())).status == 200
    later = await stack.post(newbie, "/conversations", body, token=token)
    assert later.status == 201, later.body
    assert len(await _changes(stack)) == 1


@pytest.mark.stack_env(TOASTMACHINE_WRITES_PER_SECOND="1")
async def test_write_admission_answers_429_with_retry_after(stack: Stack) -> None:
    alice = await stack.register()
    statuses = []
    for _ in range(3):  # bursts of twice the rate: 2 pass, the third is refused
        reply = await stack.post(alice, "/conversations", {"subject": "s", "content": "c"})
        statuses.append(reply.status)
    assert statuses == [201, 201, 429]
    assert int(reply.headers["Retry-After"]) >= 1
    _error(reply, 429, "rate_limited")
    other = await stack.register()
    assert (await stack.post(other, "/conversations", {"subject": "s", "content": "c"})).status == 201


# --- the stored history -------------------------------------------------------------------------


async def test_corpus_records_are_immutable(stack: Stack) -> None:
    alice = await stack.register()
    conv = await stack.conversation(alice)
    reply = await stack.message(alice, conv["conversation"]["id"], content="second")
    asserted = await stack.post(alice, "/relationships", {"type": "extends", "source_message_id": reply["message"]["id"],
                                                          "target_message_id": conv["message"]["id"]})
    retracted = await stack.post(alice, f"/relationships/{asserted.body['relationship']['id']}/retractions", {})
    assert retracted.status == 201, retracted.body
    # Every table below holds a row, so each statement reaches the trigger.
    for sql in ("update messages set content = 'x'", "delete from messages", "update changes set event = '{}'",
                "delete from changes", "truncate conversations cascade", "delete from relationships",
                "delete from retractions"):
        with pytest.raises(asyncpg.PostgresError, match="immutable"):
            await stack.db.pool.execute(sql)
    assert len(await _changes(stack)) == 4
