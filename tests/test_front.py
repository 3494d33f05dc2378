"""``GET /``: negotiation, identity and recent activity, escaping, CSP; and the live page in real Chromium."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser

import orjson

from actors.web.front import EXCERPT, RECENT
from actors.web.stream import HUB
from infra.config import Settings
from tests.browser import Page, chromium
from tests.corpus_fixtures import Stack
from tests.test_stream import publishing

#: What Chromium and Firefox send for a page navigation.
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
INJECTION = '<img src=x onerror="window.__pwned = 1"><script>window.__pwned = 2</script>&amp; "q" \'s\''


class _Elements(HTMLParser):
    """Every start tag of a document, with its attributes, and whether any end tag was unbalanced."""

    VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "wbr", "source"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.open: list[str] = []
        self.unbalanced: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open.pop() != tag:
            self.unbalanced.append(tag)


def _parse(text: str) -> _Elements:
    parser = _Elements()
    parser.feed(text)
    parser.close()
    return parser


async def test_json_is_the_default_with_identity_links_and_recent_activity(stack: Stack) -> None:
    alice = await stack.register()
    created = await stack.conversation(alice, "first subject", content="root")
    cid = created["conversation"]["id"]
    appended = [await stack.message(alice, cid, content=f"m{i}") for i in range(RECENT + 3)]
    for accept in (None, "application/json", "*/*", "application/*"):
        resp = await stack.client.get("/", headers={"Accept": accept} if accept else {})
        assert resp.status == 200, accept
        assert resp.content_type == "application/json"
        assert resp.headers["Vary"] == "Accept"
        body = await resp.json()
        assert body["corpus_id"] == str(stack.identity.corpus_id)
        assert body["lineage"] == str(stack.identity.lineage)
        assert body["head_sequence"] == appended[-1]["sequence"]
        assert body["links"] == {"self": "/", "guide": "/guide", "conversations": "/conversations",
                                 "messages": "/messages", "agents": "/agents", "tags": "/tags",
                                 "relationships": "/relationships", "openapi": "/openapi.json",
                                 "corpus": "/corpus",
                                 "changes": "/corpus/changes.jsonl", "snapshot": "/corpus/snapshot.jsonl",
                                 "stream": "/corpus/stream", "healthz": "/healthz"}
        # The MCP front has its own origin (TOASTMACHINE_MCP_PUBLIC_URL): its links are absolute.
        mcp_base = Settings().mcp_base_url
        assert body["mcp"] == {"url": mcp_base + "/mcp", "authorization_server": mcp_base,
                               "protected_resource_metadata": mcp_base + "/.well-known/oauth-protected-resource/mcp"}
        recent = body["recent_activity"]
        assert [r["sequence"] for r in recent] == [m["sequence"] for m in reversed(appended)][:RECENT]
        newest = recent[0]
        assert newest["type"] == "message.appended"
        assert newest["author"] == {"agent_id": alice.agent_id, "name": alice.name}
        assert newest["conversation_id"] == cid and newest["subject"] == "first subject"
        assert newest["excerpt"] == f"m{RECENT + 2}" and newest["kinds"] == appended[-1]["message"]["kinds"]
    # Every link the front door names answers.
    for path in body["links"].values():
        if path == "/corpus/stream":
            continue  # an endless response; tests/test_stream.py covers it
        resp = await stack.client.get(path, headers={"Accept": "*/*"})
        assert resp.status == 200, path
        resp.close()


async def test_every_change_type_and_long_content_in_recent_activity(stack: Stack) -> None:
    alice = await stack.register()
    created = await stack.conversation(alice, "s" * 200, content="x" * 5000)
    cid, root = created["conversation"]["id"], created["message"]["id"]
    reply = await stack.message(alice, cid, content="a reply", reply_to=root)
    asserted = await stack.post(alice, "/relationships", {"type": "extends", "source_message_id": reply["message"]["id"],
                                                          "target_message_id": root})
    assert asserted.status == 201, asserted.body
    retracted = await stack.post(alice, f"/relationships/{asserted.body['relationship']['id']}/retractions", {})
    assert retracted.status == 201, retracted.body
    resp = await stack.client.get("/")
    recent = (await resp.json())["recent_activity"]
    assert [r["type"] for r in recent] == ["relationship.retracted", "relationship.asserted",
                                           "message.appended", "conversation.created"]
    assert recent[0]["excerpt"] == "retracted extends" and recent[1]["excerpt"] == "asserted extends"
    assert all(r["author"]["name"] == alice.name for r in recent)
    first = recent[-1]
    assert first["excerpt"] == "x" * EXCERPT + "…" and first["subject"] == "s" * EXCERPT + "…"


async def test_negotiation_browser_gets_html_unknown_types_get_406(stack: Stack) -> None:
    resp = await stack.client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert resp.status == 200 and resp.content_type == "text/html"
    assert resp.charset == "utf-8" and resp.headers["Vary"] == "Accept"
    # The page tells a person where to connect an AI app (the MCP front's URL).
    mcp_url = Settings().mcp_base_url + "/mcp"
    assert f'<a id="mcp-url" href="{mcp_url}">{mcp_url}</a>' in await resp.text()
    resp = await stack.client.get("/", headers={"Accept": "application/json;q=0.5, text/html"})
    assert resp.content_type == "text/html"
    resp = await stack.client.get("/", headers={"Accept": "text/html;q=0.5, application/json"})
    assert resp.content_type == "application/json"
    for accept in ("image/png", "text/markdown", "text/html;q=0, application/json;q=0"):
        resp = await stack.client.get("/", headers={"Accept": accept})
        assert resp.status == 406, accept
        assert resp.headers["Vary"] == "Accept"
        error = (await resp.json())["error"]
        assert error["code"] == "not_acceptable" and "text/html" in error["how_to_proceed"]
    resp = await stack.client.head("/", headers={"Accept": BROWSER_ACCEPT})
    assert resp.status == 200 and resp.content_type == "text/html"


async def test_html_page_escapes_untrusted_text_and_sends_a_nonce_csp(stack: Stack) -> None:
    evil = await stack.register(name="evil")
    created = await stack.conversation(evil, f"subject {INJECTION}", content=f"root {INJECTION}")
    appended = await stack.message(evil, created["conversation"]["id"], content=INJECTION)
    resp = await stack.client.get("/", headers={"Accept": BROWSER_ACCEPT})
    page = await resp.text()
    csp = resp.headers["Content-Security-Policy"]
    nonce = re.search(r"script-src 'nonce-([A-Za-z0-9_-]{16,})'", csp)
    assert nonce is not None, csp
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert page.startswith("<!DOCTYPE html>\n<html lang=\"en\">")
    doc = _parse(page)
    assert not doc.unbalanced and not doc.open, (doc.unbalanced, doc.open)
    tags = [t for t, _ in doc.tags]
    # The untrusted markup is text: no img, exactly one script and one style, both with the nonce.
    assert "img" not in tags
    scripts = [a for t, a in doc.tags if t == "script"]
    styles = [a for t, a in doc.tags if t == "style"]
    assert len(scripts) == 1 and scripts[0] == {"nonce": nonce.group(1)}
    assert len(styles) == 1 and styles[0] == {"nonce": nonce.group(1)}
    assert not [a for _, a in doc.tags if any(k.startswith("on") for k in a)], "an event handler attribute leaked"
    assert html.escape(INJECTION, quote=True) in page
    assert f'data-sequence="{appended["sequence"]}"' in page
    assert 'id="live-feed"' in page and 'id="stream-status"' in page
    assert "<script>" not in page.split("</style>")[1].split("<script nonce")[0]
    # A fresh nonce per response.
    again = await stack.client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert again.headers["Content-Security-Policy"] != csp


async def test_empty_corpus(stack: Stack) -> None:
    body = await (await stack.client.get("/")).json()
    assert body["head_sequence"] == 0 and body["recent_activity"] == []
    page = await (await stack.client.get("/", headers={"Accept": "text/html"})).text()
    assert "No changes yet." in page


async def test_live_feed_in_headless_chromium(stack: Stack) -> None:
    """A real browser follows the page's EventSource: new changes appear, untrusted markup stays text."""
    alice = await stack.register()
    cid = (await stack.conversation(alice, "live subject"))["conversation"]["id"]
    url = str(stack.client.make_url("/"))
    async with publishing(stack), chromium() as browser:
        page = await browser.new_page()
        await page.navigate(url)
        await page.wait_for("document.getElementById('stream-status').textContent === 'live'")
        contents = ["first live message", INJECTION, "third & <b>last</b>"]
        sequences = [(await stack.message(alice, cid, content=c))["sequence"] for c in contents]
        live = await page.wait_for(
            "(() => { const items = [...document.querySelectorAll('#live-feed li[data-source=live]')];"
            f" const want = {orjson.dumps(sequences).decode()};"
            " return want.every(s => items.some(li => li.dataset.sequence === String(s)))"
            " && items.map(li => ({sequence: Number(li.dataset.sequence), type: li.dataset.type,"
            " who: li.querySelector('.who').textContent, excerpt: li.querySelector('.excerpt').textContent})); })()")
        assert [item["sequence"] for item in live] == list(reversed(sequences))  # newest first
        assert [item["excerpt"] for item in live] == list(reversed(contents))
        assert {item["who"] for item in live} == {alice.name} and {i["type"] for i in live} == {"message.appended"}
        # The injection is text: no element was made from it and nothing of it ran.
        assert await page.evaluate("document.querySelectorAll('#live-feed img, #live-feed b, body script').length") == 1
        assert await page.evaluate("window.__pwned === undefined")
        assert await page.evaluate("document.getElementById('stream-status').textContent") == "live"
        # Reloaded, the same changes come from the server-rendered list, still as text.
        await page.navigate(url)
        rendered = await page.evaluate(
            f"document.querySelector('#live-feed li[data-sequence=\"{sequences[1]}\"] .excerpt').textContent")
        assert rendered == INJECTION
        assert await page.evaluate("document.querySelectorAll('#live-feed img').length") == 0
        assert await page.evaluate("window.__pwned === undefined")
        await page.wait_for("document.getElementById('stream-status').textContent === 'live'")
        problems = [line for line in page.log if "Content Security Policy" in line or line.startswith("exception")]
        assert not problems, problems



#: Installed in the page: every state #stream-status takes, in order, so no short-lived one is missed.
_RECORD_STATES = (
    "window.__states = [document.getElementById('stream-status').textContent];"
    " new MutationObserver(() => window.__states.push(document.getElementById('stream-status').textContent))"
    ".observe(document.getElementById('stream-status'), {childList: true, characterData: true, subtree: true});"
    " true")


def _cut_connections(stack: Stack) -> int:
    """Reset every TCP connection the web front holds (the browser's stream among them): a real fault."""
    runner = stack.client.server.runner
    assert runner is not None and runner.server is not None
    cut = 0
    for handler in runner.server.connections:
        if handler.transport is not None:
            handler.transport.abort()
            cut += 1
    return cut


async def _live_sequences(page: Page, until: int) -> list[int]:
    return await page.wait_for(  # type: ignore[no-any-return]
        "(() => { const s = [...document.querySelectorAll('#live-feed li[data-source=live]')]"
        f".map(li => Number(li.dataset.sequence)); return s.includes({until}) && s; }})()")


async def test_live_feed_reconnects_after_a_cut_or_a_stream_error_and_misses_nothing(stack: Stack) -> None:
    """The page shows the outage, resumes after the last sequence it showed, shows each change once."""
    alice = await stack.register()
    cid = (await stack.conversation(alice, "outage subject"))["conversation"]["id"]
    url = str(stack.client.make_url("/"))
    app = stack.client.app
    assert app is not None
    hub = app[HUB]
    async with publishing(stack), chromium() as browser:
        page = await browser.new_page()
        await page.navigate(url)
        await page.wait_for("document.getElementById('stream-status').textContent === 'live'")
        await page.evaluate(_RECORD_STATES)
        shown = [(await stack.message(alice, cid, content="before"))["sequence"]]
        assert await _live_sequences(page, shown[-1]) == shown

        # 1. The connection is reset: the page says so and reconnects by itself.
        assert _cut_connections(stack) >= 1
        await page.wait_for("window.__states.includes('reconnecting')")
        shown += [(await stack.message(alice, cid, content=f"during the cut {i}"))["sequence"] for i in range(3)]
        shown.append((await stack.message(alice, cid, content="after the cut"))["sequence"])
        assert await _live_sequences(page, shown[-1]) == list(reversed(shown))
        await page.wait_for("document.getElementById('stream-status').textContent === 'live'")

        # 2. The node ends the stream with a terminal stream-error (what it does to a slow consumer).
        await page.evaluate("window.__states = []; true")
        assert hub.subscribers >= 1
        for sub in list(hub._subscribers):
            sub.cut_off()
        await page.wait_for("window.__states.includes('reconnecting')")
        title = await page.evaluate("document.getElementById('stream-status').title")
        assert "did not keep up" in title  # the error's public message, shown as the status tooltip
        shown.append((await stack.message(alice, cid, content="after the error"))["sequence"])
        assert await _live_sequences(page, shown[-1]) == list(reversed(shown))
        await page.wait_for("document.getElementById('stream-status').textContent === 'live'")
        states = await page.evaluate("window.__states")
        assert states[:1] == ["reconnecting"] and states[-1] == "live", states
        problems = [line for line in page.log if line.startswith("exception")]
        assert not problems, problems
