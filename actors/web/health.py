"""Operational routes: liveness, readiness and metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from actors.publisher import active_publisher, read_cursor
from actors.reads import archive as archive_reads
from actors.web.context import NODE
from infra.db import Database
from infra.http import json_response
from infra.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from protocol.errors import ServiceUnavailable

#: Each dependency check gets this long before it counts as down.
CHECK_TIMEOUT = 2.0


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process is up and its event loop answers."""
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: database and bus reachable, corpus identity valid, local actors running."""
    node = request.app[NODE]
    checks: dict[str, Any] = {}
    ok = True

    async def probe(name: str, check: Any) -> None:
        nonlocal ok
        try:
            async with asyncio.timeout(CHECK_TIMEOUT):
                await check()
            checks[name] = "ok"
        except Exception as e:  # noqa: BLE001 - any failure means "not ready"; the text is ours
            ok = False
            checks[name] = _public_reason(e)

    await asyncio.gather(probe("database", node.db.check), probe("bus", node.bus.check))
    if node.identity_error is not None:
        ok = False
        checks["corpus"] = "lineage_unavailable: configured corpus identity does not match the database"
    else:
        checks["corpus"] = "ok"
    checks["archive"], checks["publisher"] = await asyncio.gather(_archive_detail(node.db),
                                                                  _publisher_detail(node.db))
    actors = {name: h.as_dict() for name, h in node.actor_health().items()}
    if actors:
        checks["actors"] = actors
        ok = ok and all(h.ok for h in node.actor_health().values())
    if ok:
        return json_response({"status": "ready", "checks": checks})
    error = ServiceUnavailable("This node is not ready.",
                               how_to_proceed="Send traffic to another node or retry shortly; see 'checks'.")
    error.code = "not_ready"
    body = error.envelope()
    body["checks"] = checks
    return json_response(body, status=503)


async def _archive_detail(db: Database) -> dict[str, Any]:
    """The archive's boundaries and lag: detail only, never what readiness depends on (an archive
    that lags does not make a node unfit to serve)."""
    try:
        async with asyncio.timeout(CHECK_TIMEOUT):
            marks = await archive_reads.watermarks(db)
            lag = await archive_reads.archive_lag(db, marks.verified_through)
            store = await archive_reads.store_state(db)
    except Exception:  # noqa: BLE001 - the database check above reports why
        return {"status": "unknown"}
    return {"archived_through": marks.archived_through, "verified_through": marks.verified_through,
            "lag_events": lag, "store": store}


async def _publisher_detail(db: Database) -> dict[str, Any]:
    """The event publisher's progress as the database records it: its cursor, the committed changes
    after it (not yet on ``tm.events`` nor with the hubs: live followers wait for them), and whether
    a publisher holds the lock (the publisher process serves no HTTP: this is where a stopped one
    shows). Detail only: the node still commits and serves reads without one."""
    try:
        async with asyncio.timeout(CHECK_TIMEOUT):
            cursor = await read_cursor(db)
            lag = await archive_reads.changes_after(db, cursor)
            holder = await active_publisher(db)
    except Exception:  # noqa: BLE001 - the database check reports why
        return {"status": "unknown"}
    return {"status": "active" if holder is not None else "none_active", "cursor": cursor, "lag_events": lag}


def _public_reason(error: Exception) -> str:
    if isinstance(error, TimeoutError):
        return "unreachable: no answer within 2 s"
    # Our own exceptions carry public, secret-free messages (URLs are redacted where they are built).
    from protocol.errors import ToastMachineError

    if isinstance(error, ToastMachineError):
        return f"unreachable: {error}"
    return f"unreachable: {type(error).__name__}"


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of this process."""
    node = request.app[NODE]
    archive, publisher = await asyncio.gather(_archive_detail(node.db), _publisher_detail(node.db))
    node.metrics.set_corpus_archive(archive)
    node.metrics.set_corpus_publisher(publisher)
    return web.Response(body=node.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
