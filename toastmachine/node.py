"""Assembling a node: configuration → database → bus → actors → web front, and taking it down again.

One natural path for every process type: ``open_node`` connects what the process needs (starting an
embedded PostgreSQL when no DATABASE_URL is set, migrating, checking the corpus identity), and
``serve`` runs a set of actors under a supervisor until SIGTERM / SIGINT, then shuts down in order
within a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from actors.hub import NotificationHub
from actors.registry import ACTORS
from actors.web.app import WebFront
from infra.bus import make_bus
from infra.bus.base import Bus
from infra.config import Settings
from infra.db import (
    CorpusIdentity,
    Database,
    EmbeddedPostgres,
    apply_migrations,
    ensure_identity,
    start_embedded,
)
from infra.exclusive import check_can_listen, free_port, hold_data_dir
from infra.logs import get_logger
from infra.metrics import Metrics
from infra.redact import redact_url
from infra.runtime import Actor, ActorHealth, Supervisor, tune_gc
from protocol.errors import ConfigError, LineageMismatch

log = get_logger("toastmachine.node")

#: Extra seconds past the grace period before shutdown gives up waiting.
HARD_DEADLINE_MARGIN = 5.0


@dataclass(slots=True)
class Node:
    """Everything one process holds: settings, connections, identity, metrics and its actors."""

    settings: Settings
    db: Database
    bus: Bus
    identity: CorpusIdentity | None
    identity_error: LineageMismatch | None
    database_label: str
    embedded: EmbeddedPostgres | None = None
    supervisor: Supervisor | None = None
    metrics: Metrics = field(init=False)
    _hub: NotificationHub | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(lambda: self.bus, self.actor_health)

    def notification_hub(self) -> NotificationHub:
        """This process's notification hub, made on first use and shared by its fronts (the web
        front's streams and, under ``toastmachine up``, the MCP front's notifier): one queue, one
        consumer and one frame encoding per change, however many fronts follow the corpus."""
        if self._hub is None:
            self._hub = NotificationHub(self.bus, self.db, node_id=self.settings.node_id,
                                        scope=self.identity.scope if self.identity is not None else None,
                                        heartbeat=self.settings.stream_heartbeat)
        return self._hub

    def actor_health(self) -> Mapping[str, ActorHealth]:
        return self.supervisor.health if self.supervisor is not None else {}

    @property
    def bus_label(self) -> str:
        return "in-process" if self.settings.amqp_url is None else redact_url(self.settings.amqp_url)


@contextlib.asynccontextmanager
async def open_database(settings: Settings, *, custom_plans: bool = False, applied: list[str] | None = None,
                        ) -> AsyncIterator[tuple[Database, EmbeddedPostgres | None, str]]:
    """Connect to DATABASE_URL, or start the embedded PostgreSQL under DATA_DIR; migrate; yield.

    ``custom_plans``: see :meth:`Database.connect` (processes that serve the read routes want it).
    ``applied``, if given, receives the names of the migrations this call applied.
    """
    embedded: EmbeddedPostgres | None = None
    if settings.database_url is None:
        embedded = await start_embedded(settings.data_dir)
        dsn, label = embedded.dsn, f"embedded PostgreSQL in {embedded.data_dir}"
    else:
        dsn, label = settings.database_url, redact_url(settings.database_url)
    try:
        db = await Database.connect(dsn, min_size=1, max_size=settings.db_pool_size, custom_plans=custom_plans)
        try:
            names = await apply_migrations(db)
            if names:
                log.info("db.migrated", applied=names)
            if applied is not None:
                applied.extend(names)
            yield db, embedded, label
        finally:
            await db.close()
    finally:
        if embedded is not None:
            await embedded.stop()


def require_bus_url(settings: Settings, *, allow_memory_bus: bool) -> None:
    """Raise ConfigError when no AMQP_URL is set and the in-process bus is not allowed here."""
    if settings.amqp_url is None and not allow_memory_bus:
        raise ConfigError(
            "TOASTMACHINE_AMQP_URL is not set: processes of a multi-process node talk over RabbitMQ. "
            "Set it (e.g. amqp://guest:guest@127.0.0.1:5672/), or run everything in one process with "
            "'toastmachine up', which uses the in-process bus.")


@contextlib.asynccontextmanager
async def open_node(settings: Settings, *, allow_memory_bus: bool, web: bool = False) -> AsyncIterator[Node]:
    """Connect the database and the bus for one process and check the corpus identity.

    Raises ConfigError when no AMQP_URL is set and the in-process bus is not allowed here,
    DatabaseUnavailable / BusUnavailable when a service cannot be reached at start.
    """
    require_bus_url(settings, allow_memory_bus=allow_memory_bus)
    async with open_database(settings, custom_plans=web) as (db, embedded, label):
        identity: CorpusIdentity | None = None
        identity_error: LineageMismatch | None = None
        try:
            identity = await ensure_identity(db, settings.corpus_id, settings.lineage)
        except LineageMismatch as e:
            # Reads still work; writes and sync answer 503 lineage_unavailable until the operator acts.
            identity_error = e
            log.error("corpus.identity_mismatch", detail=str(e))
        bus = make_bus(settings.amqp_url)
        await bus.connect()
        try:
            yield Node(settings=settings, db=db, bus=bus, identity=identity, identity_error=identity_error,
                       database_label=label, embedded=embedded)
        finally:
            await bus.close()


def actor_factories(node: Node, names: list[str], *, web: bool, mcp: bool = False,
                    extra: Mapping[str, Callable[[Node], Actor]] | None = None) -> dict[str, Callable[[], Actor]]:
    """Factories for the named back-end actors and the ``extra`` ones (a command's own, e.g. the
    mirror's follower), plus the MCP and web fronts last (so they stop first)."""
    factories: dict[str, Callable[[], Actor]] = {}
    builds = {**{name: ACTORS[name] for name in names}, **(extra or {})}
    for name, build in builds.items():
        factories[name] = lambda build=build: build(node)  # type: ignore[misc]
    if mcp:
        from actors.mcp.front import McpFront

        factories["mcp"] = lambda: McpFront(node, host=node.settings.mcp_host, port=node.settings.mcp_port)
    if web:
        factories["web"] = lambda: WebFront(node, host=node.settings.host, port=node.settings.port)
    return factories


async def serve(settings: Settings, *, actors: list[str], web: bool, allow_memory_bus: bool,
                announce: Callable[[str], None] | None = None, mcp: bool = False,
                extra: Mapping[str, Callable[[Node], Actor]] | None = None) -> int:
    """Run ``actors`` and ``extra`` (and the fronts) until SIGTERM/SIGINT; return the process exit code.

    Raises ConfigError when no AMQP_URL is set and the in-process bus is not allowed, then
    AlreadyInUse at once, before starting anything, when another process holds the embedded
    database's data directory or (for the web front) the port.
    """
    # A usage error first: a missing AMQP_URL is the answer even when another process holds the
    # data directory or the port (the lock is not what is wrong with this command line).
    require_bus_url(settings, allow_memory_bus=allow_memory_bus)
    with contextlib.ExitStack() as exclusive:
        if settings.database_url is None:
            # DATA_DIR holds the embedded database: one serving process may own it, not two.
            exclusive.enter_context(hold_data_dir(settings.data_dir))
        if web:
            check_can_listen(settings.host, settings.port)
        if mcp:
            check_can_listen(settings.mcp_host, settings.mcp_port, host_var="TOASTMACHINE_MCP_HOST",
                             port_var="TOASTMACHINE_MCP_PORT")
            if settings.mcp_port == 0:
                # The MCP front's URLs (its OAuth issuer, the front door's link to it) name its port,
                # so port 0 is resolved to a free port once, here, before anything is built.
                settings = dataclasses.replace(settings, mcp_port=free_port(settings.mcp_host))
        return await _serve(settings, actors=actors, web=web, allow_memory_bus=allow_memory_bus,
                            announce=announce, mcp=mcp, extra=extra)


async def _serve(settings: Settings, *, actors: list[str], web: bool, allow_memory_bus: bool,
                 announce: Callable[[str], None] | None, mcp: bool = False,
                 extra: Mapping[str, Callable[[Node], Actor]] | None = None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(signame: str) -> None:
        if stop.is_set():
            # A second signal means "now": skip the graceful shutdown.
            log.warning("node.forced_exit", signal=signame)
            sys.stderr.flush()
            import os

            os._exit(130)
        log.info("node.stopping", signal=signame)
        stop.set()

    start_failed = False
    misconfigured: ConfigError | None = None
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        async with open_node(settings, allow_memory_bus=allow_memory_bus, web=web or mcp) as node:
            supervisor = Supervisor(actor_factories(node, actors, web=web, mcp=mcp, extra=extra))
            node.supervisor = supervisor
            start = asyncio.create_task(supervisor.start(wait=60))
            stop_wait = asyncio.create_task(stop.wait())
            await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if start.done() and start.exception() is None:
                tune_gc()
                _announce(node, supervisor, announce)
                fatal = asyncio.create_task(supervisor.wait_fatal())
                await asyncio.wait({stop_wait, fatal}, return_when=asyncio.FIRST_COMPLETED)
                if fatal.done():
                    error = fatal.result()
                    log.error("node.stopping", reason=str(error))
                    start_failed = True  # a process stopped by a fatal error exits non-zero
                    if isinstance(error, ConfigError):
                        misconfigured = error  # exit 2, as at start
                fatal.cancel()
            elif start.done():
                not_started = {n: h.last_error for n, h in supervisor.health.items() if not h.ok}
                log.error("node.start_failed", actors=not_started)
                start_failed = True
                misconfigured = supervisor.misconfigured
                stop.set()
            start.cancel()
            stop_wait.cancel()
            grace = settings.shutdown_grace
            try:
                async with asyncio.timeout(grace * 2 + HARD_DEADLINE_MARGIN):
                    await supervisor.stop(grace)
            except TimeoutError:
                log.error("node.shutdown_deadline_exceeded",
                          detail="unfinished work was not acknowledged and will be redelivered")
                return 1
        log.info("node.stopped")
        if misconfigured is not None:
            raise misconfigured  # the command line says what is wrong, and exits 2 as for any configuration error
        # A node that never came up must not look like one that ran and stopped cleanly.
        return 1 if start_failed else 0
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _announce(node: Node, supervisor: Supervisor, announce: Callable[[str], None] | None) -> None:
    parts = [f"database: {node.database_label}", f"bus: {node.bus_label}"]
    if node.identity is not None:
        parts.append(f"corpus: {node.identity.corpus_id} lineage {node.identity.lineage}")
    web = supervisor.actors.get("web")
    mcp = supervisor.actors.get("mcp")
    actors = ", ".join(n for n in supervisor.actors if n not in ("web", "mcp"))
    if isinstance(web, WebFront):
        line = f"ToastMachine listening on http://{node.settings.host}:{web.bound_port}"
    else:
        line = f"ToastMachine running {actors}"
    if actors and isinstance(web, WebFront):
        line += f" with {actors}"
    bound = getattr(mcp, "bound_port", None)
    if bound is not None:
        mcp_url = (node.settings.mcp_public_url or f"http://{node.settings.mcp_host}:{bound}").rstrip("/") + "/mcp"
        # After a space, never glued to the web URL: scripts read "listening on <url>" up to whitespace.
        line = (line + f" and MCP at {mcp_url}") if isinstance(web, WebFront) else f"ToastMachine MCP at {mcp_url}"
    message = line + " (" + "; ".join(parts) + ")"
    log.info("node.ready", detail=message)
    if announce is not None:
        announce(message)
