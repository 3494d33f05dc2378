"""The MCP front as an actor: uvicorn serving :func:`actors.mcp.app.build_app` in the node's event loop.

It also follows this process's notification hub (:mod:`actors.hub`; its own NODE queue bound on the
internal ``tm.hub.<corpus_id>``, shared with the web front under ``toastmachine up``), which feeds the
resource-updated notifications of :mod:`actors.mcp.notify` to ``subscriptions/listen`` streams and
``resources/subscribe`` sessions.

``toastmachine mcp`` runs it alone; ``toastmachine up`` runs it beside the other actors. uvicorn's own
signal capture is disabled: the node handles SIGTERM/SIGINT and stops actors in phases (stop intake,
drain within the grace period, close), and this actor maps those onto uvicorn's graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.subscriptions import InMemorySubscriptionBus

from actors.mcp.app import build_app
from actors.mcp.cleanup import BATCH, delete_expired
from actors.mcp.grants import current_grant
from actors.mcp.notify import LegacySubscriptions, ResourceNotifier, ScopedListen, register_subscriptions
from actors.mcp.resources import register_resources
from actors.mcp.tools import ToolDeps, register_tools
from infra.runtime import Actor

if TYPE_CHECKING:
    from toastmachine.node import Node


#: Seconds between passes of the expired-row cleanup, and the longest wait after failed passes.
CLEANUP_INTERVAL = 300.0
CLEANUP_MAX_BACKOFF = 3600.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The node owns the signals; see the module docstring.
        yield


def make_server(app: Any, *, grace: float = 10.0, **listen: Any) -> uvicorn.Server:
    """A uvicorn server for ``app`` with our settings: no signal capture, no access log (a request line
    could carry a consent handle), no ``Server: uvicorn`` (the app says ``ToastMachine``), and no
    rewriting of the client address from forwarding headers (uvicorn believes them from loopback by
    default; ours are believed only from ``TOASTMACHINE_TRUSTED_PROXIES``). ``listen``:
    ``host``/``port`` for uvicorn to bind, or nothing when :meth:`uvicorn.Server.serve` gets sockets.

    HTTP is parsed by httptools (llhttp, in C), named rather than left to uvicorn's ``auto`` so that
    every install parses alike: the pure-Python h11 took about a tenth of the MCP front's CPU per call
    (bench/mcp.py)."""
    config = uvicorn.Config(app, lifespan="on", log_config=None, access_log=False, server_header=False,
                            proxy_headers=False, http="httptools", timeout_graceful_shutdown=int(grace),
                            **listen)
    return _Server(config)


async def _end_sessions(server: MCPServer) -> None:
    """Terminate every 2025-11-25 session of ``server``: each holds a standalone GET stream open,
    which would make uvicorn's graceful shutdown wait its whole grace period. Sessions live in this
    process's memory and end with it anyway; their clients get 404 and initialize again (elsewhere).
    The SDK keeps them in its session manager's table and has no public call to end them all."""
    transports = list(server.session_manager._server_instances.values())
    for transport in transports:
        if not transport.is_terminated:
            await transport.terminate()


class McpFront(Actor):
    """Serves the MCP endpoint and the OAuth authorization server over HTTP (uvicorn)."""

    name = "mcp"

    def __init__(self, node: Node, *, host: str, port: int) -> None:
        super().__init__()
        self.node = node
        self.host = host
        self.port = port
        self.bound_port: int | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._notifier: ResourceNotifier | None = None
        self._listen: ScopedListen | None = None
        self._legacy: LegacySubscriptions | None = None
        self._mcp: MCPServer | None = None

    async def setup(self) -> None:
        # Bind first: with port 0 the issuer URL (which names the port) is known only after binding.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.bound_port = sock.getsockname()[1]
        settings = dataclasses.replace(self.node.settings, mcp_port=self.bound_port)
        deps = ToolDeps.from_node(self.node, current_grant)
        node = self.node
        bus = InMemorySubscriptionBus()
        self._notifier = ResourceNotifier(node.notification_hub(), bus, node.db,
                                          guide_poll=settings.mcp_guide_poll)
        per_agent = settings.mcp_subscriptions_per_agent
        self._listen = ScopedListen(bus, current_grant, per_agent=per_agent)
        self._legacy = LegacySubscriptions(bus, current_grant, per_agent=per_agent)

        def register(server: MCPServer, _: object) -> None:
            register_tools(server, deps)
            register_resources(server, deps)
            assert self._listen is not None and self._legacy is not None
            register_subscriptions(server, self._listen, self._legacy)
            self._mcp = server

        app = build_app(settings, node.db, tools=register, subscriptions=bus,
                        stream_opened=self._legacy.stream_opened)
        # Following before serving: a client that subscribes as soon as it can is told of what follows.
        await self._notifier.start()
        self._legacy.start()
        self._server = make_server(app, grace=settings.shutdown_grace)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="mcp-uvicorn")
        # uvicorn reports readiness only through this flag; the task ending first is a failed start.
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the MCP front stopped while starting")
            await asyncio.sleep(0.02)
        self.log.info("mcp.listening", url=f"http://{self.host}:{self.bound_port}/mcp")

    async def run(self) -> None:
        """Serve until stopped, deleting expired OAuth rows meanwhile (:mod:`actors.mcp.cleanup`)."""
        delay = CLEANUP_INTERVAL
        while not self._stop_requested.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), delay)
            if self._stop_requested.is_set():
                break
            try:
                deleted = await delete_expired(self.node.db)
            except Exception as e:  # noqa: BLE001 - a failed pass deletes nothing live; try again later
                delay = min(delay * 2, CLEANUP_MAX_BACKOFF)
                self.log.warning("mcp.cleanup_failed", error=type(e).__name__, retry_in=delay)
                continue
            # A full batch means more is waiting: go again soon; otherwise back to the normal pace.
            delay = 1.0 if deleted >= BATCH else CLEANUP_INTERVAL
            if deleted:
                self.log.info("mcp.cleanup", deleted=deleted)

    async def stop_intake(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        # Listen streams never end on their own: end them now (each sends its final result) so
        # uvicorn's graceful shutdown does not wait its whole grace period for them.
        if self._listen is not None:
            self._listen.close()
        if self._mcp is not None:
            await _end_sessions(self._mcp)

    async def drain(self, grace: float) -> None:
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), grace + 1)

    async def close(self) -> None:
        if self._server is not None:
            self._server.force_exit = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._legacy is not None:
            await self._legacy.close()
        if self._notifier is not None:
            await self._notifier.close()
