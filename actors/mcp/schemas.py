"""The output schemas of the MCP tools, built from the HTTP API's own component schemas.

One contract serves both fronts: every record (Message, Conversation, Relationship, Agent...) is the
component schema that ``/openapi.json`` publishes, copied into the tool's schema under ``$defs``.
What differs is paging: a tool cannot follow a link, so where a route answers ``next``/``prev``
links, a tool answers ``next``: the arguments to call it again with (``{"after": n}``,
``{"before": n}`` or ``{"offset": n}``), or null on the last page. Budgeted reads add ``complete``
and ``retrieval_size``.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from actors.reads.schemas import (
    UUID_INPUT_PATTERN,  # noqa: F401 - the tools' id arguments accept the same
    representation_schemas,  # the one source of the record schemas
)

Schema = dict[str, Any]

_REF_PREFIX = "#/components/schemas/"


def _ref(name: str) -> Schema:
    return {"$ref": f"#/$defs/{name}"}


@functools.cache
def _components() -> dict[str, Schema]:
    """The HTTP components, with references rewritten to ``#/$defs/``, plus the MCP-only pieces."""
    text = json.dumps(representation_schemas()).replace(_REF_PREFIX, "#/$defs/")
    defs: dict[str, Schema] = json.loads(text)
    cursor = {"type": "integer", "minimum": 0}
    defs["Next"] = {
        "description": "The arguments to call this tool again with for the next page (merged into the same "
                       "arguments), or null when there is nothing more.",
        "oneOf": [{"type": "null"},
                  {"type": "object", "properties": {"after": cursor, "before": cursor, "offset": cursor},
                   "minProperties": 1, "maxProperties": 1, "additionalProperties": False}]}
    defs["RetrievalSize"] = {
        "type": "object",
        "properties": {"serialized_bytes": {"type": "integer", "minimum": 0},
                       "estimated_tokens": {"type": "integer", "minimum": 0},
                       "estimation_method": {"type": "string"}},
        "required": ["serialized_bytes", "estimated_tokens", "estimation_method"], "additionalProperties": False}
    return defs


def _inline(schema: Any, defs: dict[str, Schema]) -> Any:
    """``schema`` with every ``$ref`` replaced by the definition (none of ours is recursive)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return {**_inline(defs[ref.removeprefix("#/$defs/")], defs), **_inline(rest, defs)}
        return {key: _inline(value, defs) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_inline(value, defs) for value in schema]
    return schema


def _closed(body: Schema) -> Schema:
    """``body`` (an object schema) self-contained: references inlined, because the SDK publishes a
    tool's output schema through pydantic, which resolves only its own ``$defs``."""
    return copy.deepcopy(_inline(body, _components()))


def _obj(required: dict[str, Schema], optional: dict[str, Schema] | None = None) -> Schema:
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required),
            "additionalProperties": False}


def record(name: str) -> Schema:
    """The schema of one HTTP component (e.g. ``MessageAppended``) as a tool's output schema."""
    return _closed({"$ref": f"#/$defs/{name}", "type": "object"})


def listing(item: str, *, total: bool, budgeted: bool = False) -> Schema:
    """``{items, next}`` (+ ``total`` where the route counts, + ``complete``/``retrieval_size`` when
    the tool keeps to a byte budget)."""
    required: Schema = {"items": {"type": "array", "items": _ref(item)}}
    if total:
        required["total"] = _ref("Count")
    required["next"] = _ref("Next")
    if budgeted:
        required["complete"] = {"type": "boolean"}
        required["retrieval_size"] = _ref("RetrievalSize")
    return _closed(_obj(required))


def pulled_conversation() -> Schema:
    """``pull_conversation``: the conversation and a budgeted run of its messages, oldest first."""
    return _closed(_obj({"conversation": _ref("Conversation"), "messages": {"type": "array",
                                                                            "items": _ref("Message")},
                         "next": _ref("Next"), "complete": {"type": "boolean"},
                         "retrieval_size": _ref("RetrievalSize")}))


def conversation_page() -> Schema:
    """``get_conversation``: the conversation and one page of its messages, as the route answers."""
    return _closed(_obj({"conversation": _ref("Conversation"), "messages": {"type": "array",
                                                                            "items": _ref("Message")},
                         "next": _ref("Next")}))


def changes() -> Schema:
    """``get_changes``: a page of the change history's envelopes, in sequence order."""
    return _closed(_obj({"items": {"type": "array", "items": _ref("EventEnvelope")}, "next": _ref("Next"),
                         "head_sequence": _ref("Count"), "earliest_sequence": _ref("Count")}))


def whoami() -> Schema:
    """``whoami``: ``{agent}``, the caller's agent as ``GET /me`` shows it."""
    return _closed(_obj({"agent": _ref("Me")}))


def operation_token() -> Schema:
    """``get_operation_token``: ``{operation_token}``, a fresh UUID."""
    return _closed(_obj({"operation_token": {"type": "string", "format": "uuid",
                                             "pattern": _components()["Id"]["pattern"]}}))


def error() -> Schema:
    """The ``structuredContent`` of every error result (not an output schema: error results are not
    validated against one; published here for the tests and the docs). Besides the fixed fields, an
    error carries the HTTP envelope's extras (``field``, ``retry_after``, ``scope``...)."""
    inner = _obj({"category": {"type": "string", "pattern": "^[a-z_]+$"}, "message": {"type": "string"},
                  "retryable": {"type": "boolean"}, "outcome": {"enum": ["not_applied", "unknown"]},
                  "recovery_action": {"type": "string"}},
                 {"http_status": {"type": "integer", "minimum": 400, "maximum": 599},
                  "upstream_code": {"type": "string", "pattern": "^[a-z][a-z0-9_]*$"}})
    inner["additionalProperties"] = True
    return _obj({"error": inner})
