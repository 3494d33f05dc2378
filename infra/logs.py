"""structlog set-up and the trace id that follows one write across processes.

The trace id lives in a context variable: the HTTP middleware sets it per request, the bus copies it
into the ``x-trace-id`` header of everything published, and consumers bind it again per delivery.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import structlog

TRACE_HEADER = "x-trace-id"

_trace_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("tm_trace_id", default=None)


def new_trace_id() -> str:
    """A fresh random trace id (32 hex characters)."""
    return uuid.uuid4().hex


def current_trace_id() -> str | None:
    """The trace id bound to the running task, if any."""
    return _trace_id.get()


@contextlib.contextmanager
def bound_trace(trace_id: str | None, **context: Any) -> Iterator[str]:
    """Bind ``trace_id`` (a new one if None) and extra log context for the duration of the block."""
    tid = trace_id or new_trace_id()
    token = _trace_id.set(tid)
    with structlog.contextvars.bound_contextvars(trace_id=tid, **context):
        try:
            yield tid
        finally:
            _trace_id.reset(token)


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Configure structlog (and the stdlib root logger it renders through) once per process."""
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
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
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info if fmt == "json" else _identity,
                    renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library chatter at INFO (every aiormq reconnect attempt, every pgserver step) drowns our own lines.
    for noisy in ("aiormq", "aio_pika", "pgserver", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Python warnings (e.g. platformdirs' RuntimeDirWarning when pgserver starts without
    # XDG_RUNTIME_DIR) are printed raw to stderr by default: one stray non-JSON line breaks a JSON
    # log pipeline. Route them through the handler above as records of the "py.warnings" logger.
    logging.captureWarnings(True)


def _identity(_: Any, __: str, event: Any) -> Any:
    return event


def get_logger(name: str, **context: Any) -> Any:
    """A structlog logger named ``name`` with extra context.

    It stays a lazy proxy until its first log call, so loggers created at import time (module
    level) still follow :func:`configure_logging`, which runs later, at process start.
    """
    return structlog.get_logger(name, **context)
