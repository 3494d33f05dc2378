"""The aiohttp app factory and the actor that serves it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from actors.web import agents, archive, auth, export, front, health, ingress, openapi, reads, stream
from actors.web.context import NODE
from infra.http import READ_TIMEOUT, SERVER_HEADER, make_middleware, trace_header
from infra.http_server import GuardedAppRunner
from infra.runtime import Actor

if TYPE_CHECKING:
    from toastmachine.node import Node

#: SPEC §3: request bodies over 256 KiB are refused with 413.
MAX_BODY_BYTES = 256 * 1024


async def _set_server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_HEADER


def make_runner(app: web.Application, **kwargs: Any) -> GuardedAppRunner:
    """The runner that serves ``app`` (built by :func:`make_app`): enveloped parser errors, read
    timeouts and rejection metrics for every connection. ``kwargs`` go to ``web.AppRunner``."""
    node = app[NODE]
    return GuardedAppRunner(app, metrics=node.metrics, read_timeout=node.settings.http_read_timeout, **kwargs)


def make_app(node: Node) -> web.Application:
    """Build the web front's application for ``node``."""
    app = web.Application(middlewares=[make_middleware(node.metrics, node.settings.trusted_proxies)],
                          client_max_size=MAX_BODY_BYTES)
    app[NODE] = node
    app.on_response_prepare.append(_set_server_header)
    app.on_response_prepare.append(trace_header)
    app[READ_TIMEOUT] = node.settings.http_read_timeout
    auth.install(app)
    health.add_routes(app)
    agents.add_routes(app)
    ingress.add_routes(app)
    stream.add_routes(app)
    export.add_routes(app)
    archive.add_routes(app)
    front.add_routes(app)
    reads.add_routes(app)
    openapi.add_routes(app)
    return app


class WebFront(Actor):
    """Serves the web front over HTTP.

    Stop phases: stop listening, then let in-flight requests finish within the grace period
    (aiohttp's graceful shutdown), then close.
    """

    name = "web"

    def __init__(self, node: Node, *, host: str, port: int) -> None:
        super().__init__()
        self.node = node
        self.host = host
        self.port = port
        self._runner: GuardedAppRunner | None = None
        self._site: web.TCPSite | None = None
        self.bound_port: int | None = None

    async def setup(self) -> None:
        self._runner = make_runner(make_app(self.node), handle_signals=False, access_log=None,
                                   shutdown_timeout=self.node.settings.shutdown_grace)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.port)
        await self._site.start()
        server = self._site._server  # the asyncio server: the only place the bound port is known
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.port
        self.log.info("web.listening", url=f"http://{self.host}:{self.bound_port}")

    async def stop_intake(self) -> None:
        if self._site is not None:
            await self._site.stop()

    async def drain(self, grace: float) -> None:
        if self._runner is not None:
            # cleanup() waits up to shutdown_timeout for in-flight handlers, then runs on_cleanup.
            await self._runner.cleanup()
            self._runner = None

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
