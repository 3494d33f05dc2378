"""The error vocabulary shared by every package.

Every public error code of SPEC §3 is one :class:`ApiError` subclass (or instance) carrying the HTTP
status, a fixed public message and the ``how_to_proceed`` guidance. Nothing private (SQL text, stack
traces, secrets) ever goes into these fields.
"""

from __future__ import annotations

import json
from typing import Any

#: Most characters of one piece of client input an error message (or log line) repeats.
QUOTE_LIMIT = 64
#: Most pieces of client input (e.g. unknown field names) one error lists.
LIST_LIMIT = 10
#: Error codes that say a write may have taken effect (the client cannot tell): a 504 no writer
#: answered in time, and the writer's lost database connection (it may drop during COMMIT). They
#: cross the bus as codes, so the code is what carries it.
OUTCOME_UNKNOWN_CODES = frozenset({"outcome_unknown", "database_unavailable"})


def clip(value: object, limit: int = QUOTE_LIMIT) -> str:
    """Client input cut to its first ``limit`` characters, with "…" when it was longer: for the
    machine-readable fields of an error (``field``, ``fields``)."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit] + "…"


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """Client input for an error message: a JSON string literal (control, format and non-ASCII
    characters escaped, so nothing it holds can forge text around it) of its first ``limit``
    characters, followed by "…" outside the quotes when it was longer."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)  # never a Python repr
    literal = json.dumps(text[:limit])
    return literal if len(text) <= limit else literal + "…"


def quote_all(values: list[str], limit: int = LIST_LIMIT) -> str:
    """Up to ``limit`` pieces of client input, quoted and comma-separated, then "and N more"."""
    shown = ", ".join(quote(v) for v in values[:limit])
    return shown if len(values) <= limit else f"{shown} and {len(values) - limit} more"


class ToastMachineError(Exception):
    """Root of every exception raised on purpose by ToastMachine code."""


class ProcessFatal(ToastMachineError):
    """An actor met something after which its process must stop rather than restart it: going on
    would serve what is known to be wrong (a mirror that found its source's history forked)."""


class ConfigError(ToastMachineError):
    """A configuration value is missing or invalid. The message names the variable."""


class ProtocolDecodeError(ToastMachineError):
    """Bytes from the wire could not be turned into a typed message.

    A delivery that raises this is poison: it is dead-lettered with the reason, never requeued.
    """


class BusError(ToastMachineError):
    """Root of bus failures."""


class BusUnavailable(BusError):
    """The broker could not be reached, or a publish was not confirmed in time."""


class RequestTimeout(BusError):
    """A request sent over the bus got no reply before its deadline: the outcome is unknown."""


class Unroutable(BusError):
    """A mandatory publish matched no queue, so nobody would ever process it."""


class DatabaseUnavailable(ToastMachineError):
    """PostgreSQL could not be reached or refused the connection."""


class LineageMismatch(ToastMachineError):
    """The configured corpus identity differs from the witness row in the database."""


class ApiError(ToastMachineError):
    """An error that has a public rendering: ``{"error": {code, message, how_to_proceed}}``."""

    status: int = 400
    code: str = "bad_request"
    message: str = "The request is not valid."
    how_to_proceed: str = "Fix the request and send it again."

    def __init__(
        self,
        message: str | None = None,
        *,
        how_to_proceed: str | None = None,
        status: int | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        outcome_unknown: bool = False,
    ) -> None:
        """``outcome_unknown``: a write this refuses may still have taken effect (also true of every
        code in :data:`OUTCOME_UNKNOWN_CODES`): the client must retry with the same token, not a new one."""
        self._outcome_unknown = outcome_unknown
        if message is not None:
            self.message = message
        if how_to_proceed is not None:
            self.how_to_proceed = how_to_proceed
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})
        super().__init__(self.message)

    @property
    def outcome_unknown(self) -> bool:
        """Whether the write this refuses may have taken effect (see ``__init__``)."""
        return self._outcome_unknown or self.code in OUTCOME_UNKNOWN_CODES

    def envelope(self) -> dict[str, Any]:
        """The public JSON body of this error."""
        body: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "how_to_proceed": self.how_to_proceed,
        }
        body.update(self.extra)
        return {"error": body}


class BadRequest(ApiError):
    status, code = 400, "bad_request"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"
    message = "A valid credential is required."
    how_to_proceed = "Send 'Authorization: Bearer <credential>' with the credential returned by POST /register."


class Forbidden(ApiError):
    status, code = 403, "forbidden"
    message = "This credential may not do that."
    how_to_proceed = "Use a credential that has the needed permission."


class ReadOnlyMirror(Forbidden):
    """This node serves a mirror's database: a read-only copy of another node's history."""

    code = "read_only_mirror"
    message = "This node serves a read-only mirror of another node's corpus; it registers and writes nothing."
    how_to_proceed = ("Register and write on the node it mirrors (GET /corpus names it under 'mirror'); "
                      "the mirror shows those writes once it has followed them.")


class NotFound(ApiError):
    status, code = 404, "not_found"
    message = "No such resource."
    how_to_proceed = "Check the path; GET /openapi.json lists every route."


class MethodNotAllowed(ApiError):
    status, code = 405, "method_not_allowed"
    message = "This route does not accept that method."
    how_to_proceed = "Use one of the methods listed in the Allow header."


class NotAcceptable(ApiError):
    status, code = 406, "not_acceptable"
    message = "None of the media types in Accept can be produced here."
    how_to_proceed = "Ask for application/json."


class ReadTimeout(ApiError):
    """The client did not deliver its request (headers or body) within the read timeout."""

    status, code = 408, "request_timeout"
    message = "The request was not received in time."
    how_to_proceed = "Send the whole request (headers and body) without pausing, then retry."


class Conflict(ApiError):
    status, code = 409, "conflict"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"
    message = "The request body is too large."
    how_to_proceed = "Send a body of at most 256 KiB."


class UnsupportedMediaType(ApiError):
    status, code = 415, "unsupported_media_type"
    message = "Writes must be sent as application/json."
    how_to_proceed = "Set 'Content-Type: application/json' and send a JSON object."


class Unprocessable(ApiError):
    status, code = 422, "validation_failed"


class PreconditionRequired(ApiError):
    status, code = 428, "precondition_required"


class TooManyRequests(ApiError):
    status, code = 429, "rate_limited"
    message = "Too many requests."
    how_to_proceed = "Wait for the number of seconds in Retry-After, then retry."


class ServiceUnavailable(ApiError):
    status, code = 503, "service_unavailable"
    message = "A service this node depends on is unavailable."
    how_to_proceed = "Retry later with the same Operation-Token; nothing was written."


class GatewayTimeout(ApiError):
    status, code = 504, "outcome_unknown"
    message = "The write was sent but no answer came back in time; its outcome is unknown."
    how_to_proceed = "Retry the identical request with the same Operation-Token; it will take effect at most once."


class InternalError(ApiError):
    """Rendered for any unexpected exception: fixed public text, the details stay in the logs."""

    status, code = 500, "internal_error"
    message = "The node hit an unexpected error."
    how_to_proceed = "Retry later; if it persists, report the X-Trace-Id header to the operator."
