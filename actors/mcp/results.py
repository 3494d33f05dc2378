"""Tool results of the MCP front: a success as ``structuredContent`` plus the same JSON as text, and
every refusal as an ``isError`` result with ``{error: {category, message, retryable, outcome,
recovery_action, http_status?, upstream_code?}}``.

Errors are mapped from the same :class:`~protocol.errors.ApiError` the HTTP API renders, so a tool and
its route refuse the same things for the same reasons; ``upstream_code`` is the HTTP error code. The
text is the ApiError's fixed text (which quotes client input only through :func:`protocol.errors.quote`,
never corpus content), or, for an unexpected exception, a fixed sentence: details stay in the logs.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from mcp_types import CallToolResult, TextContent
from pydantic import ValidationError

from protocol.errors import LIST_LIMIT, ApiError, clip, quote_all

#: HTTP status → the category an MCP client branches on.
_CATEGORIES = {
    400: "invalid_argument", 401: "unauthorized", 403: "insufficient_scope", 404: "not_found",
    409: "conflict", 413: "too_large", 422: "invalid_argument", 428: "onboarding_required",
    429: "rate_limited", 503: "unavailable", 504: "outcome_unknown",
}
#: Categories worth retrying unchanged (after waiting, or after the step the recovery action names).
_RETRYABLE = {"rate_limited", "unavailable", "outcome_unknown", "onboarding_required"}

UNKNOWN_OUTCOME_ACTION = ("Call the same tool again with the identical arguments and the same operation_token; "
                          "the write takes effect at most once.")


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def success(body: dict[str, Any]) -> CallToolResult:
    """A successful result: ``body`` as structured content and as its JSON text.

    The representations hold stored payloads as raw JSON fragments (sent byte for byte by the HTTP
    API); structured content must be plain values, so the body is serialized once and parsed back,
    and the text is exactly that serialization."""
    text = orjson.dumps(body)
    return CallToolResult(content=[TextContent(type="text", text=text.decode())], structured_content=orjson.loads(text))


def failure(category: str, message: str, *, retryable: bool, outcome: str, recovery_action: str,
            http_status: int | None = None, upstream_code: str | None = None,
            extra: dict[str, Any] | None = None) -> CallToolResult:
    """An ``isError`` result with the error object as structured content and as JSON text."""
    error: dict[str, Any] = {"category": category, "message": message, "retryable": retryable,
                             "outcome": outcome, "recovery_action": recovery_action}
    if http_status is not None:
        error["http_status"] = http_status
    if upstream_code is not None:
        error["upstream_code"] = upstream_code
    for key, value in (extra or {}).items():  # field, retry_after, existing_relationship_id...
        error.setdefault(key, value)
    body = {"error": error}
    return CallToolResult(content=[TextContent(type="text", text=_json(body))], structured_content=body,
                          is_error=True)


def from_api_error(exc: ApiError) -> CallToolResult:
    """The tool result of an ApiError the core raised."""
    category = _CATEGORIES.get(exc.status, "invalid_argument" if exc.status < 500 else "unavailable")
    if exc.code == "onboarding_required":
        category = "onboarding_required"
    unknown = exc.outcome_unknown
    return failure(category, exc.message, retryable=category in _RETRYABLE,
                   outcome="unknown" if unknown else "not_applied",
                   recovery_action=UNKNOWN_OUTCOME_ACTION if unknown else exc.how_to_proceed,
                   http_status=exc.status, upstream_code=exc.code, extra=exc.extra)


def insufficient_scope(scope: str) -> CallToolResult:
    """A valid grant without ``scope``: nothing was done."""
    return failure("insufficient_scope", f"This tool needs the {scope} scope, which this authorization lacks.",
                   retryable=False, outcome="not_applied",
                   recovery_action=f"Authorize this client again asking for the {scope} scope, then retry.",
                   http_status=403, upstream_code="insufficient_scope", extra={"scope": scope})


def internal() -> CallToolResult:
    """An unexpected failure: fixed text; the exception is in the node's log."""
    return failure("internal", "The node hit an unexpected error.", retryable=True, outcome="unknown",
                   recovery_action="Retry later; a write may be retried with the same operation_token.",
                   http_status=500, upstream_code="internal_error")


#: What an argument name must look like to be named in an error (it comes from the tool's schema).
_ARGUMENT_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_FIX_ARGUMENTS = "Call the tool again with arguments that match its input schema (see tools/list)."


def bad_arguments(exc: ValidationError) -> CallToolResult:
    """Arguments the SDK's signature check refused: which argument, never the value sent.

    The first error decides the text; ``field`` is the argument's name (a top-level name of the
    tool's input schema, so trusted text), ``missing_argument`` or ``invalid_argument`` the code."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    loc = errors[0]["loc"] if errors else ()
    field = str(loc[0]) if loc and isinstance(loc[0], str) and _ARGUMENT_NAME.match(loc[0]) else None
    missing = bool(errors) and errors[0]["type"] == "missing"
    if field is None:
        message = "The arguments do not match this tool's input schema."
    elif missing:
        message = f"The argument {field} is required."
    else:
        message = f"The argument {field} has the wrong type or value for this tool's input schema."
    return failure("invalid_argument", message, retryable=False, outcome="not_applied",
                   recovery_action=_FIX_ARGUMENTS, http_status=400,
                   upstream_code="missing_argument" if missing else "invalid_argument",
                   extra={"field": field} if field is not None else None)


def unknown_tool() -> CallToolResult:
    """A call naming a tool this server does not have (the name is not repeated back)."""
    return failure("not_found", "This server has no tool of that name.", retryable=False, outcome="not_applied",
                   recovery_action="Call tools/list for the tools this server offers.", http_status=404,
                   upstream_code="unknown_tool")


def unknown_arguments(unknown: list[str], accepted: list[str]) -> CallToolResult:
    """Arguments the tool does not take (names quoted and bounded, as for an unknown HTTP field)."""
    listed = ", ".join(accepted) if accepted else "none"
    return failure("invalid_argument", f"Unknown argument(s): {quote_all(unknown)}.", retryable=False,
                   outcome="not_applied", recovery_action=f"Send only the arguments this tool takes: {listed}.",
                   http_status=400, upstream_code="unknown_argument",
                   extra={"field": clip(unknown[0]), "fields": [clip(u) for u in unknown[:LIST_LIMIT]]})
