"""Checks every JSON request body goes through, whatever the route.

- :func:`decode_json_body`: the one place request bytes become a JSON value. Beyond the JSON
  grammar it enforces two rules, so that what is stored is exactly what was sent:

  * **Nesting**: at most :data:`MAX_JSON_DEPTH` levels of arrays and objects, the body itself
    counting as one. The same limit is checked again by the corpus writer
    (:func:`check_depth`), so no path accepts deeper JSON. (Without it the limit was whatever each
    library's recursion guard happened to be: 255 levels to encode, 1,024 to decode.)
  * **Exact numbers**: a number must survive the round trip to its stored form unchanged in value.
    Integers are kept exactly from -2**63 to 2**64-1; any other number is stored as the shortest
    decimal that reads back as the same IEEE 754 double (so ``1E2`` is stored and returned as
    ``100.0`` and ``1.50`` as ``1.5``). A number that form would change in value (an integer beyond
    64 bits, ``1e-400`` underflowing to 0, ``1e400`` overflowing, more significant digits than a
    double holds) is refused with 422 ``number_not_exact`` naming its JSON Pointer, never rounded.
  * **Unique keys**: an object naming one key twice (``{"a": 1, "a": 2}``, or ``"a"`` and
    ``"\u0061"``) is refused with 422 ``duplicate_key`` naming its JSON Pointer: a JSON library
    keeps one of the two values (orjson the last, others the first), so storing either would
    silently drop what the client sent (RFC 8259 leaves such objects' meaning undefined).

- :func:`expect_object` and :func:`reject_unknown`: an object, with known fields only.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from decimal import Decimal
from typing import Any

import orjson

from protocol.errors import LIST_LIMIT, BadRequest, Unprocessable, clip, quote_all

#: Most levels of arrays and objects in a request body (``{}`` is one level, ``{"payload": []}`` two).
MAX_JSON_DEPTH = 64
#: Integers in this range are stored exactly (orjson's 64-bit integer range).
MIN_EXACT_INT = -(2**63)
MAX_EXACT_INT = 2**64 - 1
#: How much of a client's number or key an error message repeats.
_ECHO_CHARS = 40

#: A JSON string token (the "unrolled loop" form: several times faster than one alternation per character).
_STRING_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def _invalid_json() -> BadRequest:
    return BadRequest("The request body is not valid JSON.", code="invalid_json",
                      how_to_proceed="Send a JSON object encoded as UTF-8.")


def _too_deep(field: str | None) -> Unprocessable:
    extra: dict[str, Any] = {"limit": MAX_JSON_DEPTH}
    if field is not None:
        extra["field"] = field
    return Unprocessable(
        f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep "
        f"(the body itself is the first level).", code="json_too_deep", extra=extra,
        how_to_proceed=f"Flatten the data to at most {MAX_JSON_DEPTH} levels and send it again.")


def decode_json_body(raw: bytes, *, within: str = "") -> object:
    """``raw`` as a JSON value: 400 ``invalid_json`` if it is not JSON, 422 ``json_too_deep`` over
    :data:`MAX_JSON_DEPTH` levels, 422 ``number_not_exact`` for a number that cannot be stored
    exactly, 422 ``duplicate_key`` for a key named twice in one object.

    ``within``: a JSON Pointer the client's own data sits under (an MCP call's
    ``/params/arguments``); the pointers of errors inside it are given relative to it.
    """
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # orjson refuses two things the JSON grammar allows: more than 1,024 levels, and numbers
        # beyond a double's range. Say which rule was broken rather than "not valid JSON".
        if _bracket_depth(raw) > MAX_JSON_DEPTH:
            raise _too_deep(None) from None
        _refuse_inexact_numbers(raw, within)
        raise _invalid_json() from None
    depth, field, has_float, keys = _shape(value)
    if depth > MAX_JSON_DEPTH:
        raise _too_deep(field)
    repeated = _repeated_key(raw, keys)
    if repeated is not None:
        raise duplicate_key(_relative(repeated, within))
    if has_float:
        # Only a body with a non-integer (as orjson read it) can hold a number orjson changed: an
        # integer beyond 64 bits and an underflow both come back as floats. Read it again exactly.
        _refuse_inexact_numbers(raw, within)
    return value


def check_depth(value: object) -> None:
    """422 ``json_too_deep`` if ``value`` nests more than :data:`MAX_JSON_DEPTH` levels."""
    depth, field, _, _ = _shape(value)
    if depth > MAX_JSON_DEPTH:
        raise _too_deep(field)


def _shape(value: object) -> tuple[int, str | None, bool, int]:
    """(levels of nesting, the top-level field holding the deepest point, whether a float occurs,
    how many keys its objects hold in all).

    Iterative, so that no nesting depth can exhaust the Python stack. The walk stops going deeper
    past the limit: its answer is then "too deep", however much deeper it goes.
    """
    deepest, deepest_field, has_float, keys = 0, None, False, 0
    stack: list[tuple[object, int, str | None]] = [(value, 1, None)]
    while stack:
        item, level, field = stack.pop()
        if isinstance(item, float):
            has_float = True
        elif isinstance(item, (dict, list)):
            if level > deepest:
                deepest, deepest_field = level, field
            if level > MAX_JSON_DEPTH:
                continue
            if isinstance(item, dict):
                keys += len(item)
                for key, child in item.items():
                    stack.append((child, level + 1, key if level == 1 else field))
            else:
                for child in item:
                    stack.append((child, level + 1, field))
    return deepest, deepest_field, has_float, keys


class _Object(dict[str, Any]):
    """A decoded object that remembers the first key its text named twice."""

    repeated: str | None = None


def _pairs(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    for key, child in pairs:
        if key in obj and obj.repeated is None:
            obj.repeated = key
        obj[key] = child
    return obj


def _pointer_step(key: str) -> str:
    return "/" + key.replace("~", "~0").replace("/", "~1")


def _first_repeat(value: object, pointer: str) -> str | None:
    """The JSON Pointer of the first repeated key in ``value`` (document order), or None."""
    if isinstance(value, _Object):
        if value.repeated is not None:
            return pointer + _pointer_step(value.repeated)
        children: Iterable[tuple[str, object]] = ((_pointer_step(k), v) for k, v in value.items())
    elif isinstance(value, list):
        children = ((f"/{i}", v) for i, v in enumerate(value))
    else:
        return None
    for step, child in children:
        found = _first_repeat(child, pointer + step)
        if found is not None:
            return found
    return None


def _repeated_key(raw: bytes, keys: int) -> str | None:
    # Every key in the text is followed by a colon, so a text with no more colons than keys decoded
    # has no key twice (nearly every body: one memchr-speed count); only one with more (a colon in
    # a string, or a repeated key) is decoded again, keeping every key.
    if raw.count(b":") <= keys or _STRING_RE.sub(b"", raw).count(b":") <= keys:
        return None
    try:
        decoded = json.loads(raw, object_pairs_hook=_pairs)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None  # read differently by the two parsers: orjson's reading stands
    return _first_repeat(decoded, "")


def duplicate_key(pointer: str) -> Unprocessable:
    """422 ``duplicate_key`` at ``pointer``: a key named twice in one object."""
    shown = pointer[:200]
    extra: dict[str, Any] = {"pointer": shown, "field": pointer.split("/")[1][:_ECHO_CHARS]}
    return Unprocessable(
        f"The key at {shown} appears twice in the same object; only one of the two values could be kept.",
        code="duplicate_key", extra=extra,
        how_to_proceed="Send each key once per object (merge the values, or use an array).")


def _bracket_depth(raw: bytes) -> int:
    """Deepest nesting of ``[``/``{`` outside strings; only used on bodies orjson refused."""
    structure = _STRING_RE.sub(b"", raw)
    depth = deepest = 0
    for byte in structure.translate(None, delete=bytes(set(range(256)) - set(b"[]{}"))):
        depth += 1 if byte in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


class _Literal(str):
    """A non-integer number exactly as written in the request."""


class _IntLiteral(str):
    """An integer exactly as written (kept as text: Python refuses to convert very long ones)."""


def _relative(pointer: str, within: str) -> str:
    """``pointer`` relative to ``within`` when it is inside it (else as it is)."""
    return pointer[len(within):] if within and pointer.startswith(within + "/") else pointer


def _refuse_inexact_numbers(raw: bytes, within: str = "") -> None:
    """422 ``number_not_exact`` at the first number (in document order) its stored form would change."""

    def reject_constant(name: str) -> None:
        raise ValueError(name)  # NaN / Infinity are not JSON

    try:
        exact = json.loads(raw, parse_float=_Literal, parse_int=_IntLiteral, parse_constant=reject_constant)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return  # not JSON after all: the caller's invalid_json stands
    for pointer, number in _numbers(exact, ""):
        reason = _inexact(number)
        if reason is not None:
            pointer = _relative(pointer, within)
            field = pointer.split("/")[1] if pointer else None
            shown = str(number)
            if len(shown) > _ECHO_CHARS:
                shown = shown[:_ECHO_CHARS] + "…"
            extra: dict[str, Any] = {"pointer": pointer[:200]}
            if field:
                extra["field"] = field[:_ECHO_CHARS]
            raise Unprocessable(
                f"The number {shown} at {pointer[:200] or '/'} cannot be stored exactly: {reason}.",
                code="number_not_exact", extra=extra,
                how_to_proceed="Send the number as a JSON string to keep every digit, or round it to "
                               "what a 64-bit integer or an IEEE 754 double holds.")


def _numbers(value: object, pointer: str) -> Iterator[tuple[str, _IntLiteral | _Literal]]:
    """Every number in ``value`` (depth already bounded by the caller) with its JSON Pointer."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _numbers(child, pointer + _pointer_step(key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _numbers(child, f"{pointer}/{i}")
    elif isinstance(value, (_Literal, _IntLiteral)):
        yield pointer, value


def _inexact(number: _IntLiteral | _Literal) -> str | None:
    """Why ``number`` would not be stored as the same value, or None if it would."""
    if isinstance(number, _IntLiteral):
        # 2**64 has 20 digits: anything longer is out of range without converting it.
        if len(number.lstrip("-")) <= 20 and MIN_EXACT_INT <= int(number) <= MAX_EXACT_INT:
            return None
        return "integers are stored exactly only from -2**63 to 2**64-1"
    stored = float(number)
    if not math.isfinite(stored):
        return "it is beyond the range of a 64-bit floating-point number"
    if Decimal(str(number)) != Decimal(repr(stored)):
        return (f"as a 64-bit floating-point number it would become {repr(stored)[:_ECHO_CHARS]}")
    return None


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
