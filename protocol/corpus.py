"""The corpus's write rules as pure functions: limits, validators, derived fields, canonical forms.

The ingress validates every write body here at the edge, and the corpus writer runs the same
validators again on the command it receives (a command that fails them past the edge is a bug or a
forgery: it is dead-lettered with the reason). Rules that need the database (does reply_to exist,
who wrote the target message...) live in the writer; everything that can be decided from the
request alone lives here.

Validators take the decoded JSON body (``object``: anything ``orjson.loads`` can return) and return
a frozen dataclass, or raise :class:`~protocol.errors.ApiError` subclasses whose ``extra`` names the
offending ``field``.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from protocol.errors import ApiError, Unprocessable, clip, quote
from protocol.schemas import catalogue
from protocol.validation import check_depth, expect_object, reject_unknown

# --- limits (SPEC §2) -----------------------------------------------------------------------------

#: Message kinds in their canonical order; stored kinds are always sorted this way.
KINDS: tuple[str, ...] = ("post", "claim", "challenge", "verification", "status-update", "question", "proposal")
DEFAULT_KINDS: tuple[str, ...] = ("post",)
RELATIONSHIP_TYPES: tuple[str, ...] = ("replies-to", "supports", "contradicts", "extends", "retracts", "supersedes")
MAX_SUBJECT_CHARS = 200
MAX_CONTENT_CHARS = 65_536
MAX_PAYLOAD_BYTES = 65_536
#: A complete stored event (the envelope, as exported) is at most this many bytes.
MAX_EVENT_BYTES = 102_400
PARTITIONS = 16

#: Operation names: the scope of an idempotency record is (author, operation, token).
OP_CREATE_CONVERSATION = "conversation.create"
OP_APPEND_MESSAGE = "message.append"
OP_ASSERT_RELATIONSHIP = "relationship.assert"
OP_RETRACT_RELATIONSHIP = "relationship.retract"

_KIND_ORDER = {k: i for i, k in enumerate(KINDS)}
_TAG_RE = re.compile(r"(?<![\w#&])#([A-Za-z0-9][A-Za-z0-9_-]{0,63})(?![\w-])")
_MENTION_RE = re.compile(r"(?<![\w@.-])@([A-Za-z0-9_-]{3,32})(?![\w-])")


def _invalid(field: str, message: str, *, code: str = "validation_failed",
             how_to_proceed: str | None = None) -> Unprocessable:
    return Unprocessable(message, code=code, extra={"field": field},
                         how_to_proceed=how_to_proceed or f"Fix '{field}' and send the request again; "
                                                         "GET /guide describes every field.")


# --- canonical forms --------------------------------------------------------------------------------


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace: the form payloads are stored, sized and hashed in."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError) as e:
        raise _invalid("payload", f"payload cannot be stored as JSON: {e}") from e


def request_hash(operation: str, target: str | None, request: Mapping[str, Any]) -> bytes:
    """SHA-256 of the canonical request: what makes a replay "identical" (SPEC §2 idempotency)."""
    return hashlib.sha256(canonical_json({"op": operation, "target": target, "request": request})).digest()


def partition_of(conversation_id: str) -> int:
    """Stable partition 0–15 of a conversation (SPEC §4): first bytes of the SHA-256 of its id."""
    digest = hashlib.sha256(conversation_id.encode("ascii")).digest()
    return int.from_bytes(digest[:4], "big") % PARTITIONS


def extract_tags(content: str | None) -> list[str]:
    """``#tag`` words in content, lowercased, deduplicated, in order of first appearance."""
    if not content:
        return []
    return list(dict.fromkeys(m.lower() for m in _TAG_RE.findall(content)))


def extract_mentions(content: str | None) -> list[str]:
    """``@name`` words in content, deduplicated case-insensitively (first spelling kept)."""
    if not content:
        return []
    seen: dict[str, str] = {}
    for name in _MENTION_RE.findall(content):
        seen.setdefault(name.lower(), name)
    return list(seen.values())


# --- field validators -------------------------------------------------------------------------------


#: Characters that draw nothing although Unicode does not class them as spaces or format
#: characters: the Hangul fillers, the braille blank, combining joiners and variation selectors.
_BLANK_LOOKING = frozenset(
    "\u115f\u1160\u3164\uffa0\u2800\u034f\u17b4\u17b5\u180e"
    + "".join(map(chr, range(0xFE00, 0xFE10)))
    + "".join(map(chr, range(0xE0100, 0xE01F0))))
#: Categories that draw nothing: format (zero-width space and joiners, BOM...), space, line and
#: paragraph separators, control (tab, newline...).
_BLANK_CATEGORIES = frozenset({"Cf", "Zs", "Zl", "Zp", "Cc"})
#: Bidirectional embeddings, overrides and isolates: in a subject, shown in lists beside other
#: text, they can reorder what surrounds it (e.g. make a subject read backwards).
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def is_visibly_blank(text: str) -> bool:
    """True if ``text`` would show nothing: only whitespace, format characters and fillers."""
    return all(ch.isspace() or ch in _BLANK_LOOKING or unicodedata.category(ch) in _BLANK_CATEGORIES
               for ch in text)


def _has_control(text: str, *, allow_newlines: bool) -> bool:
    for ch in text:
        if allow_newlines and ch in "\n\r\t":
            continue
        if unicodedata.category(ch) == "Cc":
            return True
    return False


def display_problem(text: str) -> str | None:
    """Why ``text`` is unfit to show beside other text (in a list, a page, a terminal): control
    characters (escape sequences among them) or bidirectional overrides and isolates; None when fit."""
    if _has_control(text, allow_newlines=False):  # (category Cc: C0, DEL and C1 alike)
        return "control characters"
    if not _BIDI_CONTROLS.isdisjoint(text):
        return "bidirectional override or isolate characters (U+202A to U+202E, U+2066 to U+2069)"
    return None


def terminal_safe(text: str) -> str:
    """``text`` with control characters (but tab and newline) and bidirectional controls written as
    ``\\x1b``-style escapes, so that printing it cannot move the cursor, recolour or retitle an
    operator's terminal, or reorder the line."""
    return "".join(ch if (ch in "\t\n" or (unicodedata.category(ch) != "Cc" and ch not in _BIDI_CONTROLS))
                   else ch.encode("unicode_escape").decode("ascii") for ch in text)


def validate_uuid(value: object, field: str) -> str:
    """A UUID in any standard spelling, returned in canonical lowercase form."""
    if not isinstance(value, str):
        raise _invalid(field, f"'{field}' must be a UUID string.")
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise _invalid(field, f"'{field}' is not a valid UUID.") from None


def validate_subject(value: object) -> str:
    """Trimmed, 1–200 characters, no control characters."""
    if not isinstance(value, str):
        raise _invalid("subject", "'subject' is required and must be a string.")
    subject = value.strip()
    if is_visibly_blank(subject):
        raise _invalid("subject", "'subject' must not be blank: it needs at least one visible character "
                                  "(spaces, zero-width and other invisible characters do not count).")
    if len(subject) > MAX_SUBJECT_CHARS:
        raise _invalid("subject", f"'subject' is longer than {MAX_SUBJECT_CHARS} characters.")
    if _has_control(subject, allow_newlines=False):
        raise _invalid("subject", "'subject' must not contain control characters.")
    if not _BIDI_CONTROLS.isdisjoint(subject):
        raise _invalid("subject", "'subject' must not contain bidirectional override or isolate characters "
                                  "(U+202A to U+202E, U+2066 to U+2069).")
    return subject


def validate_kinds(value: object) -> tuple[str, ...]:
    """A non-empty list of unique known kinds, returned in canonical order."""
    if not isinstance(value, list) or not value:
        raise _invalid("kinds", f"'kinds' must be a non-empty list of: {', '.join(KINDS)}.")
    for kind in value:
        if not isinstance(kind, str) or kind not in _KIND_ORDER:
            raise _invalid("kinds", f"Unknown kind {quote(kind)}; kinds are: {', '.join(KINDS)}.")
    if len(set(value)) != len(value):
        raise _invalid("kinds", "'kinds' must not repeat a kind.")
    return tuple(sorted(value, key=_KIND_ORDER.__getitem__))


def validate_content(value: object) -> str:
    """Non-blank text of at most 65,536 characters (stored as sent)."""
    if not isinstance(value, str):
        raise _invalid("content", "'content' must be a string.")
    if is_visibly_blank(value):
        raise _invalid("content", "'content' must not be blank: it needs at least one visible character "
                                  "(spaces, zero-width and other invisible characters do not count).")
    if len(value) > MAX_CONTENT_CHARS:
        raise _invalid("content", f"'content' is longer than {MAX_CONTENT_CHARS} characters.")
    if "\x00" in value:
        raise _invalid("content", "'content' must not contain NUL characters.")
    return value


# --- message drafts ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MessageDraft:
    """A validated message before it is stored.

    ``payload_json`` is the canonical JSON text of the payload; None means *no payload*, while the
    text ``null`` is a JSON null payload (the two round-trip as different things).
    """

    kinds: tuple[str, ...]
    content: str | None
    payload_json: str | None
    schema_name: str | None
    schema_version: int | None
    reply_to: str | None
    tags: tuple[str, ...]
    mention_names: tuple[str, ...]

    def normalized(self) -> dict[str, Any]:
        """The canonical request: what the idempotency hash covers."""
        out: dict[str, Any] = {"kinds": list(self.kinds)}
        for name in ("content", "payload_json", "schema_name", "schema_version", "reply_to"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


_MESSAGE_FIELDS = ("content", "payload", "kinds", "schema_name", "schema_version", "reply_to")


def _validate_draft(body: Mapping[str, Any], *, allow_reply_to: bool) -> MessageDraft:
    content = validate_content(body["content"]) if "content" in body else None
    has_payload = "payload" in body
    if content is None and not has_payload:
        raise _invalid("content", "A message needs 'content', 'payload' or both.")
    payload_json: str | None = None
    if has_payload:
        encoded = canonical_json(body["payload"])
        if len(encoded) > MAX_PAYLOAD_BYTES:
            raise _invalid("payload", f"'payload' is {len(encoded)} bytes as canonical JSON; "
                                      f"the limit is {MAX_PAYLOAD_BYTES}.")
        payload_json = encoded.decode()
    kinds = validate_kinds(body["kinds"]) if "kinds" in body else DEFAULT_KINDS
    schema_name, schema_version = _validate_schema_ref(body)
    if schema_name is not None and schema_version is not None:
        violation = catalogue().violation(schema_name, schema_version, body["payload"])
        if violation is not None:
            raise Unprocessable(
                f"'payload' does not follow schema {schema_name} v{schema_version} at {quote(violation.pointer)}: "
                f"{violation.message}", code="schema_validation_failed",
                extra={"field": "payload", "pointer": clip(violation.pointer)},
                how_to_proceed="Fix the payload to follow the schema, or send it without schema_name.")
    reply_to = None
    if "reply_to" in body:
        if not allow_reply_to:
            raise _invalid("reply_to", "A conversation's root message cannot reply to anything.")
        reply_to = validate_uuid(body["reply_to"], "reply_to")
    return MessageDraft(kinds=kinds, content=content, payload_json=payload_json, schema_name=schema_name,
                        schema_version=schema_version, reply_to=reply_to,
                        tags=tuple(extract_tags(content)), mention_names=tuple(extract_mentions(content)))


def _validate_schema_ref(body: Mapping[str, Any]) -> tuple[str | None, int | None]:
    name, version = body.get("schema_name"), body.get("schema_version")
    if "schema_name" not in body and "schema_version" not in body:
        return None, None
    if ("schema_name" in body) != ("schema_version" in body):
        missing = "schema_version" if "schema_name" in body else "schema_name"
        raise _invalid(missing, "'schema_name' and 'schema_version' go together; send both or neither.")
    if not isinstance(name, str) or not name:
        raise _invalid("schema_name", "'schema_name' must be a non-empty string.")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _invalid("schema_version", "'schema_version' must be a positive integer.")
    if "payload" not in body:
        raise _invalid("payload", "A message with 'schema_name' needs a 'payload' to validate.")
    if (name, version) not in catalogue():
        known = ", ".join(f"{n} v{v}" for n, v in catalogue().names())
        raise Unprocessable(f"There is no schema {quote(name)} version {version}.", code="unknown_schema",
                            extra={"field": "schema_name"},
                            how_to_proceed=f"Use one of: {known}; or send the payload without a schema.")
    return name, version


# --- write requests ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewConversation:
    """``POST /conversations``: a subject and the root message."""

    subject: str
    message: MessageDraft

    def normalized(self) -> dict[str, Any]:
        return {"subject": self.subject, "message": self.message.normalized()}


@dataclass(frozen=True, slots=True)
class NewMessage:
    """``POST /conversations/{id}/messages``."""

    conversation_id: str
    message: MessageDraft

    def normalized(self) -> dict[str, Any]:
        return {"message": self.message.normalized()}


@dataclass(frozen=True, slots=True)
class NewRelationship:
    """``POST /relationships``."""

    type: str
    source_message_id: str
    target_message_id: str

    def normalized(self) -> dict[str, Any]:
        return {"type": self.type, "source_message_id": self.source_message_id,
                "target_message_id": self.target_message_id}


@dataclass(frozen=True, slots=True)
class NewRetraction:
    """``POST /relationships/{id}/retractions``."""

    relationship_id: str

    def normalized(self) -> dict[str, Any]:
        return {}


WriteRequest = NewConversation | NewMessage | NewRelationship | NewRetraction


def validate_new_conversation(body: object) -> NewConversation:
    data = expect_object(body)
    reject_unknown(data, ("subject", *_MESSAGE_FIELDS))
    subject = validate_subject(data.get("subject"))
    return NewConversation(subject=subject, message=_validate_draft(data, allow_reply_to=False))


def validate_new_message(conversation_id: str, body: object) -> NewMessage:
    data = expect_object(body)
    reject_unknown(data, _MESSAGE_FIELDS)
    return NewMessage(conversation_id=validate_uuid(conversation_id, "conversation_id"),
                      message=_validate_draft(data, allow_reply_to=True))


def validate_new_relationship(body: object) -> NewRelationship:
    data = expect_object(body)
    reject_unknown(data, ("type", "source_message_id", "target_message_id"))
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in RELATIONSHIP_TYPES:
        raise _invalid("type", f"'type' must be one of: {', '.join(RELATIONSHIP_TYPES)}.")
    source = validate_uuid(data.get("source_message_id"), "source_message_id")
    target = validate_uuid(data.get("target_message_id"), "target_message_id")
    if source == target:
        raise _invalid("target_message_id", "A message cannot be related to itself.")
    return NewRelationship(type=kind, source_message_id=source, target_message_id=target)


def validate_new_retraction(relationship_id: str, body: object) -> NewRetraction:
    data = expect_object(body)
    reject_unknown(data, ())
    return NewRetraction(relationship_id=validate_uuid(relationship_id, "relationship_id"))


#: operation → (validator taking (target, body)); ``target`` is the id from the path, if any.
def validate_write(operation: str, target: str | None, body: object) -> WriteRequest:
    """Validate the body of ``operation`` (one of the OP_* names).

    The nesting limit is checked here as well as where the body was parsed, because the writer
    gets its bodies from the bus, not from :func:`~protocol.validation.decode_json_body`.
    """
    check_depth(body)
    if operation == OP_CREATE_CONVERSATION:
        return validate_new_conversation(body)
    if operation == OP_APPEND_MESSAGE:
        return validate_new_message(target or "", body)
    if operation == OP_ASSERT_RELATIONSHIP:
        return validate_new_relationship(body)
    if operation == OP_RETRACT_RELATIONSHIP:
        return validate_new_retraction(target or "", body)
    raise ApiError(f"Unknown operation {quote(operation)}.", code="unknown_operation")
