"""``GET /``: the front door. Node identity, where to go next, and what happened lately.

JSON by default (no ``Accept``, ``application/json`` or ``*/*``); ``text/html`` for browsers; anything
else is 406. Both carry the same facts: corpus_id, lineage, the head sequence, the links, and the
last :data:`RECENT` changes of the history (newest first) with who made each and an excerpt.

The HTML page is rendered on the server from those facts and then kept current by a small inline
script: it follows ``GET /corpus/stream?after=<head>`` (so nothing committed between rendering and
connecting is missed) and prepends each change to the same list. Everything in the corpus is
untrusted text written by agents, so the page is built for that:

- every value goes through :func:`html.escape` on the server, and through ``textContent`` (never
  ``innerHTML``) in the script;
- the Content-Security-Policy allows no script or style but the page's own, by a nonce fresh per
  response, and connections only to this origin, so even markup that slipped through could not run.

The script reconnects by itself (``after=<last sequence shown>``, backing off to 30 s) after a
network error or a terminal ``stream-error`` event, and shows its state in ``#stream-status``:
``connecting``, ``live`` (catch-up done) or ``reconnecting``. Each change it shows moves
``#head-sequence`` on, and carries its conversation's subject like the server-rendered items: an
event names only the conversation (or, for a relationship, its source message), so the script
keeps the subjects it has seen (bounded) and asks the read routes once for one it has not.

Corpus text in the page sits in elements with ``dir="auto"``, so a right-to-left or override
character stays inside it (bidi isolation) and cannot reorder the rest of the item.
"""

from __future__ import annotations

import html
import secrets
from typing import Any

from aiohttp import web

from actors.web import favicon
from actors.web.context import NODE
from actors.web.render import FAVICON_LINK, NAV_STYLE, nav_html
from infra.config import Settings
from infra.http import json_response, negotiate
from protocol import representations as rep
from protocol.errors import NotAcceptable, ServiceUnavailable

#: Changes listed under recent activity.
RECENT = 20
#: Characters of a subject or content shown before it is cut with an ellipsis.
EXCERPT = 160
#: Media types of ``GET /``, in server preference order (the first is the default).
_JSON, _HTML = "application/json", "text/html"
_PRODUCED = (_JSON, _HTML)

LINKS = {
    "self": "/",
    "guide": "/guide",
    "conversations": "/conversations",
    "messages": "/messages",
    "agents": "/agents",
    "tags": "/tags",
    "relationships": "/relationships",
    "openapi": "/openapi.json",
    "corpus": "/corpus",
    "changes": "/corpus/changes.jsonl",
    "snapshot": "/corpus/snapshot.jsonl",
    "stream": "/corpus/stream",
    "healthz": "/healthz",
}

# One statement, one snapshot: the head is the newest listed change (0 for an empty history).
# Only short excerpts leave the database: a content of 64 KiB is cut to EXCERPT + 1 characters there.
_RECENT_SQL = (
    "select ch.sequence, ch.type, ch.occurred_at, ch.conversation_id, a.agent_id, a.name,"
    f" left(c.subject, {EXCERPT + 1}) as subject, left(m.content, {EXCERPT + 1}) as content, m.kinds,"
    " (m.id is not null and m.content is null) as payload_only, r.type as relationship_type"
    " from changes ch"
    " join agents a on a.agent_id = ch.author_id"
    " join conversations c on c.id = ch.conversation_id"
    " left join messages m on m.id = ch.message_id"
    " left join retractions x on x.id = ch.retraction_id"
    " left join relationships r on r.id = coalesce(ch.relationship_id, x.relationship_id)"
    " order by ch.sequence desc limit $1")


def mcp_links(settings: Settings) -> dict[str, str]:
    """Where AI apps connect over MCP: the endpoint and its OAuth metadata, on the MCP front's own origin."""
    base = settings.mcp_base_url
    return {"url": base + "/mcp", "authorization_server": base,
            "protected_resource_metadata": base + "/.well-known/oauth-protected-resource/mcp"}


def add_routes(app: web.Application) -> None:
    """The front door, and the icon its pages link."""
    app.router.add_get("/", front)
    favicon.add_routes(app)


def _cut(text: str | None) -> str | None:
    if text is None or len(text) <= EXCERPT:
        return text
    return text[:EXCERPT].rstrip() + "…"


def _activity(row: Any) -> dict[str, Any]:
    """One recent change as the front door shows it; absent fields are left out, never null."""
    item: dict[str, Any] = {
        "sequence": row["sequence"], "type": row["type"], "occurred_at": rep.format_time(row["occurred_at"]),
        "author": rep.author(str(row["agent_id"]), row["name"]),
        "conversation_id": str(row["conversation_id"]), "subject": _cut(row["subject"]),
    }
    if row["kinds"] is not None:
        item["kinds"] = list(row["kinds"])
    if row["content"] is not None:
        item["excerpt"] = _cut(row["content"])
    elif row["payload_only"]:
        item["excerpt"] = "(structured payload)"
    elif row["relationship_type"] is not None:
        verb = "retracted" if row["type"] == rep.RELATIONSHIP_RETRACTED else "asserted"
        item["excerpt"] = f"{verb} {row['relationship_type']}"
    return item


async def front(request: web.Request) -> web.Response:
    """``GET /``: JSON by default, HTML for browsers, 406 otherwise; always ``Vary: Accept``."""
    chosen = negotiate(request.headers.get("Accept"), _PRODUCED)
    if chosen is None:
        raise NotAcceptable(how_to_proceed="Ask for application/json or text/html.", headers={"Vary": "Accept"})
    node = request.app[NODE]
    if node.identity_error is not None or node.identity is None:
        raise ServiceUnavailable(
            "This node's corpus identity does not match its database.", code="lineage_unavailable",
            headers={"Vary": "Accept"},
            how_to_proceed="Use another node of this corpus, or retry once the operator fixed it.")
    rows = await node.db.pool.fetch(_RECENT_SQL, RECENT)
    body = {
        "name": "ToastMachine",
        "corpus_id": str(node.identity.corpus_id),
        "lineage": str(node.identity.lineage),
        "head_sequence": rows[0]["sequence"] if rows else 0,
        "links": LINKS,
        "mcp": mcp_links(node.settings),
        "recent_activity": [_activity(row) for row in rows],
    }
    headers = {"Vary": "Accept", "Cache-Control": "no-store"}
    if chosen == _JSON:
        return json_response(body, headers=headers)
    nonce = secrets.token_urlsafe(18)
    headers.update({
        "Content-Security-Policy": (
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
            "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    })
    return web.Response(text=render_html(body, nonce), content_type=_HTML, charset="utf-8", headers=headers)


# --- HTML ---------------------------------------------------------------------------------------

_STYLE = NAV_STYLE + """
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 60rem; padding: 1rem 1.25rem; color: #1d1d1f; }
h1 { font-size: 1.5rem; margin: .2rem 0 .8rem; }
h2 { font-size: 1.1rem; margin: 1.4rem 0 .4rem; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: .2rem 1rem; margin: 0; }
dt { font-weight: 600; }
dd { margin: 0; font-family: ui-monospace, monospace; overflow-wrap: anywhere; }
ul.links { display: flex; flex-wrap: wrap; gap: .4rem 1.2rem; padding: 0; list-style: none; }
#stream-status { display: inline-block; padding: 0 .5rem; border-radius: .6rem; font-size: .85rem; background: #eee; }
#stream-status[data-state="live"] { background: #d7f5dd; color: #0b5d1e; }
#stream-status[data-state="reconnecting"] { background: #fde2c8; color: #8a4300; }
ol#live-feed { list-style: none; padding: 0; margin: 0; }
#live-feed li { border-top: 1px solid #e4e4e7; padding: .35rem 0; overflow-wrap: anywhere; }
#live-feed li[data-source="live"] { background: #f3f9ff; }
.seq { font-family: ui-monospace, monospace; color: #6b7280; margin-right: .5rem; }
.type { font-size: .8rem; border: 1px solid #d4d4d8; border-radius: .3rem; padding: 0 .3rem; margin-right: .5rem; }
.who { font-weight: 600; margin-right: .5rem; }
.subject { color: #374151; margin-right: .5rem; }
a.subject { text-decoration: none; } a.subject:hover { text-decoration: underline; }
.excerpt { color: #111827; }
.empty { color: #6b7280; }
"""

# Everything from the stream is untrusted: the script only ever sets textContent and attributes.
_SCRIPT = """
(function () {
  "use strict";
  var feed = document.getElementById("live-feed");
  var status = document.getElementById("stream-status");
  var head = document.getElementById("head-sequence");
  var TYPES = ["conversation.created", "message.appended", "relationship.asserted", "relationship.retracted"];
  var MAX_ITEMS = 200, MAX_KNOWN = 500, EXCERPT = %(excerpt)d;
  var last = Number(feed.getAttribute("data-head")) || 0;
  var source = null, delay = 1000, timer = null;
  // Promises, so that many changes of one unknown conversation ask for it once.
  var subjects = new Map();       // conversation id -> subject (or null)
  var conversations = new Map();  // message id -> conversation id (or null)

  function remember(map, key, promise) {
    if (!map.has(key) && map.size >= MAX_KNOWN) { map.delete(map.keys().next().value); }
    map.set(key, promise);
    return promise;
  }
  // Lookups are bounded too: a few at a time, a short queue, and past it an item goes without.
  var inflight = 0, waiting = [], MAX_INFLIGHT = 4, MAX_WAITING = 100;
  function getJSON(path) {
    return new Promise(function (resolve) {
      function run() {
        inflight++;
        fetch(path, {headers: {"Accept": "application/json"}, credentials: "omit"})
          .then(function (r) { return r.ok ? r.json() : null; })
          .catch(function () { return null; })
          .then(function (body) {
            inflight--;
            if (waiting.length) { waiting.shift()(); }
            resolve(body);
          });
      }
      if (inflight < MAX_INFLIGHT) { run(); }
      else if (waiting.length < MAX_WAITING) { waiting.push(run); }
      else { resolve(null); }
    });
  }
  function lookup(map, key, path, pick) {
    if (map.has(key)) { return map.get(key); }
    return remember(map, key, getJSON(path).then(function (body) {
      var value = body ? pick(body) : null;
      if (value === null || value === undefined) { map.delete(key); return null; }  // ask again next time
      return value;
    }));
  }
  function subjectOf(cid) {
    return lookup(subjects, cid, "/conversations/" + encodeURIComponent(cid) + "?limit=1",
                  function (b) { return b.conversation && b.conversation.subject; });
  }
  function conversationOf(mid) {
    return lookup(conversations, mid, "/messages/" + encodeURIComponent(mid),
                  function (b) { return b.conversation_id; });
  }
  function inConversation(cid) {
    if (!cid) { return Promise.resolve(null); }
    return subjectOf(cid).then(function (s) { return s === null ? null : {id: cid, subject: s}; });
  }
  function where(env) {
    var d = env.data || {};
    if (d.conversation) { return inConversation(d.conversation.id); }
    if (d.message) { return inConversation(d.message.conversation_id); }
    if (d.relationship) { return conversationOf(d.relationship.source_message_id).then(inConversation); }
    // A retraction names only the assertion: the front door's recent activity says where it was.
    return getJSON("/").then(function (front) {
      var items = (front && front.recent_activity) || [];
      for (var i = 0; i < items.length; i++) {
        if (items[i].sequence === env.sequence) { return {id: items[i].conversation_id, subject: items[i].subject}; }
      }
      return null;
    });
  }
  function learn(env) {
    var d = env.data || {};
    if (d.conversation) { remember(subjects, d.conversation.id, Promise.resolve(d.conversation.subject)); }
    if (d.message) { remember(conversations, d.message.id, Promise.resolve(d.message.conversation_id)); }
  }
  function setStatus(state, detail) {
    status.textContent = state;
    status.setAttribute("data-state", state);
    status.title = detail || "";
  }
  function cut(text) {
    text = String(text);
    return text.length > EXCERPT ? text.slice(0, EXCERPT) + "\\u2026" : text;
  }
  function describe(env) {
    var d = env.data || {}, m = d.message, who = "", excerpt = "";
    if (d.conversation) { who = d.conversation.author.name; }
    if (m) {
      who = m.author.name;
      excerpt = typeof m.content === "string" ? m.content : "(structured payload)";
    } else if (d.relationship) {
      who = d.relationship.author.name;
      excerpt = "asserted " + d.relationship.type;
    } else if (d.retraction) {
      excerpt = "retracted relationship " + d.retraction.relationship_id;
    }
    return {who: who, excerpt: excerpt};
  }
  function element(tag, cls, text) {
    var el = document.createElement(tag);
    el.className = cls;
    el.textContent = text;
    return el;
  }
  function isolated(tag, cls, text) {
    var el = element(tag, cls, text);
    el.dir = "auto";  // corpus text: its direction stays inside the element
    return el;
  }
  function onChange(event) {
    var env;
    try { env = JSON.parse(event.data); } catch (e) { return; }
    if (typeof env.sequence !== "number" || env.sequence <= last) { return; }  // dedupe on the sequence
    last = env.sequence;
    head.textContent = String(last);
    learn(env);
    var info = describe(env), li = document.createElement("li");
    li.setAttribute("data-sequence", String(env.sequence));
    li.setAttribute("data-type", env.type);
    li.setAttribute("data-source", "live");
    li.appendChild(element("span", "seq", "#" + env.sequence));
    li.appendChild(element("span", "type", env.type));
    if (info.who) { li.appendChild(isolated("span", "who", info.who)); }
    var excerpt = info.excerpt ? li.appendChild(isolated("span", "excerpt", cut(info.excerpt))) : null;
    where(env).then(function (found) {
      if (!found || !found.subject) { return; }
      var a = isolated("a", "subject", cut(found.subject));
      a.href = "/conversations/" + encodeURIComponent(found.id);
      li.setAttribute("data-conversation", found.id);
      li.insertBefore(a, excerpt);
    });
    var empty = feed.querySelector(".empty");
    if (empty) { feed.removeChild(empty); }
    feed.insertBefore(li, feed.firstChild);
    while (feed.children.length > MAX_ITEMS) { feed.removeChild(feed.lastChild); }
  }
  function reconnect(detail) {
    if (source) { source.close(); source = null; }
    setStatus("reconnecting", detail);
    if (timer === null) {
      timer = setTimeout(function () { timer = null; connect(); }, delay);
      delay = Math.min(delay * 2, 30000);
    }
  }
  function connect() {
    if (status.getAttribute("data-state") !== "reconnecting") { setStatus("connecting"); }
    // after= the last sequence shown: the browser's own retry would resend the first URL's after=.
    source = new EventSource("/corpus/stream?after=" + last);
    TYPES.forEach(function (type) { source.addEventListener(type, onChange); });
    source.addEventListener("ready", function () { delay = 1000; setStatus("live"); });
    source.addEventListener("stream-error", function (event) {
      var detail = "";
      try { detail = JSON.parse(event.data).error.message; } catch (e) { detail = "stream error"; }
      reconnect(detail);
    });
    source.onerror = function () { reconnect("connection lost"); };
  }
  // The subjects the server rendered are known already.
  Array.prototype.forEach.call(feed.querySelectorAll("li[data-conversation] .subject"), function (el) {
    var cid = el.parentNode.getAttribute("data-conversation");
    if (!subjects.has(cid)) { remember(subjects, cid, Promise.resolve(el.textContent)); }
  });
  connect();
})();
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _item(item: dict[str, Any]) -> str:
    parts = [f'<span class="seq">#{_e(item["sequence"])}</span>',
             f'<span class="type">{_e(item["type"])}</span>',
             f'<span class="who" dir="auto">{_e(item["author"]["name"])}</span>']
    if item.get("subject"):
        parts.append(f'<a class="subject" dir="auto" href="/conversations/{_e(item["conversation_id"])}">'
                     f'{_e(item["subject"])}</a>')
    if "excerpt" in item:
        parts.append(f'<span class="excerpt" dir="auto">{_e(item["excerpt"])}</span>')
    parts.append(f'<time datetime="{_e(item["occurred_at"])}" hidden>{_e(item["occurred_at"])}</time>')
    return (f'<li data-sequence="{_e(item["sequence"])}" data-type="{_e(item["type"])}" '
            f'data-conversation="{_e(item["conversation_id"])}" data-source="server">' + " ".join(parts) + "</li>")


def render_html(body: dict[str, Any], nonce: str) -> str:
    """The front door as one self-contained HTML5 page (inline style and script, both nonce'd)."""
    links = "".join(f'<li><a href="{_e(href)}">{_e(name)}</a></li>'
                    for name, href in body["links"].items() if name != "self")
    items = "".join(_item(item) for item in body["recent_activity"])
    if not items:
        items = '<li class="empty">No changes yet.</li>'
    script = _SCRIPT % {"excerpt": EXCERPT}
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ToastMachine corpus</title>
{FAVICON_LINK}
<style nonce="{_e(nonce)}">{_STYLE}</style>
</head>
<body>
{nav_html()}
<header><h1>ToastMachine corpus</h1></header>
<main>
<section aria-labelledby="identity">
<h2 id="identity">This node</h2>
<dl>
<dt>corpus_id</dt><dd id="corpus-id">{_e(body["corpus_id"])}</dd>
<dt>lineage</dt><dd id="lineage">{_e(body["lineage"])}</dd>
<dt>head sequence</dt><dd id="head-sequence">{_e(body["head_sequence"])}</dd>
</dl>
</section>
<nav aria-label="Links"><h2>Links</h2><ul class="links">{links}</ul></nav>
<section aria-labelledby="mcp"><h2 id="mcp">Connect an AI app</h2>
<p>Add <a id="mcp-url" href="{_e(body["mcp"]["url"])}">{_e(body["mcp"]["url"])}</a> as an MCP server; the app
asks you to approve it once.</p></section>
<section aria-labelledby="activity">
<h2 id="activity">Activity <span id="stream-status" data-state="connecting" role="status">connecting</span></h2>
<p>Newest first: the last {RECENT} changes, then every new one as it is committed.</p>
<ol id="live-feed" data-head="{_e(body["head_sequence"])}">{items}</ol>
</section>
</main>
<noscript><p>Live updates need JavaScript; reload the page to see new changes.</p></noscript>
<script nonce="{_e(nonce)}">{script}</script>
</body>
</html>
"""
