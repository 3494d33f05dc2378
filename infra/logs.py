"""structlog set-up and the trace id that follows one write across processes.

The trace id lives in a context variable: the HTTP middleware sets it per request, the bus copies it
into the ``x-trace-id`` header of everything published, and consumers bind it again per delivery.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import sys
import uuid
from collections.abc import Iterator, Mapping, MutableMapping
from types import MappingProxyType
from typing import Any

import structlog

from infra.redact import redact_line

TRACE_HEADER = "x-trace-id"
#: What a trace id taken from outside (an HTTP ``X-Trace-Id``, a message's ``x-trace-id``) must look
#: like to be kept: anything else is replaced by a fresh one, so that no sender can put arbitrary
#: text into every log line and event header downstream.
_TRACE_RE = re.compile(r"[A-Za-z0-9_-]{8,64}")

_trace_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("tm_trace_id", default=None)
#: Log context bound with the trace id (e.g. the queue a delivery came from); never mutated, replaced.
_log_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("tm_log_context",
                                                                                 default=MappingProxyType({}))


def new_trace_id() -> str:
    """A fresh random trace id (32 hex characters)."""
    return uuid.uuid4().hex


def valid_trace_id(value: object) -> str | None:
    """``value`` when it is a trace id this system keeps (8 to 64 letters, digits, ``_`` or ``-``),
    else None."""
    return value if isinstance(value, str) and _TRACE_RE.fullmatch(value) else None


def current_trace_id() -> str | None:
    """The trace id bound to the running task, if any."""
    return _trace_id.get()


@contextlib.contextmanager
def bound_trace(trace_id: str | None, **context: Any) -> Iterator[str]:
    """Bind ``trace_id`` (a new one if None) and extra log context for the duration of the block.

    Both live in this module's context variables, which :func:`merge_trace_context` adds to every
    log line. Not structlog's ``bound_contextvars``: that one walks every context variable of the
    task on each entry, about 10 µs, and this runs once per request and once per delivered command.
    """
    tid = trace_id or new_trace_id()
    token = _trace_id.set(tid)
    context_token = _log_context.set({**_log_context.get(), **context}) if context else None
    try:
        yield tid
    finally:
        if context_token is not None:
            _log_context.reset(context_token)
        _trace_id.reset(token)


def merge_trace_context(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the trace id and context bound by :func:`bound_trace`, under what the log
    call itself names (a key the call passes wins)."""
    for key, value in _log_context.get().items():
        event_dict.setdefault(key, value)
    trace_id = _trace_id.get()
    if trace_id is not None:
        event_dict.setdefault("trace_id", trace_id)
    return event_dict


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Configure structlog (and the stdlib root logger it renders through) once per process."""
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        # Plain tracebacks: with rich installed, structlog's default shows every frame's local
        # variables, and a connection's locals hold its DSN with the password.
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),
                                                 exception_formatter=structlog.dev.plain_traceback)
    shared: list[Any] = [
        merge_trace_context,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = _RedactingFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    _bounded,
                    structlog.processors.format_exc_info if fmt == "json" else _identity,
                    renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(_library_lines)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library chatter at INFO (every aiormq reconnect attempt, every pgserver step) drowns our own lines.
    # The MCP SDK logs every session it creates (its id included) and every failed request, quoting
    # what the client sent: ours say what matters (toastmachine.mcp).
    for noisy in ("aiormq", "aio_pika", "pgserver", "asyncio", "mcp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Its DNS-rebinding check warns with the refused Host or Origin header quoted, raw; the answer
    # it gives is logged by toastmachine.mcp.endpoint (mcp.transport_refused) without the value.
    logging.getLogger("mcp.server.transport_security").setLevel(logging.ERROR)
    # Python warnings (e.g. platformdirs' RuntimeDirWarning when pgserver starts without
    # XDG_RUNTIME_DIR) are printed raw to stderr by default: one stray non-JSON line breaks a JSON
    # log pipeline. Route them through the handler above as records of the "py.warnings" logger.
    logging.captureWarnings(True)


#: Libraries whose failures while reconnecting are expected during an outage: our own lines say
#: what happened (bus.connection_lost, writer.database_unavailable...), so theirs are one line each.
_RECONNECTING_LIBRARIES = ("asyncpg", "aiormq", "aio_pika", "pamqp")


#: Characters a log line's value keeps at most: a library's message quoting a client's 20 KB
#: request (a resource URI, a Host header) is cut there, with its length said.
MAX_LOG_VALUE = 2000


def _bounded(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Cut every string value of ``event`` longer than :data:`MAX_LOG_VALUE` characters, each
    redacted first (a cut could fall inside a URL and leave its password without the ``@`` the
    last guard looks for). A traceback (``exception``, added later in JSON) is ours and left whole."""
    for key, value in event.items():
        if isinstance(value, str) and len(value) > MAX_LOG_VALUE:
            value = redact_line(value)
            event[key] = f"{value[:MAX_LOG_VALUE]}… ({len(value)} characters)"
    return event


class _RedactingFormatter(structlog.stdlib.ProcessorFormatter):
    """The processor formatter, with any URL password in the finished line replaced by ``***``: a
    last guard for what a library puts in its own messages."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_line(super().format(record))


def _library_lines(record: logging.LogRecord) -> bool:
    """Render a reconnecting library's record as one line: its traceback becomes the exception's
    type and message, and its errors are warnings (the outage is reported at error by us, once)."""
    if record.name.split(".", 1)[0] in _RECONNECTING_LIBRARIES:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def _identity(_: Any, __: str, event: Any) -> Any:
    return event


def get_logger(name: str, **context: Any) -> Any:
    """A structlog logger named ``name`` with extra context.

    It stays a lazy proxy until its first log call, so loggers created at import time (module
    level) still follow :func:`configure_logging`, which runs later, at process start.
    """
    return structlog.get_logger(name, **context)
