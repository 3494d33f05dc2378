"""The named-schema catalogue: JSON Schemas that a message payload can claim to follow.

A message that sends ``schema_name`` + ``schema_version`` has its payload validated against the
entry here; stored messages then carry ``schema_validated: true``. Entries are versioned and never
change once published: a new shape is a new version. The catalogue is compiled once
(:func:`catalogue`) and shared by the ingress and the writer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import best_match

_ID = {"type": "string", "minLength": 1, "maxLength": 200}
_TEXT = {"type": "string", "minLength": 1, "maxLength": 10_000}
_CONFIDENCE = {"type": "number", "minimum": 0, "maximum": 1}
_REFERENCES = {
    "type": "array", "maxItems": 50,
    "items": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 500},
                       "url": {"type": "string", "format": "uri", "maxLength": 2000}},
        "required": ["url"], "additionalProperties": False,
    },
}

#: (name, version) → JSON Schema (draft 2020-12). Add entries; never edit a published one.
SCHEMAS: dict[tuple[str, int], dict[str, Any]] = {
    ("claim", 1): {
        "title": "A statement put forward as true, with how sure its author is and why.",
        "type": "object",
        "properties": {
            "statement": _TEXT,
            "confidence": _CONFIDENCE,
            "evidence": {"type": "array", "items": _TEXT, "maxItems": 50},
            "references": _REFERENCES,
        },
        "required": ["statement"],
        "additionalProperties": False,
    },
    ("verification", 1): {
        "title": "The outcome of checking a claim.",
        "type": "object",
        "properties": {
            "claim_message_id": {"type": "string", "format": "uuid"},
            "verdict": {"enum": ["confirmed", "refuted", "inconclusive"]},
            "method": _TEXT,
            "confidence": _CONFIDENCE,
            "notes": _TEXT,
        },
        "required": ["verdict", "method"],
        "additionalProperties": False,
    },
    ("status-update", 1): {
        "title": "Progress on a piece of work.",
        "type": "object",
        "properties": {
            "task": _ID,
            "state": {"enum": ["planned", "in-progress", "blocked", "done", "abandoned"]},
            "progress": {"type": "number", "minimum": 0, "maximum": 1},
            "summary": _TEXT,
            "blockers": {"type": "array", "items": _TEXT, "maxItems": 20},
        },
        "required": ["task", "state"],
        "additionalProperties": False,
    },
    ("proposal", 1): {
        "title": "A suggested course of action, open for support or contradiction.",
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 200},
            "rationale": _TEXT,
            "options": {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 20},
            "decision_by": {"type": "string", "format": "date-time"},
        },
        "required": ["title", "rationale"],
        "additionalProperties": False,
    },
}


@dataclass(frozen=True, slots=True)
class SchemaViolation:
    """Why a payload does not follow its schema: where (a JSON pointer) and what."""

    pointer: str
    message: str


#: RFC 3339 date-time, as JSON Schema's ``date-time`` means it: date, ``T``, time, offset or ``Z``.
_RFC3339 = re.compile(
    r"^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt]([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?"
    r"([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)$")
#: An absolute URI: a scheme, then no whitespace or control characters (RFC 3986's outline).
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s\x00-\x1f\x7f]+$")

#: jsonschema's own format checks plus ``date-time`` and ``uri``, which it only checks when optional
#: packages are installed: a payload that claims ``schema_validated`` must really have been checked.
FORMAT_CHECKER = FormatChecker()


@FORMAT_CHECKER.checks("date-time")
def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True  # formats only constrain strings; "type" checks the rest
    if not _RFC3339.match(value):
        return False
    try:  # the regex bounds each field; this rejects impossible dates such as February 30
        datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00").replace("t", "T")
                               .replace(":60", ":59"))
    except ValueError:
        return False
    return True


@FORMAT_CHECKER.checks("uri")
def _is_uri(value: object) -> bool:
    return not isinstance(value, str) or bool(_URI.match(value))


class Catalogue:
    """Compiled validators for every entry of :data:`SCHEMAS`."""

    def __init__(self, schemas: Mapping[tuple[str, int], dict[str, Any]]) -> None:
        self._validators: dict[tuple[str, int], Draft202012Validator] = {}
        for key, schema in schemas.items():
            Draft202012Validator.check_schema(schema)  # a broken entry fails at start, not per request
            self._validators[key] = Draft202012Validator(
                schema, format_checker=FORMAT_CHECKER)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._validators

    def names(self) -> list[tuple[str, int]]:
        """Every (name, version) in the catalogue, sorted."""
        return sorted(self._validators)

    def violation(self, name: str, version: int, payload: Any) -> SchemaViolation | None:
        """The most relevant violation of ``payload`` against schema (name, version), or None."""
        error = best_match(self._validators[(name, version)].iter_errors(payload))
        if error is None:
            return None
        pointer = "".join(f"/{part}" for part in error.absolute_path) or "/"
        return SchemaViolation(pointer=pointer, message=error.message[:300])


@functools.cache
def catalogue() -> Catalogue:
    """The process-wide compiled catalogue (compiled on first use, once)."""
    return Catalogue(SCHEMAS)
