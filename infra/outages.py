"""An outage of the database or the broker as the API error a client gets: a 503 it can retry.

One mapping for every front (the web front's middleware, the MCP front's tools, its endpoint and
its OAuth routes), so that a stopped PostgreSQL or an unreachable RabbitMQ reads the same wherever
the client came in, and never as a 500 with a traceback in the log.
"""

from __future__ import annotations

from infra.db.pool import UNAVAILABLE_ERRORS as DB_UNAVAILABLE_ERRORS
from protocol.errors import BusUnavailable, ServiceUnavailable

#: What a client answered with one of these is told: nothing was changed by its request (a write
#: that reached the writer and lost its database there is answered by the writer, whose error
#: says the outcome is unknown).
_NOTHING_CHANGED = "Retry in a few seconds; nothing was changed by this request."
#: Seconds a client is asked to wait before retrying (``Retry-After``).
RETRY_AFTER = 5

__all__ = ["DB_UNAVAILABLE_ERRORS", "RETRY_AFTER", "unavailable"]


def unavailable(exc: BaseException) -> ServiceUnavailable | None:
    """The 503 for ``exc`` when it means the database or the bus is unavailable; None otherwise."""
    if isinstance(exc, DB_UNAVAILABLE_ERRORS):
        return ServiceUnavailable("The database is unavailable.", how_to_proceed=_NOTHING_CHANGED,
                                  headers={"Retry-After": str(RETRY_AFTER)})
    if isinstance(exc, BusUnavailable):
        return ServiceUnavailable("The message bus is unavailable.", how_to_proceed=_NOTHING_CHANGED,
                                  headers={"Retry-After": str(RETRY_AFTER)})
    return None
