"""Byte budgets for the reads that can return a lot (pull_conversation, get_messages, search).

An AI client pays for every token a tool returns, and some refuse results over ~25k tokens. A
budgeted read keeps whole items, in order, while their compact JSON fits ``max_bytes``; it then says
``complete: false`` and gives the cursor of the last item it kept, so the caller continues exactly
there. An item is never cut: when the first item alone is larger than the budget it is still
returned whole (one item per call is progress; a cut message would be silent truncation), and the
``retrieval_size`` says how large the answer really is.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

#: Default and largest budgets: 40,000 bytes is about 10k tokens, well under the 25k some clients cap at.
DEFAULT_MAX_BYTES = 40_000
MAX_MAX_BYTES = 200_000
MIN_MAX_BYTES = 1_000
#: Bytes kept free for the fields around the items (next, complete, total, retrieval_size...), so
#: that the whole answer, not just its items, stays within the budget.
ENVELOPE_RESERVE = 400
#: How ``estimated_tokens`` is derived: compact UTF-8 JSON bytes / 4, rounded up (a common rule of thumb).
ESTIMATION_METHOD = "utf8_json_bytes_div_4"


def fit(items: list[Any], max_bytes: int) -> tuple[int, orjson.Fragment]:
    """How many leading ``items`` fit in ``max_bytes`` of compact JSON (at least one when there is one),
    and the JSON array of those items, serialized once here to measure them and sent as it is."""
    encoded: list[bytes] = []
    used = 2  # the enclosing [ ]
    for count, item in enumerate(items):
        data = orjson.dumps(item)
        used += len(data) + (1 if count else 0)
        if used > max_bytes and count > 0:
            break
        encoded.append(data)
    return len(encoded), orjson.Fragment(b"[" + b",".join(encoded) + b"]")


#: What a body's ``retrieval_size`` field adds before its value: a comma and the quoted key.
_FIELD = len(b',"retrieval_size":')


def _size_field(size: int) -> dict[str, Any]:
    return {"serialized_bytes": size, "estimated_tokens": math.ceil(size / 4), "estimation_method": ESTIMATION_METHOD}


def retrieval_size(body: dict[str, Any]) -> dict[str, Any]:
    """``{serialized_bytes, estimated_tokens, estimation_method}`` of ``body`` as it will be sent, with
    this field added last (``body`` is not empty and has no ``retrieval_size`` yet).

    ``body`` is serialized once; the field's own width is added arithmetically, again until the
    digits of the sizes stop changing it (they are part of the size)."""
    base = len(orjson.dumps(body)) + _FIELD
    size = base + len(orjson.dumps(_size_field(0)))
    while (actual := base + len(orjson.dumps(_size_field(size)))) != size:
        size = actual
    return _size_field(size)
