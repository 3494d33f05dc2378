"""Strict query-string parsing for the read routes (SPEC §3 "Paging rules").

Every read route declares the parameters it accepts; anything else is a 400 naming the parameter.
Values are strings on the wire and are checked here, so a handler only ever sees typed values:
sequences are non-negative integers, limits are 1..1000, kinds are known kinds in canonical order.
A repeated parameter is a 400 too (``after=1&after=2`` is ambiguous, and guessing would lose or
repeat data), except where a route's contract says the first occurrence wins (``GET /tags``).

Every error is :class:`~protocol.errors.BadRequest` with code ``invalid_parameter`` and ``field``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from protocol.corpus import KINDS
from protocol.errors import BadRequest, clip, quote

#: Page sizes of SPEC §3: default 100, at most 1,000.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
#: Deepest offset a page may start at: deeper pages should follow a cursor instead.
MAX_OFFSET = 100_000
#: Sequences and offsets: decimal digits only (no sign, no spaces), within JavaScript's safe range.
MAX_SAFE_INTEGER = 2**53 - 1
_DIGITS = re.compile(r"[0-9]{1,16}")
_NAME = re.compile(r"[A-Za-z0-9_-]{3,32}")


def invalid(field: str, message: str, how_to_proceed: str) -> BadRequest:
    """The 400 of a bad query parameter ``field``."""
    return BadRequest(message, code="invalid_parameter", extra={"field": field}, how_to_proceed=how_to_proceed)


def check_within_head(field: str, after: int, head: int) -> None:
    """400 when a follower's position ``after`` is past the ``head`` of this history: it is not a
    position in it (another history's, or computed), and following from there would wait for ever
    without a word. Every follow surface (the stream, the export, the MCP tool) answers it alike."""
    if after > head:
        raise invalid(field, f"{field} {after} is beyond the head of this history ({head}).",
                      "Resume from the sequence of the last change you received from this corpus "
                      "(never more than the head, see GET /corpus); to start again, omit after (the stream "
                      "then starts at the head, the export at the beginning) or load a snapshot.")


class Query:
    """The query string of one request, read against the parameters a route accepts.

    ``Query(request.query, ("limit", "offset"))`` raises at once for an unknown parameter; the
    accessors then parse one parameter each (None when it is absent).
    """

    def __init__(self, params: Mapping[str, str], accepted: Iterable[str], *, first_wins: bool = False) -> None:
        self.accepted = tuple(accepted)
        self._params = params
        for name in params:
            if name not in self.accepted:
                listed = ", ".join(self.accepted) if self.accepted else "none"
                raise invalid(clip(name), f"Unknown query parameter {quote(name)}.",
                              f"Query parameters accepted here: {listed}.")
            if not first_wins and _count(params, name) > 1:
                raise invalid(name, f"Query parameter {name!r} is given more than once.", f"Send {name!r} once.")

    def has(self, name: str) -> bool:
        """Whether ``name`` was sent (even empty)."""
        return name in self._params

    def raw(self, name: str) -> str | None:
        """The first value of ``name`` as sent, or None."""
        return self._params.get(name)

    def integer(self, name: str, *, low: int = 0, high: int = MAX_SAFE_INTEGER,
                how_to_proceed: str | None = None) -> int | None:
        """A decimal integer in ``low..high``."""
        raw = self._params.get(name)
        if raw is None:
            return None
        value = int(raw) if _DIGITS.fullmatch(raw) else None
        if value is None or not low <= value <= high:
            raise invalid(name, f"{name!r} must be an integer from {low} to {high}.",
                          how_to_proceed or f"Send {name} as a decimal integer from {low} to {high}.")
        return value

    def sequence(self, name: str) -> int | None:
        """An exclusive sequence position (a non-negative integer)."""
        return self.integer(name, how_to_proceed=f"Send {name} as a sequence number taken from the corpus "
                                                 "(a non-negative integer), e.g. the X-Next-Cursor of a page.")

    def limit(self) -> int:
        """The page size: 1..:data:`MAX_LIMIT`, default :data:`DEFAULT_LIMIT`."""
        value = self.integer("limit", low=1, high=MAX_LIMIT,
                             how_to_proceed=f"Send a limit from 1 to {MAX_LIMIT} (default {DEFAULT_LIMIT}).")
        return DEFAULT_LIMIT if value is None else value

    def offset(self) -> int | None:
        """How many items to skip: 0..:data:`MAX_OFFSET`."""
        return self.integer("offset", high=MAX_OFFSET,
                            how_to_proceed=f"Send an offset from 0 to {MAX_OFFSET}; to go deeper, follow "
                                           "the page's next link (a sequence cursor).")

    def uuid(self, name: str) -> str | None:
        """An identifier (a UUID, any case, with or without hyphens), returned in canonical form."""
        raw = self._params.get(name)
        if raw is None:
            return None
        try:
            return str(uuid.UUID(raw))
        except ValueError:
            raise invalid(name, f"{name!r} must be an identifier (a UUID).",
                          f"Send {name} as the id of a corpus record, e.g. "
                          "3f2b8c1e-6d4a-4f5e-9a7b-2c1d0e9f8a7b.") from None

    def agent_name(self, name: str) -> str | None:
        """An agent name (3-32 letters, digits, ``_`` or ``-``); compared case-insensitively later."""
        raw = self._params.get(name)
        if raw is None:
            return None
        if not _NAME.fullmatch(raw):
            raise invalid(name, f"{name!r} must be an agent name: 3-32 ASCII letters, digits, '_' or '-'.",
                          f"Send {name} as an agent's name, e.g. {name}=alice (case does not matter).")
        return raw

    def choice(self, name: str, choices: tuple[str, ...]) -> str | None:
        """One of ``choices``, exactly as written."""
        raw = self._params.get(name)
        if raw is None:
            return None
        if raw not in choices:
            raise invalid(name, f"{name!r} must be one of: {', '.join(choices)}.",
                          f"Send {name}={choices[0]} (or another of: {', '.join(choices)}).")
        return raw

    def boolean(self, name: str) -> bool | None:
        """``true`` or ``false``."""
        raw = self.choice(name, ("true", "false"))
        return None if raw is None else raw == "true"

    def text(self, name: str, *, max_length: int, strip: bool = False) -> str | None:
        """Free text of 1..``max_length`` characters, no control characters."""
        raw = self._params.get(name)
        if raw is None:
            return None
        value = raw.strip() if strip else raw
        if not value or len(value) > max_length or any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise invalid(name, f"{name!r} must be 1 to {max_length} characters without control characters.",
                          f"Send a non-empty {name} of at most {max_length} characters.")
        return value

    def members(self, name: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...] | None:
        """A comma-separated, non-empty set of distinct values from ``allowed``, in ``allowed``'s
        order ("any of"); an empty, unknown or repeated value is a 400 naming the parameter."""
        raw = self._params.get(name)
        if raw is None:
            return None
        parts = raw.split(",")
        unknown = [p for p in parts if p not in allowed]
        if not raw or unknown or len(set(parts)) != len(parts):
            problem = (f"unknown {what} {quote(unknown[0])}" if unknown and unknown[0]
                       else f"an empty {what}" if unknown or not raw else f"a repeated {what}")
            raise invalid(name, f"{name!r} has {problem}.",
                          f"Send one or more distinct {what}s separated by commas, from: {', '.join(allowed)}.")
        return tuple(v for v in allowed if v in parts)

    def kinds(self, name: str = "kinds") -> tuple[str, ...] | None:
        """A comma-separated, non-empty set of distinct known kinds, in canonical order ("any of")."""
        return self.members(name, KINDS, "kind")


def path_uuid(raw: str, name: str = "id") -> str:
    """The ``{id}`` of a route's path in canonical form, or the same 400 ``invalid_parameter``
    naming ``name`` that a query parameter gets: read and write routes answer a malformed id alike
    (a well-formed id that names no record is their 404)."""
    return Query({name: raw}, (name,)).uuid(name) or ""


def _count(params: Mapping[str, str], name: str) -> int:
    getall = getattr(params, "getall", None)  # a MultiDict (aiohttp's request.query) can repeat keys
    return len(getall(name)) if getall is not None else 1


def page_query(values: Mapping[str, Any]) -> dict[str, str]:
    """Query parameters for a link: None dropped, everything else as the string a client sends."""
    out: dict[str, str] = {}
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            out[name] = "true" if value else "false"
        elif isinstance(value, tuple | list):
            out[name] = ",".join(str(v) for v in value)
        else:
            out[name] = str(value)
    return out
