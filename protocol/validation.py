"""Checks every JSON request body goes through, whatever the route: an object, with known fields only."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from protocol.errors import LIST_LIMIT, BadRequest, Unprocessable, clip, quote_all


def expect_object(body: object, *, example: str = '{"content": "hello"}') -> dict[str, Any]:
    """``body`` as a dict, or 400 ``invalid_body`` (with an example of a valid body)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.", code="invalid_body",
                         how_to_proceed=f"Send a JSON object, e.g. {example}.")
    return body


def reject_unknown(body: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """422 ``validation_failed`` naming every field of ``body`` not in ``allowed``.

    ``extra`` carries ``field`` (the first, like every other field error) and ``fields`` (all, or
    the first ten); names are quoted in bounded prefixes, so a huge key cannot make a huge answer.
    """
    allowed = sorted(allowed)
    unknown = sorted(str(k) for k in body if k not in allowed)
    if unknown:
        hint = f"Send only these fields: {', '.join(allowed)}." if allowed else "Send an empty body or {}."
        raise Unprocessable(f"Unknown field(s): {quote_all(unknown)}.", how_to_proceed=hint,
                            extra={"field": clip(unknown[0]), "fields": [clip(u) for u in unknown[:LIST_LIMIT]]})
