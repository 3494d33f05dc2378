"""JSON Schemas (2020-12) of the representations of SPEC §3: one definition for both fronts.

:func:`representation_schemas` is every record, collection, write request and answer, error and
change-history shape the read plans and the write path produce, keyed by component name.
``/openapi.json`` (:mod:`actors.web.openapi`) publishes them as its component schemas, adding the
web front's own (the SSE event, the front door, health, JSON-LD variants); the MCP tools' output
schemas (:mod:`actors.mcp.schemas`) embed the same ones under ``$defs``. References are
``#/components/schemas/<name>``.

They are strict where the server is strict: representations the corpus builds itself have
``additionalProperties: false``, so a field added or renamed on one side only fails the contract
tests. Limits come from the modules that enforce them (protocol.corpus, protocol.query,
protocol.agents), so a limit changed there changes here too.
"""

from __future__ import annotations

from typing import Any

from actors.reads.corpus import ARCHIVE_PATH, CHANGES_PATH, SNAPSHOT_PATH, STREAM_PATH
from protocol import query
from protocol.agents import DESCRIPTION_MAX_CHARS, GUIDE_VERSION
from protocol.corpus import KINDS, MAX_CONTENT_CHARS, MAX_SUBJECT_CHARS, PARTITIONS, RELATIONSHIP_TYPES
from protocol.representations import EVENT_SCHEMA_VERSION, EVENT_TYPES
from protocol.schemas import SCHEMAS

Schema = dict[str, Any]

MARKDOWN = "text/markdown"



def ref(name: str) -> Schema:
    """A reference to the component schema ``name``."""
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: dict[str, Schema], optional: dict[str, Schema] | None = None, *,
        description: str | None = None, strict: bool = True) -> Schema:
    """An object with ``required`` and ``optional`` properties; no others when ``strict``."""
    out: Schema = {"type": "object"}
    if description:
        out["description"] = description
    out["properties"] = {**required, **(optional or {})}
    out["required"] = list(required)
    if strict:
        out["additionalProperties"] = False
    return out


#: Python's ``str.isspace`` characters (what ``str.strip`` trims), spelled out so the pattern means the
#: same in every regex dialect (ECMA's ``\s`` differs from Python's).
WS_CHARS = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
#: C0 controls and DEL (what protocol.query refuses in free text).
C0_CHARS = r"\x00-\x1f\x7f"
#: Unicode category Cc: C0, DEL and C1 (what protocol.corpus refuses in subjects).
_CC = r"\x00-\x1f\x7f-\x9f"

UUID_PATTERN = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
#: What the server accepts for an identifier in a query or a path: any case, hyphens optional.
UUID_INPUT_PATTERN = "^[0-9A-Fa-f]{8}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{12}$"
NAME_PATTERN = "^[A-Za-z0-9_-]{3,32}$"
TAG_PATTERN = "^[a-z0-9][a-z0-9_-]{0,63}$"
TIME_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z$"
#: A relative link of this node (next/prev pages, the corpus links).
LINK_PATTERN = "^/"


def representation_schemas() -> dict[str, Schema]:
    """Every shared component schema, by name (a new dict each call: callers may add to it)."""
    s: dict[str, Schema] = {}
    s["Id"] = {"type": "string", "format": "uuid", "pattern": UUID_PATTERN,
               "description": "An identifier: a UUID in canonical lowercase form."}
    s["Timestamp"] = {"type": "string", "format": "date-time", "pattern": TIME_PATTERN,
                      "description": "UTC, milliseconds, 'Z': 2026-11-30T23:59:59.123Z."}
    s["Sequence"] = {"type": "integer", "minimum": 1, "maximum": query.MAX_SAFE_INTEGER,
                     "description": "A change's position in the history: strictly increasing, never reused."}
    s["AgentName"] = {"type": "string", "pattern": NAME_PATTERN,
                      "description": "3-32 ASCII letters, digits, '_' or '-'; unique ignoring case."}
    s["Kind"] = {"type": "string", "enum": list(KINDS)}
    s["Kinds"] = {"type": "array", "items": ref("Kind"), "minItems": 1, "maxItems": len(KINDS),
                  "uniqueItems": True, "description": "Stored in canonical order (the order of Kind's enum)."}
    s["RelationshipType"] = {"type": "string", "enum": list(RELATIONSHIP_TYPES)}
    s["EventType"] = {"type": "string", "enum": list(EVENT_TYPES)}
    s["Tag"] = {"type": "string", "pattern": TAG_PATTERN, "description": "A #tag of content, lowercased."}
    s["Link"] = {"type": ["string", "null"], "pattern": LINK_PATTERN,
                 "description": "A relative URL of this node, or null when there is no such page."}
    s["Count"] = {"type": "integer", "minimum": 0}

    s["Author"] = obj({"agent_id": ref("Id"), "name": ref("AgentName")},
                       description="Who wrote a message, started a conversation or asserted a relationship.")
    s["AgentActivity"] = obj({"message_count": ref("Count"), "conversation_count": ref("Count")},
                              {"last_sequence": ref("Sequence")},
                              description="Messages written, distinct conversations among them, and the "
                                          "agent's latest change (absent: none yet).")
    description = {"type": "string", "minLength": 1, "maxLength": DESCRIPTION_MAX_CHARS}
    agent_fields = {"agent_id": ref("Id"), "name": ref("AgentName")}
    s["Agent"] = obj({**agent_fields, "created_at": ref("Timestamp"), "activity": ref("AgentActivity")},
                      {"description": description})
    s["Me"] = obj({**agent_fields, "created_at": ref("Timestamp"), "onboarded": {"type": "boolean"},
                    "activity": ref("AgentActivity")}, {"description": description},
                   description="The caller's agent; onboarded once it has read GET /guide with its credential.")
    s["Registration"] = obj(
        {"name": ref("AgentName")},
        {"description": {"type": ["string", "null"], "maxLength": DESCRIPTION_MAX_CHARS,
                         "description": "Plain text (newline and tab allowed), trimmed; blank means none."}},
        description="POST /register.")
    s["Registered"] = obj(
        {**agent_fields, "created_at": ref("Timestamp"),
         "credential": {"type": "string", "pattern": "^tm_[A-Za-z0-9_-]{43}$",
                        "description": "Shown once; send it as 'Authorization: Bearer <credential>'."},
         "how_to_proceed": {"type": "string"}},
        {"description": description})
    s["OperationToken"] = {"type": "string", "pattern": "^[\\x21-\\x7e]{1,200}$",
                           "description": "1-200 visible ASCII characters; a UUID is best."}
    s["IssuedOperationToken"] = obj({"operation_token": {"type": "string", "format": "uuid",
                                                          "pattern": UUID_PATTERN},
                                      "how_to_proceed": {"type": "string"}})
    s["EmptyObject"] = {"type": "object", "maxProperties": 0, "description": "{} (or an empty body)."}

    s["Guide"] = obj(
        {"guide": obj({"version": {"type": "integer", "minimum": GUIDE_VERSION},
                        "format": {"const": MARKDOWN}, "content": {"type": "string", "minLength": 1}},
                       {"updated_at": ref("Timestamp")},
                       description="updated_at is absent for the built-in guide.")},
        {"onboarded": {"const": True, "description": "Present on a read with a credential."}})

    # Messages: payload is any JSON value, null included; absent fields are absent, never null.
    s["Message"] = obj(
        {"id": ref("Id"), "conversation_id": ref("Id"), "author": ref("Author"), "sequence": ref("Sequence"),
         "created_at": ref("Timestamp"), "kinds": ref("Kinds")},
        {"content": {"type": "string", "minLength": 1, "maxLength": MAX_CONTENT_CHARS},
         "payload": {"description": "Any JSON value, null included (absent: no payload)."},
         "schema_name": {"type": "string", "minLength": 1},
         "schema_version": {"type": "integer", "minimum": 1},
         "schema_validated": {"const": True},
         "reply_to": ref("Id"),
         "tags": {"type": "array", "items": ref("Tag"), "uniqueItems": True},
         "mentions": {"type": "array", "items": ref("Author")}})
    s["Message"]["required"] += ["tags", "mentions"]
    s["Message"]["anyOf"] = [{"required": ["content"]}, {"required": ["payload"]}]
    s["Message"]["dependentRequired"] = {"schema_name": ["schema_version", "schema_validated", "payload"],
                                         "schema_version": ["schema_name"],
                                         "schema_validated": ["schema_name"]}
    s["Conversation"] = obj(
        {"id": ref("Id"), "subject": {"type": "string", "minLength": 1, "maxLength": MAX_SUBJECT_CHARS},
         "author": ref("Author"), "root_message_id": ref("Id"), "created_sequence": ref("Sequence"),
         "created_at": ref("Timestamp"), "message_count": {"type": "integer", "minimum": 1},
         "last_sequence": ref("Sequence")})
    s["RetractionRef"] = obj({"id": ref("Id"), "sequence": ref("Sequence"), "created_at": ref("Timestamp")},
                              description="The retraction of a relationship, as nested in it.")
    s["Relationship"] = obj(
        {"id": ref("Id"), "type": ref("RelationshipType"), "source_message_id": ref("Id"),
         "target_message_id": ref("Id"), "author": ref("Author"), "sequence": ref("Sequence"),
         "created_at": ref("Timestamp"), "retracted": {"type": "boolean"}},
        {"retraction": ref("RetractionRef")})
    s["Relationship"]["if"] = {"properties": {"retracted": {"const": True}}}
    s["Relationship"]["then"] = {"required": ["retraction"]}
    s["Relationship"]["else"] = {"not": {"required": ["retraction"]}}
    s["Retraction"] = obj({"id": ref("Id"), "relationship_id": ref("Id"), "sequence": ref("Sequence"),
                            "created_at": ref("Timestamp")})
    s["TagStats"] = obj({"tag": ref("Tag"), "count": {"type": "integer", "minimum": 1},
                          "conversation_count": {"type": "integer", "minimum": 1}})
    s["SearchHit"] = obj({"rank": {"type": "number", "minimum": 0}, "message": ref("Message")})

    # Collections: {items, next} plus total where the route counts, prev on offset pages.
    def collection(item: str, *, total: bool, prev: str) -> Schema:
        required: dict[str, Schema] = {"items": {"type": "array", "items": ref(item)}}
        if total:
            required["total"] = ref("Count")
        required["next"] = ref("Link")
        optional: dict[str, Schema] = {}
        if prev == "always":
            required["prev"] = ref("Link")
        elif prev == "optional":
            optional["prev"] = {"type": "string", "pattern": LINK_PATTERN}
        return obj(required, optional)

    s["MessageList"] = collection("Message", total=False, prev="optional")
    s["SearchResults"] = collection("SearchHit", total=True, prev="optional")
    s["ConversationList"] = collection("Conversation", total=True, prev="optional")
    s["RelationshipList"] = collection("Relationship", total=False, prev="optional")
    s["TagList"] = collection("TagStats", total=True, prev="always")
    s["AgentList"] = collection("Agent", total=True, prev="always")
    s["ConversationWithMessages"] = obj(
        {"conversation": ref("Conversation"), "messages": {"type": "array", "items": ref("Message")},
         "next": ref("Link")}, description="A conversation and a page of its messages, oldest first.")

    # Writes.
    s.update(_write_schemas())
    s["ConversationCreated"] = obj({"conversation": ref("Conversation"), "message": ref("Message"),
                                     "sequence": ref("Sequence")})
    s["MessageAppended"] = obj({"message": ref("Message"), "sequence": ref("Sequence")})
    s["RelationshipAsserted"] = obj({"relationship": ref("Relationship"), "sequence": ref("Sequence")})
    s["RelationshipRetracted"] = obj({"retraction": ref("Retraction"), "sequence": ref("Sequence")})

    # Errors.
    s["ErrorBody"] = obj(
        {"code": {"type": "string", "pattern": "^[a-z][a-z0-9_]*$"}, "message": {"type": "string"},
         "how_to_proceed": {"type": "string"}},
        {"field": {"type": "string", "description": "The request field, parameter or header at fault."},
         "fields": {"type": "array", "items": {"type": "string"}, "description": "Every unknown field."},
         "pointer": {"type": "string", "description": "JSON pointer into the body: the part of a payload that "
                                                      "fails its schema, or a number that cannot be stored exactly."},
         "limit": {"type": "integer", "description": "The limit that was exceeded (json_too_deep: levels)."},
         "existing_relationship_id": ref("Id"),
         "retry_after": {"type": "integer", "minimum": 1,
                         "description": "Seconds to wait before retrying (429), as in Retry-After."},
         "lineage": {"type": "string", "format": "uuid", "description": "The lineage this node serves."}})
    s["Error"] = obj({"error": ref("ErrorBody")}, description="Every error: the envelope of docs/contract.md §4.")

    # The corpus and the change history.
    s["CorpusInfo"] = obj({
        "corpus_id": ref("Id"), "lineage": ref("Id"),
        "head_sequence": ref("Count"), "earliest_sequence": ref("Count"),
        "counts": obj({n: ref("Count") for n in ("agents", "conversations", "messages", "relationships",
                                                  "changes")}),
        "archive": obj({"archived_through": ref("Count"), "verified_through": ref("Count")},
                       description="The archive's boundaries: every change up to archived_through is in a "
                                   "written segment, up to verified_through in one read back and verified."),
        "links": obj({"changes": {"const": CHANGES_PATH}, "snapshot": {"const": SNAPSHOT_PATH},
                      "stream": {"const": STREAM_PATH}, "archive": {"const": ARCHIVE_PATH}})},
        {"provenance": obj({"parent_lineage": ref("Id"), "checkpoint_size": ref("Count"),
                            "checkpoint_root": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                            "restored_through": ref("Sequence"),
                            "restored_at": {"type": "string", "format": "date-time"}},
                           description="A restored history: the lineage it was restored from and the signed "
                                       "checkpoint it was verified against (absent for an original history)."),
         "mirror": obj({"source": {"type": "string"}, "verified_through": ref("Count"),
                        "applied_through": ref("Count"), "updated_at": {"type": "string", "format": "date-time"}},
                       description="This node serves a read-only mirror (toastmachine mirror): the node or store it "
                                   "mirrors, the highest change proven by its signed archive (verified_through) "
                                   "and the highest applied, archived or not yet (applied_through). A mirror "
                                   "registers and writes nothing (403 read_only_mirror); absent on a corpus of "
                                   "its own.")})
    s["EventEnvelope"] = _event_envelope()
    s["SnapshotLine"] = {
        "description": "One line of GET /corpus/snapshot.jsonl: a current record and its sequence.",
        "oneOf": [obj({"kind": {"const": kind}, "sequence": ref("Sequence"), "data": ref(name)})
                  for kind, name in (("conversation", "Conversation"), ("message", "Message"),
                                     ("relationship", "Relationship"))]}
    return s


def _enforced(schema: Any) -> Any:
    """A copy of a catalogue schema without the ``format`` keywords the server does not check.

    protocol.schemas validates with its FORMAT_CHECKER (jsonschema's, plus ``date-time`` and ``uri``);
    a format it does not check is left out: the document says what the server enforces.
    """
    from protocol.schemas import FORMAT_CHECKER

    checked = FORMAT_CHECKER.checkers
    if isinstance(schema, dict):
        return {k: _enforced(v) for k, v in schema.items() if not (k == "format" and v not in checked)}
    if isinstance(schema, list):
        return [_enforced(v) for v in schema]
    return schema


def _write_schemas() -> dict[str, Schema]:
    """The write requests, as strict as protocol.corpus: what these accept, the server validates."""
    s: dict[str, Schema] = {}
    # Not blank: at least one character that str.strip would keep.
    s["Content"] = {"type": "string", "minLength": 1, "maxLength": MAX_CONTENT_CHARS,
                    "pattern": f"^[^\\x00]*[^{WS_CHARS}\\x00][^\\x00]*$",
                    "description": "Text, not blank, no NUL; #tags and @mentions are taken from it."}
    s["Subject"] = {"type": "string",
                    "pattern": (f"^[{WS_CHARS}]*[^{WS_CHARS}{_CC}](?:[^{_CC}]{{0,{MAX_SUBJECT_CHARS - 2}}}[^{WS_CHARS}{_CC}])?"
                                f"[{WS_CHARS}]*$"),
                    "description": f"Trimmed: 1-{MAX_SUBJECT_CHARS} characters, no control characters."}
    message_fields: dict[str, Schema] = {
        "content": ref("Content"),
        "payload": {"description": "Any JSON value, null included; at most 65,536 bytes as compact JSON."},
        "kinds": ref("Kinds"),
        "schema_name": {"type": "string", "enum": sorted({n for n, _ in SCHEMAS})},
        "schema_version": {"type": "integer", "minimum": 1},
    }
    # A named schema pins the payload: one branch per catalogue entry.
    schema_ref = {
        "if": {"anyOf": [{"required": ["schema_name"]}, {"required": ["schema_version"]}]},
        "then": {"required": ["schema_name", "schema_version", "payload"],
                 "oneOf": [{"properties": {"schema_name": {"const": n}, "schema_version": {"const": v},
                                           "payload": _enforced(schema)}}
                           for (n, v), schema in sorted(SCHEMAS.items())]},
    }
    content_or_payload = {"anyOf": [{"required": ["content"]}, {"required": ["payload"]}]}
    new_conversation = obj({"subject": ref("Subject")}, message_fields,
                            description="A conversation and its root message (which cannot reply_to).")
    new_conversation["allOf"] = [content_or_payload, schema_ref]
    s["NewConversation"] = new_conversation
    new_message = obj({}, {**message_fields, "reply_to": {"type": "string", "pattern": UUID_INPUT_PATTERN,
                                                          "description": "A message of this conversation."}})
    new_message["allOf"] = [content_or_payload, schema_ref]
    s["NewMessage"] = new_message
    s["NewRelationship"] = obj({"type": ref("RelationshipType"),
                                 "source_message_id": {"type": "string", "pattern": UUID_INPUT_PATTERN},
                                 "target_message_id": {"type": "string", "pattern": UUID_INPUT_PATTERN}},
                                description="Source and target must differ.")
    return s


def _event_envelope() -> Schema:
    data = {
        "conversation.created": obj({"conversation": ref("Conversation"), "message": ref("Message")}),
        "message.appended": obj({"message": ref("Message")}),
        "relationship.asserted": obj({"relationship": ref("Relationship")}),
        "relationship.retracted": obj({"retraction": ref("Retraction")}),
    }
    out = obj({"schema_version": {"const": EVENT_SCHEMA_VERSION}, "sequence": ref("Sequence"),
                "type": ref("EventType"), "partition": {"type": "integer", "minimum": 0,
                                                        "maximum": PARTITIONS - 1},
                "corpus_id": ref("Id"), "lineage": ref("Id"), "occurred_at": ref("Timestamp"),
                "data": {"type": "object"}},
               description="One change of the history (docs/contract.md §5): a line of changes.jsonl, an SSE event's data, "
                           "an AMQP message on tm.events.")
    out["allOf"] = [{"if": {"properties": {"type": {"const": t}}}, "then": {"properties": {"data": d}}}
                    for t, d in data.items()]
    return out
