"""The JSON body of a JSON-mode reply of the SDK's stateless (2026-07-28) transport, written once.

It wraps an SDK internal on the path of every call, in this module alone. In JSON-response mode
the SDK answers a 2026-07-28 request with ``mcp.server._streamable_http_modern._write(msg, ...)``:
``msg`` is a ``JSONRPCResponse`` whose ``result`` its runner has already dumped to JSON types
(``serialize_server_result``: validated against the revision's result model, dumped in pydantic's
JSON mode), and ``_write`` walks that result once more with ``model_dump(mode="json")`` and then
encodes it with the standard library's ``json.dumps``. For a ``get_messages`` of 50 messages the
result is about 40 KB (the structured content and the same JSON as text), and those two passes were
about a fifth of the MCP front's CPU per call (py-spy under ``bench/mcp.py --client jsonrpc``).

:func:`install` wraps ``_write``: a plain ``JSONRPCResponse`` (its only fields ``jsonrpc``, ``id``,
``result``; ``exclude_none`` never reaches inside ``result``, a plain dict) is encoded by orjson
straight from those fields, the same JSON value; anything else (errors, whose ``id: null`` case
the SDK handles itself, or a result orjson cannot encode, such as an integer beyond 64 bits) goes
to the SDK's own ``_write``. ``tests/test_mcp_wire.py`` fails loudly if the SDK renames or reshapes
``_write``, stops calling it by its module name, changes the fields of ``JSONRPCResponse``, or if
the two bodies ever differ as JSON.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from mcp.server import _streamable_http_modern as modern
from mcp_types import JSONRPCResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

#: The fields of ``JSONRPCResponse`` this module writes itself (the test checks the SDK's model).
RESPONSE_FIELDS = ("jsonrpc", "id", "result")

Write = Callable[[Any, Scope, Receive, Send], Awaitable[None]]


def encode_response(msg: JSONRPCResponse) -> bytes | None:
    """The JSON body of ``msg``, or None when only the SDK may write it."""
    if type(msg) is not JSONRPCResponse or not isinstance(msg.result, dict):
        return None
    try:
        return orjson.dumps({"jsonrpc": msg.jsonrpc, "id": msg.id, "result": msg.result})
    except TypeError:  # not JSON types after all (or an int past 64 bits): the SDK's encoder decides
        return None


def fast_write(sdk_write: Write) -> Write:
    """``sdk_write`` with plain responses encoded by :func:`encode_response`."""

    async def write(msg: Any, scope: Scope, receive: Receive, send: Send) -> None:
        body = encode_response(msg) if isinstance(msg, JSONRPCResponse) else None
        if body is None:
            await sdk_write(msg, scope, receive, send)
            return
        # What the SDK's _write sends for a success: 200, application/json (starlette adds the length).
        await Response(body, status_code=200, media_type="application/json")(scope, receive, send)

    write.__wrapped__ = sdk_write  # type: ignore[attr-defined]
    return write


def install() -> None:
    """Wrap the SDK's ``_write`` once per process (idempotent)."""
    current = modern._write
    if getattr(current, "__wrapped__", None) is None:
        modern._write = fast_write(current)  # type: ignore[assignment]
