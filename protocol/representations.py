"""The public shapes of SPEC §3 and the event envelope of SPEC §4, built in one place.

The writer builds them when it commits (they go into the change history and the 201 answer); the
read routes build them from rows. Optional fields are absent, never null, except ``payload``, whose
JSON null is a value.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

EVENT_SCHEMA_VERSION = 1
CONVERSATION_CREATED = "conversation.created"
MESSAGE_APPENDED = "message.appended"
RELATIONSHIP_ASSERTED = "relationship.asserted"
RELATIONSHIP_RETRACTED = "relationship.retracted"
EVENT_TYPES = (CONVERSATION_CREATED, MESSAGE_APPENDED, RELATIONSHIP_ASSERTED, RELATIONSHIP_RETRACTED)


def now_ms() -> datetime:
    """The current UTC time truncated to milliseconds: what is stored is exactly what is shown."""
    now = datetime.now(UTC)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def format_time(moment: datetime) -> str:
    """ISO 8601 in UTC with milliseconds and a ``Z``: ``2026-11-30T23:59:59.123Z``."""
    # isoformat is C all the way (strftime was a noticeable share of a write's CPU in the writer)
    # and pads the year to four digits, as ISO 8601 asks; only "+00:00" becomes "Z".
    return moment.astimezone(UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def author(agent_id: str, name: str) -> dict[str, str]:
    """``{agent_id, name}``: how a message, conversation or relationship names who wrote it."""
    return {"agent_id": agent_id, "name": name}


def message(
    *, id: str, conversation_id: str, author_id: str, author_name: str, sequence: int,
    created_at: datetime, kinds: Sequence[str], content: str | None, payload_json: str | None,
    schema_name: str | None, schema_version: int | None, reply_to: str | None,
    tags: Sequence[str], mentions: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """The message representation; ``payload_json`` is canonical JSON text (None: no payload)."""
    out: dict[str, Any] = {
        "id": id, "conversation_id": conversation_id, "author": author(author_id, author_name),
        "sequence": sequence, "created_at": format_time(created_at), "kinds": list(kinds),
    }
    if content is not None:
        out["content"] = content
    if payload_json is not None:
        # Embedded as the stored bytes: no decode/encode round trip can change a number or a key.
        out["payload"] = orjson.Fragment(payload_json)
    if schema_name is not None:
        out["schema_name"] = schema_name
        out["schema_version"] = schema_version
        out["schema_validated"] = True
    if reply_to is not None:
        out["reply_to"] = reply_to
    out["tags"] = list(tags)
    out["mentions"] = [author(agent_id, name) for agent_id, name in mentions]
    return out


def conversation(
    *, id: str, subject: str, author_id: str, author_name: str, root_message_id: str,
    created_sequence: int, created_at: datetime, message_count: int, last_sequence: int,
) -> dict[str, Any]:
    """The conversation representation."""
    return {
        "id": id, "subject": subject, "author": author(author_id, author_name),
        "root_message_id": root_message_id, "created_sequence": created_sequence,
        "created_at": format_time(created_at), "message_count": message_count, "last_sequence": last_sequence,
    }


def retraction_ref(*, id: str, sequence: int, created_at: datetime) -> dict[str, Any]:
    """``{id, sequence, created_at}``: the retraction as nested in a relationship."""
    return {"id": id, "sequence": sequence, "created_at": format_time(created_at)}


def relationship(
    *, id: str, type: str, source_message_id: str, target_message_id: str, author_id: str,
    author_name: str, sequence: int, created_at: datetime, retraction: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The relationship representation; ``retraction`` from :func:`retraction_ref` when retracted."""
    out: dict[str, Any] = {
        "id": id, "type": type, "source_message_id": source_message_id,
        "target_message_id": target_message_id, "author": author(author_id, author_name),
        "sequence": sequence, "created_at": format_time(created_at), "retracted": retraction is not None,
    }
    if retraction is not None:
        out["retraction"] = retraction
    return out


def retraction(*, id: str, relationship_id: str, sequence: int, created_at: datetime) -> dict[str, Any]:
    """The retraction record as answered by ``POST /relationships/{id}/retractions``."""
    return {"id": id, "relationship_id": relationship_id, "sequence": sequence,
            "created_at": format_time(created_at)}


def envelope(*, sequence: int, type: str, partition: int, corpus_id: str, lineage: str,
             occurred_at: datetime, data: dict[str, Any]) -> dict[str, Any]:
    """The change-history event envelope (SPEC §4)."""
    return {"schema_version": EVENT_SCHEMA_VERSION, "sequence": sequence, "type": type,
            "partition": partition, "corpus_id": corpus_id, "lineage": lineage,
            "occurred_at": format_time(occurred_at), "data": data}


def dumps(value: Any) -> bytes:
    """Encode a representation (orjson; payload fragments are embedded verbatim)."""
    return orjson.dumps(value)
