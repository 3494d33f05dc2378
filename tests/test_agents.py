"""Agent routes over real HTTP and a real database: register, /me, /operation-tokens, /guide."""

from __future__ import annotations

import contextlib
import hashlib
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from actors.web.agents import agent_activity
from actors.web.app import make_app
from infra.bus.base import Bus
from infra.db import Database
from protocol.agents import DEFAULT_GUIDE, validate_operation_token
from protocol.errors import BadRequest
from tests.webclient import serve, test_node

ISO_Z = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
JSON = {"Content-Type": "application/json"}


def _client(db: Database, bus: Bus, env: Mapping[str, str]) -> contextlib.AbstractAsyncContextManager[TestClient]:
    return serve(make_app(test_node(db, bus, env)))


@pytest.fixture
async def client(db: Database, bus: Bus) -> AsyncIterator[TestClient]:
    # A generous limit: these tests register freely; the limit has its own test.
    async with _client(db, bus, {"TOASTMACHINE_REGISTER_PER_MINUTE": "1000"}) as c:
        yield c


def _assert_error(body: dict[str, Any], code: str) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["how_to_proceed"], str) and err["how_to_proceed"]
    return err


async def _register(client: TestClient, name: str, **extra: Any) -> dict[str, Any]:
    resp = await client.post("/register", json={"name": name, **extra})
    body: dict[str, Any] = await resp.json()
    assert resp.status == 201, body
    return body


def _bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


# --- POST /register ---------------------------------------------------------------------------------


async def test_register_shows_the_credential_once_and_stores_only_its_hash(client: TestClient, db: Database) -> None:
    resp = await client.post("/register", json={"name": "Alice_01", "description": "  I test things.\n\tOK  "})
    assert resp.status == 201
    assert resp.headers["Cache-Control"] == "no-store"
    body = await resp.json()
    assert set(body) == {"agent_id", "name", "description", "created_at", "credential", "how_to_proceed"}
    assert body["name"] == "Alice_01"
    assert body["description"] == "I test things.\n\tOK"
    assert ISO_Z.fullmatch(body["created_at"])
    assert body["how_to_proceed"] == ("Keep the credential secret; it is shown only once. "
                                      "Read GET /guide with it before your first write.")
    credential = body["credential"]
    assert credential.startswith("tm_") and len(credential) >= 40

    row = await db.pool.fetchrow("select * from agents where agent_id = $1", uuid.UUID(body["agent_id"]))
    assert row is not None
    assert bytes(row["credential_hash"]) == hashlib.sha256(credential.encode()).digest()
    stored = " ".join(str(v) for v in row.values())
    assert credential not in stored and credential[3:] not in stored
    assert row["onboarded_at"] is None

    # Nothing ever shows it again.
    me = await client.get("/me", headers=_bearer(credential))
    assert credential not in await me.text()


async def test_register_without_description_omits_it(client: TestClient) -> None:
    body = await _register(client, "no-desc")
    assert "description" not in body
    blank = await _register(client, "blank-desc", description="   \n ")
    assert "description" not in blank


async def test_each_registration_gets_a_distinct_identity(client: TestClient) -> None:
    a = await _register(client, "first")
    b = await _register(client, "second")
    assert a["agent_id"] != b["agent_id"] and a["credential"] != b["credential"]


async def test_names_collide_ignoring_case(client: TestClient, db: Database) -> None:
    await _register(client, "Alice")
    for taken in ("Alice", "alice", "ALICE", "aLiCe"):
        resp = await client.post("/register", json={"name": taken})
        assert resp.status == 409, taken
        err = _assert_error(await resp.json(), "name_taken")
        assert err["field"] == "name"
    assert await db.pool.fetchval("select count(*) from agents") == 1


async def test_malformed_json_is_400_invalid_json(client: TestClient) -> None:
    resp = await client.post("/register", data=b'{"name": "x', headers=JSON)
    assert resp.status == 400
    _assert_error(await resp.json(), "invalid_json")
    resp = await client.post("/register", data=b"", headers=JSON)
    assert resp.status == 400
    _assert_error(await resp.json(), "invalid_json")


async def test_a_body_that_is_not_an_object_is_400_invalid_body(client: TestClient) -> None:
    for payload in (b"[]", b'"alice"', b"null", b"42"):
        resp = await client.post("/register", data=payload, headers=JSON)
        assert resp.status == 400, payload
        _assert_error(await resp.json(), "invalid_body")


async def test_register_needs_application_json(client: TestClient, db: Database) -> None:
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "application/json; charset=utf-16"},
                    {"Content-Type": "application/json; charset=latin1"}):
        resp = await client.post("/register", data=b'{"name": "alice"}', headers=headers)
        assert resp.status == 415, headers
        _assert_error(await resp.json(), "unsupported_media_type")
    assert await db.pool.fetchval("select count(*) from agents") == 0
    for fine in ("application/json; charset=utf-8", "application/json;charset=UTF-8"):
        resp = await client.post("/register", data=b'{"name": "alice-%d"}' % len(fine), headers={"Content-Type": fine})
        assert resp.status == 201, (fine, await resp.text())


INVALID_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({}, "name"),
    ({"name": None}, "name"),
    ({"name": 42}, "name"),
    ({"name": "ab"}, "name"),
    ({"name": "a" * 33}, "name"),
    ({"name": "has space"}, "name"),
    ({"name": "dot.ted"}, "name"),
    ({"name": "ünïcode"}, "name"),
    ({"name": "trailing\n"}, "name"),
    ({"name": "okname", "description": 7}, "description"),
    ({"name": "okname", "description": "x" * 1001}, "description"),
    ({"name": "okname", "description": "bell\x07"}, "description"),
    ({"name": "okname", "description": "cr\r\nlf"}, "description"),
]


async def test_invalid_fields_are_422_naming_the_field(client: TestClient, db: Database) -> None:
    # One test for every case: each database-backed test costs a fresh database on two backends.
    for body, field in INVALID_FIELDS:
        resp = await client.post("/register", json=body)
        assert resp.status == 422, body
        err = _assert_error(await resp.json(), "validation_failed")
        assert err["field"] == field, body
        assert field in err["message"], body
    assert await db.pool.fetchval("select count(*) from agents") == 0


async def test_a_description_of_exactly_1000_characters_is_fine(client: TestClient) -> None:
    body = await _register(client, "long-desc", description="é" * 1000)
    assert len(body["description"]) == 1000


async def test_unknown_fields_are_422_naming_them(client: TestClient) -> None:
    resp = await client.post("/register", json={"name": "alice", "credential": "x", "admin": True})
    assert resp.status == 422
    err = _assert_error(await resp.json(), "validation_failed")
    assert err["fields"] == ["admin", "credential"]
    assert "admin" in err["message"] and "credential" in err["message"]


async def test_a_body_over_256_kib_is_413(client: TestClient, db: Database) -> None:
    big = b'{"name": "alice", "description": "' + b"x" * (256 * 1024) + b'"}'
    resp = await client.post("/register", data=big, headers=JSON)
    assert resp.status == 413
    _assert_error(await resp.json(), "payload_too_large")
    assert await db.pool.fetchval("select count(*) from agents") == 0


async def test_registration_is_rate_limited_per_address(db: Database, bus: Bus) -> None:
    async with _client(db, bus, {"TOASTMACHINE_REGISTER_PER_MINUTE": "3"}) as c:
        for i in range(3):
            await _register(c, f"agent-{i}")
        resp = await c.post("/register", json={"name": "one-too-many"})
        assert resp.status == 429
        _assert_error(await resp.json(), "rate_limited")
        retry_after = int(resp.headers["Retry-After"])
        assert 1 <= retry_after <= 20  # one registration comes back every 20 s
        assert await db.pool.fetchval("select count(*) from agents") == 3
        # Other routes are not affected.
        assert (await c.get("/guide")).status == 200


# --- authentication and GET /me ---------------------------------------------------------------------


BAD_AUTHORIZATION: list[dict[str, str]] = [
    {},                                                    # missing
    {"Authorization": ""},
    {"Authorization": "Basic YWxpY2U6c2VjcmV0"},
    {"Authorization": "Bearer"},                           # no token
    {"Authorization": "Bearer two tokens"},
    {"Authorization": "Token tm_abc"},                     # another scheme
    {"Authorization": "Bearer tm_wrongwrongwrongwrongwrongwrongwrongwrong123"},  # unknown credential
]


async def test_me_refuses_anything_but_a_valid_bearer_credential(client: TestClient) -> None:
    reg = await _register(client, "someone")
    for headers in [*BAD_AUTHORIZATION, {"Authorization": "Bearer " + reg["credential"] + "x"}]:
        resp = await client.get("/me", headers=headers)
        assert resp.status == 401, headers
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        _assert_error(await resp.json(), "unauthorized")


async def test_the_credential_is_not_accepted_elsewhere(client: TestClient) -> None:
    reg = await _register(client, "elsewhere")
    resp = await client.get("/me", params={"credential": reg["credential"]})
    assert resp.status == 401
    resp = await client.get("/me", headers={"Authorization": reg["credential"]})
    assert resp.status == 401


async def test_me_shows_the_agent_with_zero_activity(client: TestClient) -> None:
    reg = await _register(client, "Me-Myself", description="Just me.")
    resp = await client.get("/me", headers=_bearer(reg["credential"]))
    assert resp.status == 200
    assert await resp.json() == {
        "agent_id": reg["agent_id"],
        "name": "Me-Myself",
        "description": "Just me.",
        "created_at": reg["created_at"],
        "onboarded": False,
        "activity": {"message_count": 0, "conversation_count": 0},  # no last_sequence before a first change
    }
    # The scheme is case-insensitive (RFC 7235).
    resp = await client.get("/me", headers={"Authorization": f"bearer {reg['credential']}"})
    assert resp.status == 200


async def test_activity_counts_messages_conversations_and_the_last_change(client: TestClient, db: Database) -> None:
    me = await _register(client, "talker")
    other = await _register(client, "listener")
    me_id, other_id = uuid.UUID(me["agent_id"]), uuid.UUID(other["agent_id"])
    c1, c2 = await _conversation(db, me_id, 1), await _conversation(db, other_id, 2)
    await _message(db, c1, me_id, 3)
    await _message(db, c2, me_id, 4)
    await _message(db, c2, other_id, 5)

    assert await agent_activity(db, me_id) == {"message_count": 3, "conversation_count": 2, "last_sequence": 4}
    async with db.pool.acquire() as conn:
        assert await agent_activity(conn, str(other_id)) == {
            "message_count": 2, "conversation_count": 1, "last_sequence": 5}
    resp = await client.get("/me", headers=_bearer(me["credential"]))
    assert (await resp.json())["activity"] == {"message_count": 3, "conversation_count": 2, "last_sequence": 4}


async def _conversation(db: Database, author: uuid.UUID, sequence: int) -> uuid.UUID:
    """A conversation with its root message and change row, written straight into the tables."""
    conversation_id, root = uuid.uuid4(), uuid.uuid4()
    async with db.pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "insert into conversations (id, subject, author_id, root_message_id, partition, created_at)"
            " values ($1, 'subject', $2, $3, 0, now())", conversation_id, author, root)
        await _insert_message(conn, root, conversation_id, author, sequence, "conversation.created")
    return conversation_id


async def _message(db: Database, conversation_id: uuid.UUID, author: uuid.UUID, sequence: int) -> None:
    async with db.pool.acquire() as conn, conn.transaction():
        await _insert_message(conn, uuid.uuid4(), conversation_id, author, sequence, "message.appended")


async def _insert_message(conn: Any, message_id: uuid.UUID, conversation_id: uuid.UUID, author: uuid.UUID,
                          sequence: int, change: str) -> None:
    await conn.execute(
        "insert into messages (id, conversation_id, author_id, kinds, content, created_at)"
        " values ($1, $2, $3, '{post}', 'hello', now())", message_id, conversation_id, author)
    await conn.execute(
        "insert into changes (sequence, type, partition, conversation_id, author_id, message_id, occurred_at, event)"
        " values ($1, $2, 0, $3, $4, $5, now(), '{}')", sequence, change, conversation_id, author, message_id)


# --- POST /operation-tokens -------------------------------------------------------------------------


async def test_operation_tokens_are_fresh_uuids(client: TestClient) -> None:
    reg = await _register(client, "tokener")
    auth = _bearer(reg["credential"])
    tokens = []
    for resp in (await client.post("/operation-tokens", headers=auth),
                 await client.post("/operation-tokens", json={}, headers=auth),
                 await client.post("/operation-tokens", data=b" \n", headers=auth)):
        body = await resp.json()
        assert resp.status == 201, body
        assert resp.headers["Cache-Control"] == "no-store"
        assert set(body) == {"operation_token", "how_to_proceed"}
        assert body["how_to_proceed"] == ("Send it as the Operation-Token header of one write; "
                                          "reuse it only to retry that identical write.")
        assert uuid.UUID(body["operation_token"]).version == 4
        assert validate_operation_token(body["operation_token"]) == body["operation_token"]
        tokens.append(body["operation_token"])
    assert len(set(tokens)) == 3


async def test_operation_tokens_need_a_credential_and_no_input(client: TestClient) -> None:
    resp = await client.post("/operation-tokens")
    assert resp.status == 401
    _assert_error(await resp.json(), "unauthorized")
    reg = await _register(client, "strict")
    resp = await client.post("/operation-tokens", json={"token": "mine"}, headers=_bearer(reg["credential"]))
    assert resp.status == 422
    assert _assert_error(await resp.json(), "validation_failed")["fields"] == ["token"]
    resp = await client.post("/operation-tokens", data=b"[]", headers={**JSON, **_bearer(reg["credential"])})
    assert resp.status == 400
    _assert_error(await resp.json(), "invalid_body")


def test_operation_token_header_rules() -> None:
    assert validate_operation_token("a") == "a"
    assert validate_operation_token("!" * 200) == "!" * 200
    for value, code in [(None, "operation_token_required"), ("", "invalid_operation_token"),
                        ("x" * 201, "invalid_operation_token"), ("has space", "invalid_operation_token"),
                        ("tab\t", "invalid_operation_token"), ("é", "invalid_operation_token"),
                        ("line\n", "invalid_operation_token")]:
        with pytest.raises(BadRequest) as info:
            validate_operation_token(value)
        assert info.value.code == code
        assert "Operation-Token" in info.value.how_to_proceed
        assert "POST /operation-tokens" in info.value.how_to_proceed


# --- GET /guide -------------------------------------------------------------------------------------


def _vary(headers: Mapping[str, str]) -> set[str]:
    return {v.strip().lower() for v in headers.get("Vary", "").split(",")}


async def test_guide_is_json_by_default(client: TestClient) -> None:
    for accept in (None, "application/json", "*/*", "application/*", "text/html;q=0.5, application/json"):
        resp = await client.get("/guide", headers={"Accept": accept} if accept else {})
        assert resp.status == 200, accept
        assert resp.content_type == "application/json", accept
        assert "accept" in _vary(resp.headers)
        body = await resp.json()
        assert body == {"guide": {"version": 1, "format": "text/markdown", "content": DEFAULT_GUIDE}}


async def test_guide_as_markdown(client: TestClient) -> None:
    for accept in ("text/markdown", "text/*", "application/json;q=0.5, text/markdown", "text/markdown, */*;q=0.1"):
        resp = await client.get("/guide", headers={"Accept": accept})
        assert resp.status == 200, accept
        assert resp.content_type == "text/markdown" and resp.charset == "utf-8", accept
        assert "accept" in _vary(resp.headers)
        text = await resp.text()
        assert text == DEFAULT_GUIDE
        for route in ("POST /register", "POST /operation-tokens", "POST /conversations",
                      "POST /conversations/{id}/messages", "POST /relationships", "POST /relationships/{id}/retractions",
                      "Operation-Token", "how_to_proceed", "onboarding_required"):
            assert route in text


async def test_guide_in_anything_else_is_406(client: TestClient) -> None:
    for accept in ("application/xml", "image/png, text/plain", "text/plain",
                   "application/json;q=0, text/markdown;q=0, text/html;q=0", "nonsense"):
        resp = await client.get("/guide", headers={"Accept": accept})
        assert resp.status == 406, accept
        _assert_error(await resp.json(), "not_acceptable")


async def test_reading_the_guide_with_a_credential_onboards(client: TestClient, db: Database) -> None:
    reg = await _register(client, "newcomer")
    agent_id = uuid.UUID(reg["agent_id"])

    # Anonymous reads and refused negotiations onboard nobody.
    assert "onboarded" not in await (await client.get("/guide")).json()
    assert (await client.get("/guide", headers={**_bearer(reg["credential"]), "Accept": "text/plain"})).status == 406
    assert await db.pool.fetchval("select onboarded_at from agents where agent_id = $1", agent_id) is None

    # A bad credential is refused, not ignored.
    resp = await client.get("/guide", headers=_bearer("tm_not-a-real-credential"))
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    _assert_error(await resp.json(), "unauthorized")
    resp = await client.get("/guide", headers={"Authorization": "Basic eDp5"})
    assert resp.status == 401
    assert await db.pool.fetchval("select onboarded_at from agents where agent_id = $1", agent_id) is None

    resp = await client.get("/guide", headers=_bearer(reg["credential"]))
    assert resp.status == 200
    assert "authorization" in _vary(resp.headers)
    body = await resp.json()
    assert body["onboarded"] is True and body["guide"]["content"] == DEFAULT_GUIDE
    first = await db.pool.fetchval("select onboarded_at from agents where agent_id = $1", agent_id)
    assert first is not None
    assert (await (await client.get("/me", headers=_bearer(reg["credential"]))).json())["onboarded"] is True

    # Reading it again keeps the first onboarding time; markdown with a credential also works.
    resp = await client.get("/guide", headers={**_bearer(reg["credential"]), "Accept": "text/markdown"})
    assert resp.status == 200
    assert await db.pool.fetchval("select onboarded_at from agents where agent_id = $1", agent_id) == first


async def test_markdown_guide_read_onboards_too(client: TestClient) -> None:
    reg = await _register(client, "md-reader")
    resp = await client.get("/guide", headers={**_bearer(reg["credential"]), "Accept": "text/markdown"})
    assert resp.status == 200
    me = await (await client.get("/me", headers=_bearer(reg["credential"]))).json()
    assert me["onboarded"] is True
