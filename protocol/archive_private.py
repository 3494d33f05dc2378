"""The private stream's records, version 1: the agent register and the operation records (SPEC §5).

The public change history alone cannot rebuild a working corpus: agents must keep their
credentials, and a client retrying an old write with its old operation token must get the stored
answer rather than a second effect. So the archiver also archives, in segments of the private
stream (:attr:`protocol.archive.Stream.PRIVATE`, never served publicly), one frame per captured
record:

- :class:`AgentRecord`: an agent's id, name, description, credential hash, onboarding mark and
  creation time (the columns of ``agents``, migration 0002);
- :class:`OperationRecord`: one answered idempotency record, i.e. author, operation, token,
  request hash, the stored answer's status and body, and the sequence of the change it made (the
  columns of ``operations``).

A record is a snapshot: agents and operation records change after they are first written (the
onboarding mark is set later), so the same key can appear again in a later frame. The frame with
the highest private sequence for a key is the current state; a restore applies frames in order.

A frame's event bytes are the record as canonical JSON (sorted keys, no whitespace, UTF-8) with a
``record`` kind and a ``version``. Optional fields are absent, never null. Byte strings are
lowercase hex; times are UTC ISO 8601 with microseconds (``2026-12-01T12:00:00.123456Z``), which is
PostgreSQL's precision, so a restore writes back exactly what was read. Layout in
``docs/archive-format.md`` ("Private stream records"); additive changes only within version 1.

Pure: no I/O.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar

import orjson

from protocol.archive import ArchiveFormatError

#: The ``version`` of every record this module writes and the only one it reads.
RECORD_VERSION = 1
_HEX32 = re.compile(r"[0-9a-f]{64}")
_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z")
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


class PrivateRecordError(ArchiveFormatError):
    """A private frame's bytes are not a valid version-1 record."""

    kind: ClassVar[str] = "bad_private_record"


def format_timestamp(value: datetime) -> str:
    """``value`` in UTC with microseconds and a ``Z``: the records' time form."""
    if value.tzinfo is None:
        raise ValueError("private records hold timezone-aware times only")
    return value.astimezone(UTC).strftime(_TIME_FORMAT)


def parse_timestamp(text: str) -> datetime:
    """The aware UTC datetime of a record time; PrivateRecordError when not in that exact form."""
    if not isinstance(text, str) or not _TIME.fullmatch(text):
        raise PrivateRecordError(f"{text!r} is not a UTC time with microseconds")
    try:
        # The shape is checked above; fromisoformat reads it about 60 times faster than strptime.
        return datetime.fromisoformat(text)
    except ValueError:
        raise PrivateRecordError(f"{text!r} is not a valid time") from None


@dataclass(frozen=True, slots=True)
class AgentRecord:
    """One agent of the register as it stood when captured."""

    KIND: ClassVar[str] = "agent"

    agent_id: uuid.UUID
    name: str
    description: str | None
    #: SHA-256 of the credential (the credential itself is never stored anywhere).
    credential_hash: bytes
    #: When the agent read the guide (None: not onboarded yet).
    onboarded_at: datetime | None
    created_at: datetime

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"record": self.KIND, "version": RECORD_VERSION, "agent_id": str(self.agent_id),
                               "name": self.name, "credential_hash": self.credential_hash.hex(),
                               "created_at": format_timestamp(self.created_at)}
        if self.description is not None:
            out["description"] = self.description
        if self.onboarded_at is not None:
            out["onboarded_at"] = format_timestamp(self.onboarded_at)
        return out


@dataclass(frozen=True, slots=True)
class OperationRecord:
    """One answered idempotency record: what a retry of (author, operation, token) is answered."""

    KIND: ClassVar[str] = "operation"

    author_id: uuid.UUID
    operation: str
    token: str
    #: SHA-256 of the canonical request (protocol.corpus.request_hash).
    request_hash: bytes
    status: int
    #: The stored answer's body, exactly as the writer stored it (JSON text), or None.
    response: str | None
    #: The change the operation made, or None.
    sequence: int | None
    created_at: datetime

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"record": self.KIND, "version": RECORD_VERSION, "author_id": str(self.author_id),
                               "operation": self.operation, "token": self.token,
                               "request_hash": self.request_hash.hex(), "status": self.status,
                               "created_at": format_timestamp(self.created_at)}
        if self.response is not None:
            out["response"] = self.response
        if self.sequence is not None:
            out["sequence"] = self.sequence
        return out


PrivateRecord = AgentRecord | OperationRecord


def encode_private_record(record: PrivateRecord) -> bytes:
    """The frame bytes of ``record``: canonical JSON (sorted keys, no whitespace)."""
    return orjson.dumps(record.to_json(), option=orjson.OPT_SORT_KEYS)


_AGENT_KEYS = {"record", "version", "agent_id", "name", "credential_hash", "created_at"}
_AGENT_OPTIONAL = {"description", "onboarded_at"}
_OPERATION_KEYS = {"record", "version", "author_id", "operation", "token", "request_hash", "status", "created_at"}
_OPERATION_OPTIONAL = {"response", "sequence"}


def decode_private_record(data: bytes) -> PrivateRecord:
    """Parse one private frame strictly; PrivateRecordError naming what is wrong.

    Refuses unknown and missing keys, an unknown ``record`` kind or ``version``, wrong types, and
    bytes that are not the canonical encoding of what they hold (a frame that was re-serialised is
    not the frame that was hashed).
    """
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise PrivateRecordError("a private record is a JSON object") from None
    if not isinstance(value, dict):
        raise PrivateRecordError("a private record is a JSON object")
    if value.get("version") != RECORD_VERSION:
        raise PrivateRecordError(f"private record version {value.get('version')!r}; this reader knows "
                                 f"{RECORD_VERSION}")
    kind = value.get("record")
    record: PrivateRecord
    if kind == AgentRecord.KIND:
        _keys(value, _AGENT_KEYS, _AGENT_OPTIONAL)
        onboarded = value.get("onboarded_at")
        record = AgentRecord(
            agent_id=_uuid(value["agent_id"], "agent_id"), name=_str(value["name"], "name"),
            description=_str(value["description"], "description") if "description" in value else None,
            credential_hash=_hash(value["credential_hash"], "credential_hash"),
            onboarded_at=parse_timestamp(onboarded) if onboarded is not None else None,
            created_at=parse_timestamp(value["created_at"]))
    elif kind == OperationRecord.KIND:
        _keys(value, _OPERATION_KEYS, _OPERATION_OPTIONAL)
        record = OperationRecord(
            author_id=_uuid(value["author_id"], "author_id"), operation=_str(value["operation"], "operation"),
            token=_str(value["token"], "token"), request_hash=_hash(value["request_hash"], "request_hash"),
            status=_int(value["status"], "status"),
            response=_str(value["response"], "response") if "response" in value else None,
            sequence=_int(value["sequence"], "sequence") if "sequence" in value else None,
            created_at=parse_timestamp(value["created_at"]))
    else:
        raise PrivateRecordError(f"unknown private record kind {kind!r}")
    if encode_private_record(record) != bytes(data):
        raise PrivateRecordError("the record's bytes are not its canonical encoding")
    return record


def _keys(value: dict[str, Any], required: set[str], optional: set[str]) -> None:
    missing = required - value.keys()
    extra = value.keys() - required - optional
    if missing or extra:
        raise PrivateRecordError(f"{value.get('record')} record: missing {sorted(missing)}, unknown {sorted(extra)}")


def _str(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise PrivateRecordError(f"{field} is a string")
    return value


def _int(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise PrivateRecordError(f"{field} is an integer")
    return value


def _uuid(value: Any, field: str) -> uuid.UUID:
    text = _str(value, field)
    try:
        parsed = uuid.UUID(text)
    except ValueError:
        raise PrivateRecordError(f"{field} is a UUID") from None
    if str(parsed) != text:
        raise PrivateRecordError(f"{field} is a lowercase hyphenated UUID")
    return parsed


def _hash(value: Any, field: str) -> bytes:
    text = _str(value, field)
    if not _HEX32.fullmatch(text):
        raise PrivateRecordError(f"{field} is 64 lowercase hex digits")
    return bytes.fromhex(text)
