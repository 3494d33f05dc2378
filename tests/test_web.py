"""The web front's skeleton over real HTTP: envelopes for every error, health, readiness, metrics."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from actors.web.app import make_app
from infra.bus.base import Bus
from infra.db import Database
from infra.runtime import Actor, Backoff, Supervisor
from protocol.errors import LineageMismatch
from tests.webclient import serve, test_node
from toastmachine.node import Node


@pytest.fixture
async def node(db: Database, bus: Bus) -> Node:
    return test_node(db, bus)


@pytest.fixture
async def client(node: Node) -> AsyncIterator[TestClient]:
    app = make_app(node)

    async def explode(request: web.Request) -> web.Response:
        raise ValueError("SELECT password FROM agents -- secret detail")

    app.router.add_get("/test/explode", explode)
    async with serve(app) as c:
        yield c


def _assert_envelope(body: dict, code: str) -> None:
    assert set(body) >= {"error"}
    err = body["error"]
    assert err["code"] == code
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["how_to_proceed"], str) and err["how_to_proceed"]


async def test_healthz(client: TestClient) -> None:
    resp = await client.get("/healthz")
    assert resp.status == 200
    assert await resp.json() == {"status": "ok"}
    assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["X-Trace-Id"])


async def test_unknown_route_is_a_404_envelope(client: TestClient) -> None:
    resp = await client.get("/no/such/thing")
    assert resp.status == 404
    assert resp.content_type == "application/json"
    _assert_envelope(await resp.json(), "not_found")


async def test_wrong_method_is_a_405_envelope_with_allow(client: TestClient) -> None:
    resp = await client.post("/healthz", data=b"{}")
    assert resp.status == 405
    _assert_envelope(await resp.json(), "method_not_allowed")
    assert "GET" in resp.headers["Allow"]


async def test_unexpected_error_is_a_500_envelope_without_details(client: TestClient) -> None:
    resp = await client.get("/test/explode", headers={"X-Trace-Id": "trace-for-this-test"})
    assert resp.status == 500
    text = await resp.text()
    assert "SELECT" not in text and "secret" not in text and "Traceback" not in text
    _assert_envelope(await resp.json(), "internal_error")
    assert resp.headers["X-Trace-Id"] == "trace-for-this-test"


async def test_readyz_when_everything_is_up(client: TestClient) -> None:
    resp = await client.get("/readyz")
    body = await resp.json()
    assert resp.status == 200, body
    assert body["checks"]["database"] == "ok" and body["checks"]["bus"] == "ok"


async def test_readyz_reports_identity_mismatch_and_crashed_actors(db: Database, bus: Bus) -> None:
    class Broken(Actor):
        name = "broken"

        async def setup(self) -> None:
            raise RuntimeError("cannot start")

    node = test_node(db, bus, identity_error=LineageMismatch("x"))
    node.supervisor = Supervisor({"broken": Broken}, Backoff(initial=0.01, maximum=0.02))
    await node.supervisor.start(wait=None)
    try:
        async with serve(make_app(node)) as c:
            resp = await c.get("/readyz")
            body = await resp.json()
            assert resp.status == 503
            _assert_envelope(body, "not_ready")
            assert body["checks"]["corpus"].startswith("lineage_unavailable")
            assert body["checks"]["actors"]["broken"]["state"] != "running"
            assert body["checks"]["database"] == "ok"
    finally:
        await node.supervisor.stop(0.1)


async def test_readyz_when_the_database_is_gone(node: Node, db: Database) -> None:
    app = make_app(node)
    async with serve(app) as c:
        await db.close()
        resp = await c.get("/readyz")
        body = await resp.json()
        assert resp.status == 503
        assert body["checks"]["database"].startswith("unreachable")
        assert body["checks"]["bus"] == "ok"


async def test_metrics_count_requests_and_show_the_bus(client: TestClient, bus: Bus) -> None:
    await client.get("/healthz")
    await client.get("/nope")
    resp = await client.get("/metrics")
    assert resp.status == 200
    text = await resp.text()
    assert 'toastmachine_http_requests_total{method="GET",route="/healthz",status="200"} 1.0' in text
    assert 'toastmachine_http_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text
    assert "toastmachine_http_request_duration_seconds_bucket" in text
    assert f'toastmachine_bus_connected{{backend="{bus.backend}"}} 1.0' in text
