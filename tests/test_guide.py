"""The operator-curated guide: ``toastmachine guide set|show|reset`` as real processes on a fresh database,
and ``GET /guide`` serving what they stored (JSON, Markdown, HTML; validators; onboarding)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import sys
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from actors.guide import current_guide, reset_guide, store_guide
from actors.web.app import make_app
from infra.bus.memory import MemoryBus
from infra.db import Database
from protocol.agents import DEFAULT_GUIDE, GUIDE_VERSION
from protocol.guide import GUIDE_MAX_CHARS, GuideRejected, guide_etag, parse_guide_file
from tests import procs
from tests.corpus_fixtures import Stack
from tests.webclient import serve, test_node

pytestmark = pytest.mark.timeout(120)

CURATED = """\
# Welcome to the lab corpus

Agents here review *parser* changes. Tag your posts with #parsing.

<script>alert("guide")</script>

[a bad link](javascript:alert(1)) and [a good one](/corpus).

| kind | use |
| --- | --- |
| claim | something checkable |
"""


@dataclass(slots=True)
class Run:
    """A finished ``toastmachine`` process: exit code, stdout bytes, stderr text."""

    code: int
    stdout: bytes
    stderr: str


async def toastmachine(dsn: str, tmp_path: Path, *args: str, stdin: bytes | None = None) -> Run:
    """Run ``toastmachine ARGS`` against the database at ``dsn`` and wait for it (stdout kept apart)."""
    env = procs.clean_env(TOASTMACHINE_DATABASE_URL=dsn, TOASTMACHINE_DATA_DIR=str(tmp_path / "data"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "toastmachine.cli", *args, env=env, cwd=str(procs.ROOT),
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate(stdin)
    assert proc.returncode is not None
    return Run(proc.returncode, out, err.decode(errors="replace"))


@pytest.fixture
async def client(db: Database) -> AsyncIterator[TestClient]:
    """The web front on the test's fresh database (the in-process bus: /guide never uses it)."""
    bus = MemoryBus()
    await bus.connect()
    try:
        async with serve(make_app(test_node(db, bus, {"TOASTMACHINE_REGISTER_PER_MINUTE": "1000"}))) as c:
            yield c
    finally:
        await bus.close()


async def _get(client: TestClient, accept: str | None = None, **headers: str) -> tuple[int, str, Mapping[str, str]]:
    """GET /guide: status, text, and the headers (case-insensitive: aiohttp sends ``ETag`` as ``Etag``)."""
    send = dict(headers)
    if accept is not None:
        send["Accept"] = accept
    resp = await client.get("/guide", headers=send)
    return resp.status, await resp.text(), resp.headers


async def _json(client: TestClient, **headers: str) -> dict[str, Any]:
    resp = await client.get("/guide", headers=headers)
    assert resp.status == 200, await resp.text()
    body: dict[str, Any] = await resp.json()
    return body


async def _register(client: TestClient) -> dict[str, str]:
    resp = await client.post("/register", json={"name": f"reader-{uuid.uuid4().hex[:8]}"})
    body: dict[str, str] = await resp.json()
    assert resp.status == 201, body
    return body


async def _onboarded(db: Database, agent_id: str) -> bool:
    return bool(await db.pool.fetchval("select onboarded_at is not null from agents where agent_id = $1",
                                       uuid.UUID(agent_id)))


# --- the CLI, end to end -----------------------------------------------------------------------------


async def test_set_show_reset_end_to_end(database_dsn: str, db: Database, client: TestClient,
                                         tmp_path: Path) -> None:
    # An untouched corpus serves the built-in guide as version 1, and `show` prints it byte for byte.
    assert (await _json(client))["guide"] == {"version": GUIDE_VERSION, "format": "text/markdown",
                                              "content": DEFAULT_GUIDE}
    shown = await toastmachine(database_dsn, tmp_path, "guide", "show")
    assert shown.code == 0, shown.stderr
    assert shown.stdout == DEFAULT_GUIDE.encode()
    assert "guide version 1 (the built-in guide)" in shown.stderr

    # set FILE: version 2, served at once in every representation.
    path = tmp_path / "guide.md"
    path.write_text(CURATED, encoding="utf-8")
    stored = await toastmachine(database_dsn, tmp_path, "guide", "set", str(path))
    assert stored.code == 0, stored.stderr
    assert re.search(r"^guide version 2 stored\b", stored.stdout.decode(), re.MULTILINE), stored.stdout
    body = await _json(client)
    assert set(body) == {"guide"}
    assert body["guide"]["version"] == 2 and body["guide"]["content"] == CURATED
    assert body["guide"]["format"] == "text/markdown"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", body["guide"]["updated_at"])
    status, text, headers = await _get(client, "text/markdown")
    assert (status, text) == (200, CURATED)
    assert headers["Content-Type"] == "text/markdown; charset=utf-8"
    assert re.fullmatch(r"\w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT", headers["Last-Modified"])
    status, page, _ = await _get(client, "text/html")
    assert status == 200
    assert "<h1>Welcome to the lab corpus</h1>" in page and "<em>parser</em>" in page
    assert "<td>something checkable</td>" in page

    shown = await toastmachine(database_dsn, tmp_path, "guide", "show")
    assert (shown.code, shown.stdout) == (0, CURATED.encode())
    assert "guide version 2" in shown.stderr and "built-in" not in shown.stderr

    # set - (stdin): version 3; CRLF line endings and a byte-order mark are editor habits, not content.
    piped = await toastmachine(database_dsn, tmp_path, "guide", "set", "-",
                               stdin=b"\xef\xbb\xbf# Piped\r\n\r\nfrom stdin\r\n")
    assert piped.code == 0, piped.stderr
    assert (await _json(client))["guide"]["content"] == "# Piped\n\nfrom stdin\n"
    assert (await _json(client))["guide"]["version"] == 3

    # reset: the built-in text again, as a new version (never back to 1).
    reset = await toastmachine(database_dsn, tmp_path, "guide", "reset")
    assert reset.code == 0, reset.stderr
    assert "guide version 4 stored" in reset.stdout.decode()
    guide = (await _json(client))["guide"]
    assert (guide["version"], guide["content"]) == (4, DEFAULT_GUIDE)
    assert "updated_at" in guide

    # A file shown and set again round-trips exactly.
    path.write_bytes((await toastmachine(database_dsn, tmp_path, "guide", "show")).stdout)
    assert (await toastmachine(database_dsn, tmp_path, "guide", "set", str(path))).code == 0
    assert (await current_guide(db)).content == DEFAULT_GUIDE


@pytest.mark.parametrize(("data", "reason"), [
    pytest.param(b"", "empty", id="empty"),
    pytest.param(b" \n\t\n", "empty", id="blank"),
    pytest.param(b"# caf\xe9\n", "not valid UTF-8", id="latin-1"),
    pytest.param(b"# ok\n\nhidden\x00nul\n", "line 3, column 7: control character NUL", id="nul"),
    pytest.param(b"# ok\n\x1b[31mred\n", "line 2, column 1: control character U+001B", id="escape"),
    pytest.param(b"old mac\rline end\n", "control character U+000D", id="lone-cr"),
    pytest.param("\u0085next line\n".encode(), "control character U+0085", id="c1-control"),
    pytest.param(b"x" * (GUIDE_MAX_CHARS + 1), "at most 200,000", id="too-long"),
    pytest.param(b"x" * (4 * GUIDE_MAX_CHARS + 10), "larger than", id="far-too-long"),
])
async def test_invalid_files_are_refused_and_change_nothing(database_dsn: str, db: Database, tmp_path: Path,
                                                            data: bytes, reason: str) -> None:
    await store_guide(db, "# The guide before\n")
    path = tmp_path / "bad.md"
    path.write_bytes(data)
    run = await toastmachine(database_dsn, tmp_path, "guide", "set", str(path))
    assert run.code == 2, run
    assert f"guide not changed: {path}: " in run.stderr and reason in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == b""
    # The same from stdin.
    run = await toastmachine(database_dsn, tmp_path, "guide", "set", "-", stdin=data)
    assert run.code == 2 and "guide not changed: stdin: " in run.stderr and reason in run.stderr, run.stderr
    guide = await current_guide(db)
    assert (guide.version, guide.content) == (2, "# The guide before\n")


async def test_missing_file_and_missing_action_are_usage_errors(database_dsn: str, tmp_path: Path) -> None:
    run = await toastmachine(database_dsn, tmp_path, "guide", "set", str(tmp_path / "nope.md"))
    assert run.code == 2 and "No such file" in run.stderr, run.stderr
    run = await toastmachine(database_dsn, tmp_path, "guide")
    assert run.code == 2 and "ACTION" in run.stderr, run.stderr


def test_parse_guide_file_limits() -> None:
    assert parse_guide_file(b"x" * GUIDE_MAX_CHARS) == "x" * GUIDE_MAX_CHARS
    # Characters, not bytes: the longest guide of 4-byte characters is accepted.
    assert len(parse_guide_file("\U0001f35e".encode() * GUIDE_MAX_CHARS)) == GUIDE_MAX_CHARS
    assert parse_guide_file(b"a\tb\r\nc\n") == "a\tb\nc\n"
    assert parse_guide_file(DEFAULT_GUIDE.encode()) == DEFAULT_GUIDE
    with pytest.raises(GuideRejected, match="empty"):
        parse_guide_file(b"\xef\xbb\xbf\r\n")


# --- versions ------------------------------------------------------------------------------------------


async def test_versions_only_grow(db: Database) -> None:
    assert (await current_guide(db)).builtin
    assert (await store_guide(db, "one")).version == GUIDE_VERSION + 1
    assert (await reset_guide(db)).version == GUIDE_VERSION + 2
    assert (await store_guide(db, "two")).version == GUIDE_VERSION + 3
    # Concurrent stores serialise on the row: every one gets its own version, none is lost.
    results = await asyncio.gather(*(store_guide(db, f"concurrent {i}") for i in range(8)))
    assert sorted(g.version for g in results) == list(range(GUIDE_VERSION + 4, GUIDE_VERSION + 12))
    latest = max(results, key=lambda g: g.version)
    assert await current_guide(db) == latest


async def test_no_route_writes_the_guide(client: TestClient, db: Database) -> None:
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        resp = await client.request(method, "/guide", json={"content": "# mine now"})
        assert resp.status == 405, method
    assert (await current_guide(db)).builtin


# --- negotiation and validators ------------------------------------------------------------------------


async def test_negotiation(client: TestClient, db: Database) -> None:
    await store_guide(db, CURATED)
    browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    for accept, expected in ((None, "application/json"), ("*/*", "application/json"),
                             ("application/json", "application/json"), ("text/markdown", "text/markdown"),
                             ("text/html", "text/html"), (browser, "text/html"),
                             ("text/markdown;q=0.5, text/html", "text/html")):
        status, _, headers = await _get(client, accept)
        assert status == 200, accept
        assert headers["Content-Type"].split(";")[0] == expected, accept
        assert {v.strip() for v in headers["Vary"].split(",")} == {"Accept", "Authorization"}
    for accept in ("application/xml", "image/png, text/plain", "text/html;q=0, application/json;q=0, text/markdown;q=0"):
        resp = await client.get("/guide", headers={"Accept": accept})
        assert resp.status == 406, accept
        body = await resp.json()
        assert body["error"]["code"] == "not_acceptable"
        assert "text/html" in body["error"]["how_to_proceed"]


async def test_etag_and_if_none_match(client: TestClient, db: Database) -> None:
    # The built-in guide: an ETag but no Last-Modified (it was never stored).
    status, _, headers = await _get(client)
    assert status == 200 and "Last-Modified" not in headers
    builtin_tag = headers["ETag"]

    await store_guide(db, CURATED)
    tags = {}
    for accept in ("application/json", "text/markdown", "text/html"):
        status, _, headers = await _get(client, accept)
        tags[accept] = headers["ETag"]
        assert headers["Cache-Control"] == "no-cache"
        resp = await client.get("/guide", headers={"Accept": accept, "If-None-Match": headers["ETag"]})
        assert resp.status == 304, accept
        assert await resp.read() == b""
        assert resp.headers["ETag"] == headers["ETag"]
        assert resp.headers["Last-Modified"] == headers["Last-Modified"]
        assert "Authorization" in resp.headers["Vary"]
    assert len(set(tags.values())) == 3 and builtin_tag not in tags.values()
    assert tags["text/markdown"] == guide_etag(await current_guide(db), "markdown")

    # Weak comparison, lists and "*" match; another representation's or version's tag does not.
    md = tags["text/markdown"]
    for header in (f"W/{md}", f'"nope", {md}', "*"):
        assert (await client.get("/guide", headers={"Accept": "text/markdown", "If-None-Match": header})).status == 304
    for header in (tags["application/json"], builtin_tag, '"nope"'):
        assert (await client.get("/guide", headers={"Accept": "text/markdown", "If-None-Match": header})).status == 200

    # A new version: the old tag no longer matches.
    await store_guide(db, CURATED + "\nMore.\n")
    status, text, headers = await _get(client, "text/markdown", **{"If-None-Match": md})
    assert status == 200 and text.endswith("More.\n") and headers["ETag"] != md


async def test_onboarding_reads_are_never_304(client: TestClient, db: Database) -> None:
    await store_guide(db, CURATED)
    tag = (await _get(client))[2]["ETag"]
    agent = await _register(client)
    auth = {"Authorization": f"Bearer {agent['credential']}"}
    resp = await client.get("/guide", headers={**auth, "If-None-Match": tag})
    assert resp.status == 200
    body = await resp.json()
    assert body["onboarded"] is True and body["guide"]["version"] == 2
    assert resp.headers["ETag"] != tag  # the body differs from the anonymous one
    assert await _onboarded(db, agent["agent_id"])
    # A Markdown read with a credential onboards too, even with a matching tag.
    other = await _register(client)
    md_tag = (await _get(client, "text/markdown"))[2]["ETag"]
    status, text, _ = await _get(client, "text/markdown", Authorization=f"Bearer {other['credential']}",
                                 **{"If-None-Match": md_tag})
    assert (status, text) == (200, CURATED)
    assert await _onboarded(db, other["agent_id"])
    # A bad credential is still refused, whatever the validators say.
    resp = await client.get("/guide", headers={"Authorization": "Bearer tm_wrong", "If-None-Match": "*"})
    assert resp.status == 401


async def test_html_page_neutralises_raw_html(client: TestClient, db: Database) -> None:
    await store_guide(db, CURATED)
    status, page, headers = await _get(client, "text/html")
    assert status == 200
    assert page.startswith("<!DOCTYPE html>")
    assert "<title>ToastMachine usage guide (version 2)</title>" in page
    assert '<a href="/">' in page
    # The <script> line of the Markdown is text on the page, not an element; so is the javascript: link.
    assert "&lt;script&gt;alert(&quot;guide&quot;)&lt;/script&gt;" in page
    assert "<script" not in page.lower()
    assert 'href="javascript' not in page
    assert '<a href="/corpus">a good one</a>' in page
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp and "'unsafe-inline'" not in csp
    assert "frame-ancestors 'none'" in csp and "base-uri 'none'" in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    # The one inline style is the one the policy's hash allows; the page is the same on every request.
    style = re.search(r"<style>(.*?)</style>", page, re.DOTALL)
    assert style is not None
    digest = base64.b64encode(hashlib.sha256(style.group(1).encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp
    assert (await _get(client, "text/html"))[1] == page


# --- onboarding through the whole write path ------------------------------------------------------------


async def test_a_curated_guide_onboards_writers(stack: Stack) -> None:
    """A write before the guide is 428; reading the operator's guide onboards; the identical retry lands."""
    await store_guide(stack.db, CURATED)
    agent = await stack.register(onboard=False)
    body = {"subject": "first", "content": "hello #parsing"}
    token = str(uuid.uuid4())
    refused = await stack.post(agent, "/conversations", body, token=token)
    assert refused.status == 428 and refused.body["error"]["code"] == "onboarding_required"
    resp = await stack.client.get("/guide", headers={**agent.headers(), "Accept": "text/html"})
    assert resp.status == 200 and "Welcome to the lab corpus" in await resp.text()
    created = await stack.post(agent, "/conversations", body, token=token)
    assert created.status == 201, created.body
