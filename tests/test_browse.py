"""The HTML a person browses, driven in headless Chromium (issue 9, items 4 and 7).

Every page's navigation leads to pages (not JSON), each with the node's icon; a message page links
its relationships both ways; the front door's live feed prepends changes written through the API
with their conversation's subject and moves the head sequence; corpus text is bidi-isolated; and
nothing on the way logs a console error, an exception or a Content-Security-Policy violation.
"""

from __future__ import annotations

import struct
from typing import Any

import orjson

from tests.browser import Page, chromium
from tests.corpus_fixtures import Stack, publishing

#: Every link of the top navigation, as each page renders it.
_NAV_LINKS = "[...document.querySelectorAll('nav.top a')].map(a => a.getAttribute('href'))"
_NAV = ["/", "/conversations", "/messages", "/agents", "/tags", "/relationships", "/corpus", "/guide"]


def _problems(page: Page) -> list[str]:
    """What the page logged that a person would call broken: errors, exceptions, CSP refusals."""
    return [line for line in page.log
            if line.startswith(("exception", "console.error", "log.error"))
            or "Content Security Policy" in line or "Failed to load" in line]


async def _is_page(page: Page, url: str) -> dict[str, Any]:
    """Open ``url`` and check it is an HTML page with the navigation and the icon; its facts."""
    await page.navigate(url)
    facts: dict[str, Any] = await page.evaluate(
        "({type: document.contentType, h1: (document.querySelector('h1') || {}).textContent,"
        f" nav: {_NAV_LINKS},"
        " icon: (document.querySelector('link[rel=icon]') || {}).href || null})")
    assert facts["type"] == "text/html", (url, facts)
    assert facts["h1"], (url, facts)
    assert facts["nav"] == _NAV, (url, facts)
    assert facts["icon"] and facts["icon"].endswith("/favicon.svg"), (url, facts)
    return facts


async def _seed(stack: Stack) -> dict[str, Any]:
    alice, bob = await stack.register("alice"), await stack.register("bob")
    root = await stack.conversation(alice, "Is the toast done?", content="It is golden. #toast", kinds=["claim"])
    cid, mid = root["conversation"]["id"], root["message"]["id"]
    check = (await stack.message(bob, cid, content="Checked it: golden. #toast", kinds=["verification"]))["message"]
    supports = await stack.post(bob, "/relationships", {"type": "supports", "source_message_id": check["id"],
                                                        "target_message_id": mid})
    assert supports.status == 201, supports.body
    return {"alice": alice, "bob": bob, "cid": cid, "root": root["message"], "check": check}


async def test_every_nav_link_of_every_page_is_a_page(stack: Stack) -> None:
    seed = await _seed(stack)
    base = str(stack.client.make_url("/")).rstrip("/")
    pages = [*_NAV, f"/conversations/{seed['cid']}", f"/messages/{seed['root']['id']}", "/agents/alice",
             "/search?q=golden", "/search", "/search?q=%20", "/messages?tag=toast"]
    async with chromium() as browser:
        page = await browser.new_page()
        for path in pages:
            await _is_page(page, base + path)
        # Following each link of the navigation, as a person clicks it, lands on a page too.
        await page.navigate(base + "/")
        for index, href in enumerate(_NAV):
            await page.navigate(base + "/")
            await page.evaluate(f"document.querySelectorAll('nav.top a')[{index}].click(); true")
            await page.wait_for(f"location.pathname === {orjson.dumps(href).decode()}"
                                " && document.readyState === 'complete'")
            assert await page.evaluate("document.contentType") == "text/html", href
        # The search box of the navigation submits to the search page (allowed by every page's CSP).
        await page.navigate(base + "/tags")
        await page.evaluate("document.querySelector('nav.top input[name=q]').value = 'golden';"
                            " document.querySelector('nav.top form').submit(); true")
        await page.wait_for("location.pathname === '/search' && document.readyState === 'complete'")
        found = await page.evaluate("[...document.querySelectorAll('article.message .content')].map(e => e.textContent)")
        assert sorted(found) == ["Checked it: golden. #toast", "It is golden. #toast"]
        assert await page.evaluate("document.querySelector('nav.top input[name=q]').value") == "golden"
        # An empty search is the form with a line saying what to do, not an error document.
        await page.navigate(base + "/search?q=")
        notice = await page.evaluate("document.querySelector('.notice').textContent")
        assert notice.startswith("Type one or more words")
        await page.evaluate("document.querySelector('main form.search input[name=q]').value = 'checked';"
                            " document.querySelector('main form.search').submit(); true")
        await page.wait_for("location.search === '?q=checked' && document.readyState === 'complete'")
        assert await page.evaluate("document.querySelectorAll('article.message').length") == 1
        # The icon itself: an SVG document Chromium renders.
        await page.navigate(base + "/favicon.svg")
        assert await page.evaluate("document.contentType") == "image/svg+xml"
        assert await page.evaluate("document.documentElement.tagName") == "svg"
        assert not _problems(page), _problems(page)
    ico = await stack.client.get("/favicon.ico")
    body = await ico.read()
    assert ico.status == 200 and ico.content_type == "image/x-icon"
    reserved, kind, count = struct.unpack("<HHH", body[:6])
    assert (reserved, kind, count) == (0, 1, 1) and body[22:30] == b"\x89PNG\r\n\x1a\n"
    svg = await stack.client.get("/favicon.svg", headers={"If-None-Match": '"stale"'})
    assert svg.status == 200 and svg.content_type == "image/svg+xml"
    again = await stack.client.get("/favicon.svg", headers={"If-None-Match": svg.headers["ETag"]})
    assert again.status == 304


async def test_a_message_page_links_its_relationships_both_ways(stack: Stack) -> None:
    seed = await _seed(stack)
    base = str(stack.client.make_url("/")).rstrip("/")
    root, check = seed["root"], seed["check"]
    async with chromium() as browser:
        page = await browser.new_page()
        await _is_page(page, f"{base}/messages/{root['id']}")
        about = await page.evaluate(
            "[...document.querySelectorAll('#relationships [data-direction=incoming] li')].map(li =>"
            " ({type: li.dataset.type, links: [...li.querySelectorAll('a')].map(a => a.getAttribute('href')),"
            " text: li.textContent}))")
        assert len(about) == 1 and about[0]["type"] == "supports", about
        assert about[0]["links"][0] == f"/messages/{check['id']}" and "Checked it: golden." in about[0]["text"]
        label = await page.evaluate("document.querySelector('#relationships [data-direction=incoming] p').textContent")
        assert label == "Supported by"
        # Follow the link to the supporting message: its page says what it supports, linking back.
        await page.evaluate("document.querySelector('#relationships [data-direction=incoming] li a').click(); true")
        await page.wait_for(f"location.pathname === '/messages/{check['id']}' && document.readyState === 'complete'")
        back = await page.evaluate(
            "({label: document.querySelector('#relationships [data-direction=outgoing] p').textContent,"
            " href: document.querySelector('#relationships [data-direction=outgoing] li a').getAttribute('href')})")
        assert back == {"label": "Supports", "href": f"/messages/{root['id']}"}
        # And the full list of the message's relationships is a page too.
        await page.evaluate("document.querySelector('#relationships > p.meta a').click(); true")
        await page.wait_for("location.pathname === '/relationships' && document.readyState === 'complete'")
        rows = await page.evaluate("document.querySelectorAll('tbody tr').length")
        assert rows == 1 and await page.evaluate("document.contentType") == "text/html"
        assert not _problems(page), _problems(page)


async def test_live_feed_shows_subjects_and_moves_the_head(stack: Stack) -> None:
    """Changes written through the API appear first in the feed, with their subject, whichever kind
    of change brings them and whether or not the page knew the conversation."""
    alice, bob = await stack.register("alice"), await stack.register("bob")
    old = await stack.conversation(alice, "An older conversation", content="from before")
    # Enough later changes that the old conversation is not among those the page renders.
    busy = (await stack.conversation(bob, "A busy conversation", content="one"))["conversation"]["id"]
    for i in range(22):
        await stack.message(bob, busy, content=f"filler {i}")
    base = str(stack.client.make_url("/")).rstrip("/")
    async with publishing(stack), chromium() as browser:
        page = await browser.new_page()
        await page.navigate(base + "/")
        await page.wait_for("document.getElementById('stream-status').textContent === 'live'")
        rendered = await page.evaluate(
            "[...document.querySelectorAll('#live-feed li')].map(li => li.querySelector('.subject').textContent)")
        assert "An older conversation" not in rendered and set(rendered) == {"A busy conversation"}

        written: list[tuple[int, str, str]] = []  # (sequence, type, subject)
        fresh = await stack.conversation(alice, "A fresh <b>subject</b>", content="new here")
        written.append((fresh["sequence"], "conversation.created", "A fresh <b>subject</b>"))
        for cid, subject in ((busy, "A busy conversation"), (old["conversation"]["id"], "An older conversation"),
                             (fresh["conversation"]["id"], "A fresh <b>subject</b>")):
            written.append(((await stack.message(alice, cid, content="live"))["sequence"], "message.appended", subject))
        asserted = await stack.post(alice, "/relationships", {
            "type": "extends", "source_message_id": old["message"]["id"],
            "target_message_id": fresh["message"]["id"]})
        assert asserted.status == 201, asserted.body
        written.append((asserted.body["sequence"], "relationship.asserted", "An older conversation"))
        retracted = await stack.post(alice, f"/relationships/{asserted.body['relationship']['id']}/retractions", {})
        assert retracted.status == 201, retracted.body
        written.append((retracted.body["sequence"], "relationship.retracted", "An older conversation"))

        want = orjson.dumps([s for s, _, _ in written]).decode()
        live = await page.wait_for(
            "(() => { const items = [...document.querySelectorAll('#live-feed li[data-source=live]')];"
            f" const want = {want};"
            " const ok = want.every(s => items.some(li => li.dataset.sequence === String(s)"
            " && li.querySelector('.subject')));"
            " return ok && items.map(li => ({sequence: Number(li.dataset.sequence), type: li.dataset.type,"
            " subject: li.querySelector('.subject').textContent,"
            " href: li.querySelector('.subject').getAttribute('href'), dir: li.querySelector('.subject').dir})); })()")
        newest_first = list(reversed(written))
        assert [(i["sequence"], i["type"], i["subject"]) for i in live] == newest_first
        conversation_of = {"A busy conversation": busy, "An older conversation": old["conversation"]["id"],
                           "A fresh <b>subject</b>": fresh["conversation"]["id"]}
        assert [i["href"] for i in live] == [f"/conversations/{conversation_of[s]}" for _, _, s in newest_first]
        assert {i["dir"] for i in live} == {"auto"}
        # The newest change is first in the list, and the head sequence moved to it.
        first = await page.evaluate("document.querySelector('#live-feed li').dataset.sequence")
        assert first == str(written[-1][0])
        await page.wait_for(f"document.getElementById('head-sequence').textContent === '{written[-1][0]}'")
        assert await page.evaluate("document.querySelectorAll('#live-feed b').length") == 0
        assert not _problems(page), _problems(page)


async def test_corpus_text_cannot_reorder_the_page(stack: Stack) -> None:
    """Every text node holding right-to-left or override characters is alone in its bidi isolate.

    Text is reordered within one paragraph, up to the nearest isolate (``<bdi>``, ``dir``) or block
    boundary; corpus text that shares that run with other text (a feed line: sequence, type, author,
    subject, excerpt) can drag its neighbours, so the element that isolates it must hold it alone.
    """
    mallory = await stack.register("mallory")
    root = await stack.conversation(mallory, "مرحبا بالعالم", content="see \u202egnp.exe now #toast")
    cid, mid = root["conversation"]["id"], root["message"]["id"]
    await stack.message(mallory, cid, content="\u202bembedded right-to-left", payload={"name": "\u202eevil"})
    other = await stack.message(mallory, cid, content="about it")
    rel = await stack.post(mallory, "/relationships", {"type": "extends", "source_message_id": other["message"]["id"],
                                                       "target_message_id": mid})
    assert rel.status == 201, rel.body
    base = str(stack.client.make_url("/")).rstrip("/")
    check = (
        "(() => { const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);"
        " const bad = [], seen = []; let node;"
        " const bounds = el => { const style = getComputedStyle(el);"
        "   return ['isolate', 'plaintext', 'isolate-override'].includes(style.unicodeBidi)"
        "     || !style.display.startsWith('inline'); };"
        " while ((node = walker.nextNode())) {"
        "   if (!/[\\u0590-\\u08ff\\u202a-\\u202e\\u2066-\\u2069]/.test(node.data)) continue;"
        "   seen.push(node.data);"
        "   let el = node.parentElement;"
        "   while (el && !bounds(el)) el = el.parentElement;"
        "   if (!el || el.textContent.trim() !== node.data.trim()) bad.push([node.data, el && el.textContent]);"
        " }"
        " return {bad, seen}; })()")
    async with chromium() as browser:
        page = await browser.new_page()
        for path in ("/", "/conversations", f"/conversations/{cid}", f"/messages/{mid}",
                     f"/messages/{other['message']['id']}", "/messages", "/search?q=see"):
            await page.navigate(base + path)
            result = await page.evaluate(check)
            assert result["seen"], path
            assert not result["bad"], (path, result["bad"])
        assert not _problems(page), _problems(page)
