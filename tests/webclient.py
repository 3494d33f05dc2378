"""Serving the web front in the test process: a Node over the test's db and bus, and a real HTTP client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from actors.web.app import make_runner
from infra.bus.base import Bus
from infra.config import Settings
from infra.db import CorpusIdentity, Database
from protocol.errors import LineageMismatch
from toastmachine.node import Node


def test_node(db: Database, bus: Bus, env: Mapping[str, str] | None = None, *,
              identity: CorpusIdentity | None = None, identity_error: LineageMismatch | None = None) -> Node:
    """A Node for in-process tests, with settings from ``env`` (TOASTMACHINE_* variables)."""
    return Node(settings=Settings.from_env(dict(env or {})), db=db, bus=bus, identity=identity,
                identity_error=identity_error, database_label="test")


test_node.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test for pytest to collect


class _Server(TestServer):
    """aiohttp's TestServer with the web front's own runner (actors.web.app.make_runner), so tests
    see the same connection handling (parser errors, read timeouts) as a node."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        return make_runner(self.app, **kwargs)


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[TestClient]:
    """Serve ``app`` (from make_app) on a free local port and yield a client for it; close both afterwards."""
    client = TestClient(_Server(app))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
