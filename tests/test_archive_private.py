"""The private stream's records: strict canonical round trips, and the triggers of migration 0007 that
mark agents and answered operation records for capture whenever they change."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import orjson
import pytest

from protocol.archive_private import (
    AgentRecord,
    OperationRecord,
    PrivateRecordError,
    decode_private_record,
    encode_private_record,
)
from tests.corpus_fixtures import Stack

WHEN = datetime(2026, 12, 1, 12, 0, 0, 123456, tzinfo=UTC)
AGENT = AgentRecord(uuid.UUID("11111111-2222-4333-8444-555555555555"), "Alice", None, bytes(range(32)), None, WHEN)
OPERATION = OperationRecord(AGENT.agent_id, "append_message", "tok/1 é?", bytes(32), 201,
                            '{"message":{"id":"x"},"sequence":7}', 7, WHEN)


@pytest.mark.parametrize("record", [
    AGENT,
    AgentRecord(AGENT.agent_id, "Alice", "a description", bytes(32), WHEN, WHEN),
    OPERATION,
    OperationRecord(AGENT.agent_id, "create_conversation", "t", bytes(32), 409, None, None, WHEN),
])
def test_records_round_trip_exactly_in_canonical_form(record: AgentRecord | OperationRecord) -> None:
    data = encode_private_record(record)
    assert decode_private_record(data) == record
    assert data == orjson.dumps(orjson.loads(data), option=orjson.OPT_SORT_KEYS)
    assert b"null" not in data  # optional fields are absent, never null


def test_times_keep_microseconds_and_are_utc() -> None:
    data = orjson.loads(encode_private_record(AGENT))
    assert data["created_at"] == "2026-12-01T12:00:00.123456Z"


@pytest.mark.parametrize("mutate", [
    lambda v: v.update(version=2),
    lambda v: v.update(record="grant"),
    lambda v: v.update(extra=1),
    lambda v: v.pop("credential_hash"),
    lambda v: v.update(credential_hash="AB" * 32),
    lambda v: v.update(agent_id="11111111222243338444555555555555"),
    lambda v: v.update(created_at="2026-12-01T12:00:00Z"),
    lambda v: v.update(description=None),
])
def test_decoder_refuses_anything_but_a_canonical_version_1_record(mutate: object) -> None:
    value = orjson.loads(encode_private_record(AGENT))
    mutate(value)  # type: ignore[operator]
    with pytest.raises(PrivateRecordError):
        decode_private_record(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))


def test_decoder_refuses_non_canonical_bytes() -> None:
    data = orjson.dumps(orjson.loads(encode_private_record(OPERATION)), option=orjson.OPT_INDENT_2)
    with pytest.raises(PrivateRecordError, match="canonical"):
        decode_private_record(data)
    with pytest.raises(PrivateRecordError):
        decode_private_record(b"[1]")


async def test_registering_onboarding_and_writing_mark_records_pending(stack: Stack) -> None:
    async def pending() -> set[tuple[str, str, str]]:
        rows = await stack.db.pool.fetch("select kind, agent_id::text, token from archive_private_pending")
        return {(r["kind"], r["agent_id"], r["token"]) for r in rows}

    agent = await stack.register(onboard=False)
    assert ("agent", agent.agent_id, "") in await pending()
    await stack.db.pool.execute("delete from archive_private_pending")
    await stack.client.get("/guide", headers=agent.headers())  # onboarding updates the agent row
    assert await pending() == {("agent", agent.agent_id, "")}
    await stack.db.pool.execute("delete from archive_private_pending")
    reply = await stack.post(agent, "/conversations", {"subject": "s", "content": "c"}, token="tok-1")
    assert reply.status == 201
    assert ("operation", agent.agent_id, "tok-1") in await pending()
