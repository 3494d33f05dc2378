"""Content negotiation and the representations of the read routes (SPEC §3).

A read handler builds a :class:`Document` (the JSON body and what kind of thing it is) and hands
it to :func:`respond`, which renders it in the negotiated media type:

- ``application/json`` (the default): the body as is;
- ``application/ld+json``: the same body with ``@context`` (:data:`JSONLD_CONTEXT`, documented in
  the README), ``@type`` and ``@id`` added, collections as ``ItemList``;
- ``text/markdown``: a readable summary for agents that prefer text;
- ``text/html`` (on the routes people browse): a server-rendered page, no script, linking
  conversations, messages, agents, tags and relationships to each other. Corpus text (subjects,
  content, names, tags, descriptions) is escaped and bidi-isolated (``<bdi>``, ``dir="auto"``), so
  a right-to-left or override character in it cannot reorder the page around it.

Anything else is 406. Every answer carries ``Vary: Accept``, an ``ETag`` (a hash of the rendered
bytes and their type) honoured by ``If-None-Match`` with 304, ``Link`` rel next/prev for pages, and
``X-Next-Cursor`` where the next page is reached by a sequence cursor.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from email.utils import format_datetime
from typing import Any
from urllib.parse import quote, urlencode

import orjson
from aiohttp import web

from infra.http import etag_matches, negotiate
from protocol.errors import NotAcceptable

JSON = "application/json"
JSONLD = "application/ld+json"
MARKDOWN = "text/markdown"
HTML = "text/html"
#: Media types of the read routes, in server preference order (JSON first: it is the default).
DATA_TYPES = (JSON, JSONLD, MARKDOWN)
BROWSABLE_TYPES = (JSON, JSONLD, MARKDOWN, HTML)

#: The JSON-LD context of every read representation: schema.org terms where one fits, the
#: corpus's own vocabulary (``tm:``) for the rest. Ids stay plain strings (``identifier``).
VOCAB = "https://toastmachine.dev/vocab#"
JSONLD_CONTEXT: dict[str, Any] = {
    "@vocab": VOCAB,
    "schema": "https://schema.org/",
    "xsd": "http://www.w3.org/2001/XMLSchema#",
    "id": "schema:identifier",
    "agent_id": "schema:identifier",
    "name": "schema:name",
    "description": "schema:description",
    "subject": "schema:headline",
    "content": "schema:text",
    "author": "schema:author",
    "created_at": {"@id": "schema:dateCreated", "@type": "xsd:dateTime"},
    "items": {"@id": "schema:itemListElement", "@container": "@list"},
    "total": "schema:numberOfItems",
    "next": {"@id": "tm:next", "@type": "@id"},
    "prev": {"@id": "tm:prev", "@type": "@id"},
    "payload": {"@id": "tm:payload", "@type": "@json"},
    "tm": VOCAB,
}

#: schema.org types of the documents, by :attr:`Document.kind`.
_LD_TYPES = {
    "conversation": "schema:Conversation", "message": "schema:Message", "agent": "schema:Person",
    "relationship": "tm:Relationship", "tag": "schema:DefinedTerm", "corpus": "schema:Dataset",
    "archive": "schema:DataCatalog",
}


@dataclass(slots=True)
class Document:
    """What a read route answers, before rendering.

    ``kind`` names the record type (``message``, ``conversation``, ``agent``, ``relationship``,
    ``tag``, ``search``, ``corpus``); ``collection`` says whether ``body`` is ``{items, next, ...}``.
    ``links`` holds the next/prev URLs (relative) for the ``Link`` header; ``cursor`` the next page's
    sequence cursor (``X-Next-Cursor``); ``headers`` any further headers of the route.

    The HTML page alone may show more than the body: ``notice`` (a line for the reader, e.g. why a
    search shows no results), ``search`` (the words to keep in the search box) and ``related`` (a
    message's relationships with the other message of each, see :func:`related_message`).
    """

    kind: str
    body: dict[str, Any]
    title: str
    collection: bool = False
    links: dict[str, str | None] = field(default_factory=dict)
    cursor: int | None = None
    last_modified: datetime | None = None
    cache_control: str = "no-cache"
    headers: dict[str, str] = field(default_factory=dict)
    notice: str | None = None
    search: str | None = None
    related: list[dict[str, Any]] | None = None


def choose(request: web.Request, produced: tuple[str, ...] = DATA_TYPES) -> str:
    """The negotiated media type of this request, or 406 listing what the route produces."""
    chosen = negotiate(request.headers.get("Accept"), produced)
    if chosen is None:
        raise NotAcceptable(how_to_proceed=f"Ask for one of: {', '.join(produced)}.", headers={"Vary": "Accept"})
    return chosen


def respond(request: web.Request, doc: Document, media: str) -> web.Response:
    """Render ``doc`` as ``media`` with the caching and paging headers; 304 when the ETag matches."""
    if media == JSON:
        body = orjson.dumps(doc.body)
    elif media == JSONLD:
        body = orjson.dumps(to_jsonld(doc, request))
    elif media == MARKDOWN:
        body = to_markdown(doc).encode()
    else:
        body = to_html(doc).encode()
    etag = '"' + hashlib.sha256(media.encode() + b"\0" + body).hexdigest()[:32] + '"'
    headers = {**doc.headers, "Vary": "Accept", "ETag": etag, "Cache-Control": doc.cache_control}
    link = ", ".join(f'<{url}>; rel="{rel}"' for rel, url in doc.links.items() if url)
    if link:
        headers["Link"] = link
    if doc.cursor is not None:
        headers["X-Next-Cursor"] = str(doc.cursor)
    if doc.last_modified is not None:
        headers["Last-Modified"] = format_datetime(doc.last_modified, usegmt=True)
    if etag_matches(request.headers.get("If-None-Match"), etag):
        return web.Response(status=304, headers=headers)
    if media == HTML:
        headers.update(_PAGE_HEADERS)
    return web.Response(body=body, headers=headers, content_type=media, charset="utf-8")


def link(path: str, query: dict[str, str] | None = None) -> str:
    """A relative URL with its query string."""
    return f"{path}?{urlencode(query)}" if query else path


# --- JSON-LD -------------------------------------------------------------------------------------


def to_jsonld(doc: Document, request: web.Request) -> dict[str, Any]:
    """The document with ``@context``, ``@type`` and ``@id`` (the request's own URL)."""
    out: dict[str, Any] = {"@context": JSONLD_CONTEXT, "@id": str(request.rel_url)}
    if doc.collection or doc.kind == "search":
        out["@type"] = "schema:ItemList"
    else:
        out["@type"] = _LD_TYPES.get(doc.kind, "schema:Thing")
    out.update(doc.body)
    return out


# --- Markdown ------------------------------------------------------------------------------------


def plural(count: int, word: str) -> str:
    """``1 message``, ``2 messages``, ``0 messages`` (every noun used here takes an ``s``)."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _md(text: object) -> str:
    """Inline text safe to put in Markdown: no markup characters interpreted, one line."""
    escaped = str(text).replace("\\", "\\\\")
    for ch in "`*_[]<>#|":
        escaped = escaped.replace(ch, "\\" + ch)
    return " ".join(escaped.split())


#: Link schemes Markdown output keeps as links; a link to any other (``javascript:``, ``data:``,
#: ``vbscript:``, ``file:`` ...) is shown as the text written instead (see :func:`_md_block`).
SAFE_LINK_SCHEMES = frozenset({"http", "https", "mailto"})
# Where a link's destination starts, in an inline link or image (``](``) or a link reference
# definition (``[label]:``), then its scheme and colon. A destination may sit in angle brackets,
# after spaces or a line break, and CommonMark unescapes a backslash before punctuation in it, so
# ``javascript\:`` is the same scheme as ``javascript:``. A definition is looked for anywhere, not
# only at a line's start: inside a list item (``- [r]: ...``, ``1. [r]: ...``) or a block quote it
# defines a link as well, and escaping a bracket that defines nothing changes nothing shown. A label
# holds no unescaped bracket and at most 999 characters (CommonMark), which also bounds the scan
# each ``[`` starts: without it, text of many ``[`` took time growing with its length squared. A
# ``[`` after a backslash starts none (only container markers and spaces may precede a definition).
_LINK_SCHEME = re.compile(r"(\]\(\s*<?\s*|(?<!\\)\[(?:[^\[\]\\]|\\.){1,999}\]:\s*<?\s*)"
                          r"([A-Za-z](?:[A-Za-z0-9+.\-]|\\[+.\-])*)\\?:")


def _unlink_unsafe(match: re.Match[str]) -> str:
    start, scheme = match.group(1), match.group(2).replace("\\", "").lower()
    if scheme in SAFE_LINK_SCHEMES:
        return match.group(0)
    # An escaped bracket ends the link syntax: the reader sees the text and the target as written.
    escaped = "]\\(" + start[2:] if start.startswith("](") else start.replace("[", "\\[", 1)
    return escaped + match.group(0)[len(start):]


def _md_block(text: str) -> list[str]:
    """Content as a block quote, its lines kept. Markdown passes raw HTML through to the page a
    renderer makes of it, so ``&``, ``<`` and ``>`` become character references: a renderer shows
    them as the characters written, and no tag (``<script>``, ``<img onerror=...>``) survives. A
    link or image whose target's scheme is not in :data:`SAFE_LINK_SCHEMES` loses its link syntax
    (not every renderer refuses ``javascript:`` targets); the agent's other Markdown is kept."""
    text = _LINK_SCHEME.sub(_unlink_unsafe, text)
    return ["> " + html.escape(line, quote=False) for line in text.splitlines() or [""]]


def _md_message(m: dict[str, Any]) -> str:
    lines = [f"### Message {m['id']}", "",
             f"- sequence {m['sequence']}, {m['created_at']}, by **{_md(m['author']['name'])}**",
             f"- kinds: {', '.join(m['kinds'])}",
             f"- conversation: {m['conversation_id']}"]
    if m.get("reply_to"):
        lines.append(f"- reply to: {m['reply_to']}")
    if m["tags"]:
        lines.append("- tags: " + ", ".join(f"\\#{_md(t)}" for t in m["tags"]))
    if m["mentions"]:
        lines.append("- mentions: " + ", ".join(_md(x["name"]) for x in m["mentions"]))
    if "schema_name" in m:
        lines.append(f"- schema: {_md(m['schema_name'])} v{m['schema_version']}")
    if "content" in m:
        lines += ["", *_md_block(m["content"])]
    if "payload" in m:
        lines += ["", "```json", orjson.dumps(m["payload"]).decode().replace("```", "`\u200b``"), "```"]
    return "\n".join(lines)


def _md_conversation(c: dict[str, Any]) -> str:
    return (f"- **{_md(c['subject'])}** ({c['id']}) by {_md(c['author']['name'])}: "
            f"{plural(c['message_count'], 'message')}, last sequence {c['last_sequence']}")


def _md_agent(a: dict[str, Any]) -> str:
    act = a["activity"]
    latest = f"last sequence {act['last_sequence']}" if "last_sequence" in act else "no changes yet"
    text = (f"- **{_md(a['name'])}** ({a['agent_id']}): {plural(act['message_count'], 'message')} in "
            f"{plural(act['conversation_count'], 'conversation')}, {latest}")
    if "description" in a:
        text += f" — {_md(a['description'])}"
    return text


def _md_relationship(r: dict[str, Any]) -> str:
    state = " (retracted)" if r["retracted"] else ""
    return (f"- {r['source_message_id']} **{r['type']}** {r['target_message_id']}, by "
            f"{_md(r['author']['name'])}, sequence {r['sequence']}{state}")


def _md_tag(t: dict[str, Any]) -> str:
    return (f"- \\#{_md(t['tag'])}: {plural(t['count'], 'message')} in "
            f"{plural(t['conversation_count'], 'conversation')}")


def _md_hit(h: dict[str, Any]) -> str:
    return f"rank {h['rank']:.4f}\n\n" + _md_message(h["message"])


def _md_corpus(body: dict[str, Any]) -> list[str]:
    counts = ", ".join(f"{n} {name}" for name, n in body["counts"].items())
    return [f"- corpus_id: {body['corpus_id']}", f"- lineage: {body['lineage']}",
            f"- head sequence: {body['head_sequence']}, earliest sequence: {body['earliest_sequence']}",
            f"- counts: {counts}", *_md_provenance(body), "",
            *(f"- {name}: <{url}>" for name, url in body["links"].items())]


def _md_provenance(body: dict[str, Any]) -> list[str]:
    p = body.get("provenance")
    out = [] if p is None else [
        (f"- restored from lineage {p['parent_lineage']} (checkpoint of size {p['checkpoint_size']}, "
         f"root {p['checkpoint_root']}) at {p['restored_at']}")]
    m = body.get("mirror")
    if m is not None:
        out.append(f"- a read-only mirror of {m['source']}: verified through {m['verified_through']}, "
                   f"applied through {m['applied_through']} (at {m['updated_at']})")
    return out


def _md_archive(body: dict[str, Any]) -> list[str]:
    out = [f"- lineage: {body['lineage']}",
           (f"- archived through {body['archived_through']}, verified through {body['verified_through']}, "
           f"published through {body['published_through']} (head {body['head_sequence']}, "
           f"{body['lag_events']} changes not yet verified)"),
           f"- public key: `{body['public_key']}`" if body["public_key"] else "- public key: (not published yet)",
           "", f"## Segments ({body['segment_count']})", ""]
    for seg in body["segments"]:
        digest = f", `{seg['hash']}`" if "hash" in seg else ""
        out.append(f"- {seg['index']}: {seg['first_sequence']}..{seg['last_sequence']}, "
                   f"{seg['event_count']} events, {seg['state']}{digest}")
    if not body["segments"]:
        out.append("(none)")
    if body["checkpoint"]:
        out += ["", "## Latest checkpoint", "", "```", body["checkpoint"].rstrip("\n"), "```"]
    return out


_MD_ITEMS: dict[str, Callable[[dict[str, Any]], str]] = {
    "message": _md_message, "conversation": _md_conversation, "agent": _md_agent,
    "relationship": _md_relationship, "tag": _md_tag, "search": _md_hit,
}


def to_markdown(doc: Document) -> str:
    """The document as Markdown."""
    out = [f"# {_md(doc.title)}", ""]
    body = doc.body
    if doc.kind == "conversation" and not doc.collection:
        out += [_md_conversation(body["conversation"]), "", "## Messages", ""]
        out += [_md_message(m) + "\n" for m in body["messages"]] or ["(none)"]
    elif doc.collection:
        if "total" in body:
            out += [f"{body['total']} in all.", ""]
        render = _MD_ITEMS[doc.kind]
        items = [render(item) for item in body["items"]]
        out += ["\n\n".join(items) if doc.kind in ("message", "search") else "\n".join(items)] if items else ["(none)"]
    elif doc.kind == "message":
        out.append(_md_message(body))
    elif doc.kind == "agent":
        out.append(_md_agent(body))
    elif doc.kind == "corpus":
        out += _md_corpus(body)
    elif doc.kind == "archive":
        out += _md_archive(body)
    for rel in ("prev", "next"):
        url = body.get(rel) if doc.collection else doc.links.get(rel)
        if url:
            out += ["", f"{rel.capitalize()} page: <{url}>"]
    return "\n".join(out).rstrip() + "\n"


# --- HTML ----------------------------------------------------------------------------------------

#: The pages a person browses, linked from the top of every page (the front door's and the guide's too).
NAV: tuple[tuple[str, str], ...] = (
    ("Home", "/"), ("Conversations", "/conversations"), ("Messages", "/messages"), ("Agents", "/agents"),
    ("Tags", "/tags"), ("Relationships", "/relationships"), ("Corpus", "/corpus"), ("Guide", "/guide"))
#: The node's icon (actors.web.favicon serves it); every page links it, so no browser guesses a path.
FAVICON_LINK = '<link rel="icon" href="/favicon.svg" type="image/svg+xml">'
#: Style of the top navigation, shared by every page that shows it.
NAV_STYLE = """
nav.top { display: flex; gap: .4rem 1rem; flex-wrap: wrap; align-items: center; border-bottom: 1px solid #e4e4e7; padding-bottom: .5rem; }
nav.top form { margin-left: auto; }
"""

_STYLE = NAV_STYLE + """
body { font: 15px/1.5 system-ui, sans-serif; margin: 0 auto; max-width: 62rem; padding: 1rem 1.25rem; color: #1d1d1f; }
h1 { font-size: 1.45rem; margin: .8rem 0; overflow-wrap: anywhere; }
h2 { font-size: 1.1rem; margin: 1.2rem 0 .4rem; }
h3 { font-size: .95rem; margin: .8rem 0 .2rem; }
article.message { border-top: 1px solid #e4e4e7; padding: .6rem 0; }
.meta { color: #52525b; font-size: .88rem; }
.kind { font-size: .78rem; border: 1px solid #d4d4d8; border-radius: .3rem; padding: 0 .3rem; margin-right: .3rem; }
.content { white-space: pre-wrap; overflow-wrap: anywhere; margin: .4rem 0; }
form.search { margin: 1rem 0; } form.search input { font-size: 1.05rem; padding: .2rem .4rem; }
.notice { background: #fef9c3; border: 1px solid #fde047; border-radius: .3rem; padding: .4rem .7rem; }
pre { background: #f4f4f5; padding: .5rem; overflow-x: auto; }
table { border-collapse: collapse; } td, th { padding: .2rem .8rem .2rem 0; text-align: left; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: .2rem 1rem; }
dl.facts dt { font-weight: 600; } dl.facts dd { margin: 0; font-family: ui-monospace, monospace; overflow-wrap: anywhere; }
section.related ul { padding-left: 1.2rem; margin: .2rem 0; }
.retracted { text-decoration: line-through; color: #6b7280; }
.pager { display: flex; gap: 1.5rem; margin: 1rem 0; }
"""


def page_headers(style: str, *, form_action: str = "'none'") -> dict[str, str]:
    """Security headers of a server-rendered page with no script and one inline ``style``.

    The style is allowed by its hash, not by a per-response nonce: the page is then the same bytes
    on every request, so it is rendered once and its ETag is a hash of what is sent.
    """
    digest = base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()
    return {
        "Content-Security-Policy": (
            f"default-src 'none'; style-src 'sha256-{digest}'; img-src 'self'; base-uri 'none'; "
            f"form-action {form_action}; frame-ancestors 'none'"),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }


#: The read pages' headers; their search form submits to this origin.
_PAGE_HEADERS = page_headers(_STYLE, form_action="'self'")


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _t(value: object) -> str:
    """Corpus text inline in a page: escaped and isolated, so its direction (a right-to-left
    subject, a stray U+202E) stays inside it instead of reordering the text around it."""
    return f"<bdi>{_e(value)}</bdi>"


def nav_html(search: str | None = None) -> str:
    """The top navigation with the search form (``search`` kept in its box)."""
    links = "".join(f'<a href="{href}">{name}</a>' for name, href in NAV)
    value = f' value="{_e(search)}"' if search else ""
    return (f'<nav class="top">{links}<form method="get" action="/search" role="search">'
            f'<input type="search" name="q"{value} aria-label="Search messages" placeholder="Search messages"> '
            '<button>Search</button></form></nav>')


def _pretty(payload: Any) -> str:
    """A payload indented for reading. The stored bytes are embedded as a fragment (indentation
    does not reach inside), so they are parsed for display with the standard library, which keeps
    every number as written (orjson would turn integers beyond 64 bits into floats)."""
    return json.dumps(json.loads(orjson.dumps(payload)), indent=2, ensure_ascii=False)


def _agent_link(author: dict[str, Any]) -> str:
    return f'<a href="/agents/{quote(author["name"])}">{_t(author["name"])}</a>'


def _message_link(message_id: str, text: str) -> str:
    return f'<a href="/messages/{_e(message_id)}">{text}</a>'


def _html_message(m: dict[str, Any]) -> str:
    kinds = "".join(f'<span class="kind">{_e(k)}</span>' for k in m["kinds"])
    meta = [_message_link(m["id"], f'#{_e(m["sequence"])}'), _agent_link(m["author"]),
            f'<time datetime="{_e(m["created_at"])}">{_e(m["created_at"])}</time>',
            f'in <a href="/conversations/{_e(m["conversation_id"])}">conversation</a>']
    if m.get("reply_to"):
        meta.append(f'replying to {_message_link(m["reply_to"], "a message")}')
    parts = [f'<article class="message" id="m-{_e(m["id"])}">',
             f'<div class="meta">{kinds} {" · ".join(meta)}</div>']
    if "content" in m:
        parts.append(f'<div class="content" dir="auto">{_e(m["content"])}</div>')
    if "payload" in m:
        schema = f'{_t(m["schema_name"])} v{_e(m["schema_version"])}: ' if "schema_name" in m else ""
        payload = _pretty(m["payload"])
        # JSON reads left to right; dir on the block isolates whatever direction its strings carry.
        parts.append(f'<div class="meta">{schema}payload</div><pre dir="ltr">{_e(payload)}</pre>')
    refs = [f'<a href="/messages?{_e(urlencode({"tag": t}))}">#{_t(t)}</a>' for t in m["tags"]]
    refs += [_agent_link(x) for x in m["mentions"]]
    if refs:
        parts.append(f'<div class="meta">{" ".join(refs)}</div>')
    parts.append("</article>")
    return "".join(parts)


def _html_conversation_row(c: dict[str, Any]) -> str:
    return (f'<tr><td><a href="/conversations/{_e(c["id"])}">{_t(c["subject"])}</a></td>'
            f'<td>{_agent_link(c["author"])}</td><td>{_e(c["message_count"])}</td>'
            f'<td>{_e(c["last_sequence"])}</td></tr>')


def _html_agent_row(a: dict[str, Any]) -> str:
    act = a["activity"]
    last = act.get("last_sequence", "")
    description = _t(a["description"]) if "description" in a else ""
    return (f'<tr><td>{_agent_link(a)}</td><td>{description}</td>'
            f'<td>{_e(act["message_count"])}</td><td>{_e(act["conversation_count"])}</td><td>{_e(last)}</td></tr>')


def _html_relationship_row(r: dict[str, Any]) -> str:
    return (f'<tr><td>{_e(r["sequence"])}</td><td>{_message_link(r["source_message_id"], "source")}</td>'
            f'<td>{_e(r["type"])}</td><td>{_message_link(r["target_message_id"], "target")}</td>'
            f'<td>{_agent_link(r["author"])}</td><td>{"retracted" if r["retracted"] else "active"}</td></tr>')


def _html_tag_row(t: dict[str, Any]) -> str:
    return (f'<tr><td><a href="/messages?{_e(urlencode({"tag": t["tag"]}))}">#{_t(t["tag"])}</a></td>'
            f'<td>{_e(t["count"])}</td><td>{_e(t["conversation_count"])}</td></tr>')


_TABLES: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], str]]] = {
    "conversation": (("subject", "author", "messages", "last sequence"), _html_conversation_row),
    "agent": (("name", "description", "messages", "conversations", "last sequence"), _html_agent_row),
    "relationship": (("sequence", "source", "type", "target", "author", "state"), _html_relationship_row),
    "tag": (("tag", "messages", "conversations"), _html_tag_row),
}


def _table(kind: str, items: list[dict[str, Any]]) -> str:
    heads, row = _TABLES[kind]
    return ("<table><thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in heads) + "</tr></thead><tbody>"
            + "".join(row(i) for i in items) + "</tbody></table>")


def _pager(prev: str | None, next_: str | None) -> str:
    links = []
    if prev:
        links.append(f'<a rel="prev" href="{_e(prev)}">← previous</a>')
    if next_:
        links.append(f'<a rel="next" href="{_e(next_)}">next →</a>')
    return f'<nav class="pager">{"".join(links)}</nav>' if links else ""


# --- a message's relationships ---------------------------------------------------------------------

#: How a relationship reads on its target's page ("supported by ...") and its source's ("supports ...").
_INCOMING = {"supports": "Supported by", "contradicts": "Contradicted by", "extends": "Extended by",
             "retracts": "Retracted by", "supersedes": "Superseded by", "replies-to": "Replied to by"}
_OUTGOING = {"supports": "Supports", "contradicts": "Contradicts", "extends": "Extends",
             "retracts": "Retracts", "supersedes": "Supersedes", "replies-to": "Replies to"}


def related_message(relationship: dict[str, Any], *, other_id: str, other_sequence: int,
                    other_author: dict[str, Any], other_excerpt: str | None) -> dict[str, Any]:
    """One entry of :attr:`Document.related`: a relationship of the page's message and the message at
    its other end (id, sequence, author, a short excerpt or None for a payload-only message)."""
    return {"relationship": relationship, "other": {"id": other_id, "sequence": other_sequence,
                                                     "author": other_author, "excerpt": other_excerpt}}


def _related_item(entry: dict[str, Any]) -> str:
    r, other = entry["relationship"], entry["other"]
    excerpt = f': {_t(other["excerpt"])}' if other["excerpt"] else " (structured payload)"
    state = ' <span class="meta">(retracted)</span>' if r["retracted"] else ""
    text = (f'{_message_link(other["id"], "#" + _e(other["sequence"]))} by {_agent_link(other["author"])}'
            f'{excerpt}, asserted by {_agent_link(r["author"])}')
    cls = ' class="retracted"' if r["retracted"] else ""
    return f'<li data-relationship="{_e(r["id"])}" data-type="{_e(r["type"])}"><span{cls}>{text}</span>{state}</li>'


def _html_related(message_id: str, related: list[dict[str, Any]], limit: int) -> str:
    """What relates to this message (grouped by type) and what it relates to, each linking the other."""
    incoming: dict[str, list[str]] = {}
    outgoing: dict[str, list[str]] = {}
    for entry in related[:limit]:
        r = entry["relationship"]
        side = outgoing if r["source_message_id"] == message_id else incoming
        side.setdefault(r["type"], []).append(_related_item(entry))
    parts = ['<section class="related" id="relationships"><h2>Relationships</h2>']
    if not related:
        parts.append("<p>No relationship has been asserted about or from this message.</p>")
    for title, side, labels, direction in (("About this message", incoming, _INCOMING, "incoming"),
                                           ("From this message", outgoing, _OUTGOING, "outgoing")):
        if side:
            parts.append(f'<div data-direction="{direction}"><h3>{title}</h3>')
            for rtype in sorted(side, key=list(labels).index):
                parts.append(f'<p class="meta">{labels[rtype]}</p><ul>{"".join(side[rtype])}</ul>')
            parts.append("</div>")
    more = "More than shown here: see" if len(related) > limit else "The same as data:"
    query = urlencode({"message": message_id, "include_retracted": "true"})
    parts.append(f'<p class="meta">{more} <a href="/relationships?{_e(query)}">every relationship of '
                 "this message</a>.</p></section>")
    return "".join(parts)


#: Relationships listed on a message's page; past this many the page links the full list.
RELATED_LIMIT = 100


def _html_corpus(body: dict[str, Any]) -> str:
    facts = [("corpus_id", body["corpus_id"]), ("lineage", body["lineage"]),
             ("head sequence", body["head_sequence"]), ("earliest sequence", body["earliest_sequence"])]
    facts += [(name, count) for name, count in body["counts"].items()]
    if "provenance" in body:  # a restored history says where it came from
        p = body["provenance"]
        facts += [("restored from lineage", p["parent_lineage"]), ("checkpoint size", p["checkpoint_size"]),
                  ("checkpoint root", p["checkpoint_root"]), ("restored at", p["restored_at"])]
    if "mirror" in body:  # a mirror says what it copies, and that it takes no writes
        m = body["mirror"]
        facts += [("read-only mirror of", m["source"]), ("mirror verified through", m["verified_through"]),
                  ("mirror applied through", m["applied_through"]), ("mirror updated at", m["updated_at"])]
    rows = "".join(f'<dt>{_e(name)}</dt><dd id="corpus-{_e(name.replace(" ", "-"))}">{_e(value)}</dd>'
                   for name, value in facts)
    links = "".join(f'<li><a href="{_e(url)}">{_e(name)}</a> <code>{_e(url)}</code></li>'
                    for name, url in body["links"].items())
    return (f'<dl class="facts">{rows}</dl><h2>Synchronization</h2>'
            "<p>Mirrors and integrations follow the change history from these routes "
            "(JSON Lines and Server-Sent Events, not pages).</p>"
            f"<ul>{links}</ul>")


def _html_archive(body: dict[str, Any]) -> str:
    facts = [("lineage", body["lineage"]), ("archived through", body["archived_through"]),
             ("verified through", body["verified_through"]), ("published through", body["published_through"]),
             ("head sequence", body["head_sequence"]), ("changes not yet verified", body["lag_events"]),
             ("segments", body["segment_count"]), ("public key", body["public_key"] or "(not published yet)")]
    rows = "".join(f'<dt>{_e(name)}</dt><dd id="archive-{_e(name.replace(" ", "-"))}">{_e(value)}</dd>'
                   for name, value in facts)
    segments = "".join(
        f"<tr><td>{_e(s['index'])}</td><td>{_e(s['first_sequence'])}</td><td>{_e(s['last_sequence'])}</td>"
        f"<td>{_e(s['event_count'])}</td><td>{_e(s['state'])}</td><td>"
        + (f'<a href="/corpus/archive/segments/{_e(s["name"])}"><code>{_e(s["hash"][:16])}</code></a>'
           if "name" in s and s["state"] in ("verified", "published") else "")
        + "</td></tr>" for s in body["segments"])
    table = ("<table><thead><tr><th>index</th><th>first</th><th>last</th><th>events</th><th>state</th>"
             f"<th>segment</th></tr></thead><tbody>{segments}</tbody></table>" if segments else "<p>No segments yet.</p>")
    note = f"<h2>Latest checkpoint</h2><pre>{_e(body['checkpoint'])}</pre>" if body["checkpoint"] else ""
    return (f'<dl class="facts">{rows}</dl>{note}<h2>Segments</h2>{table}'
            "<p>Check it yourself with docs/archive-format.md: every segment links to the one before, "
            "every change is a leaf of one Merkle tree, and the checkpoint signs its root.</p>")


def _html_body(doc: Document) -> str:
    body = doc.body
    notice = f'<p class="notice" role="status">{_e(doc.notice)}</p>' if doc.notice else ""
    if doc.kind == "conversation" and not doc.collection:
        c = body["conversation"]
        head = (f'<p class="meta">started by {_agent_link(c["author"])} · {plural(c["message_count"], "message")}'
                f' · created at sequence {_e(c["created_sequence"])}</p>')
        items = "".join(_html_message(m) for m in body["messages"]) or "<p>No messages on this page.</p>"
        return head + items + _pager(None, body.get("next"))
    if doc.kind == "message" and not doc.collection:
        related = _html_related(body["id"], doc.related, RELATED_LIMIT) if doc.related is not None else ""
        return _html_message(body) + related
    if doc.kind == "agent" and not doc.collection:
        return _table("agent", [body]) + (
            f'<p><a href="/messages?{_e(urlencode({"author": body["name"]}))}">Messages by this agent</a></p>')
    if doc.kind == "corpus":
        return _html_corpus(body)
    if doc.kind == "archive":
        return _html_archive(body)
    total = f'<p class="meta">{_e(body["total"])} in all.</p>' if "total" in body and not doc.notice else ""
    if doc.kind == "message":
        items = "".join(_html_message(m) for m in body["items"])
    elif doc.kind == "search":
        items = "".join(_html_message(h["message"]) for h in body["items"])
    else:
        items = _table(doc.kind, body["items"]) if body["items"] else ""
    empty = "" if doc.notice else "<p>Nothing here.</p>"
    if doc.kind == "search" and doc.notice:
        # The search page without words: the form itself, large, where the results would be.
        notice += ('<form class="search" method="get" action="/search" role="search"><input type="search" name="q"'
                   ' aria-label="Words to search for" size="40"> <button>Search</button></form>')
    return notice + total + (items or empty) + _pager(body.get("prev"), body.get("next"))


def to_html(doc: Document) -> str:
    """A complete HTML5 page for ``doc``: escaped throughout, no script, its one style allowed by hash."""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(doc.title)} · ToastMachine</title>
{FAVICON_LINK}
<style>{_STYLE}</style>
</head>
<body>
{nav_html(doc.search)}
<main>
<h1>{_t(doc.title)}</h1>
{_html_body(doc)}
</main>
</body>
</html>
"""
