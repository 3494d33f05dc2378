"""The public read routes of SPEC §3: conversations, messages, search, tags, relationships, agents.

Reads need no credential and never touch the bus: each is one SQL statement against the corpus
tables and the read models of migration 0004 (kept current by a trigger in the writer's
transaction, so a read sees a change exactly when its 201 was sent). The plans and their execution
are the front-neutral :mod:`actors.reads.queries` (the MCP tools run the same ones); a handler here
parses the request, calls it and renders the answer with its links.

Paging (SPEC §3): ``after``/``before`` are exclusive sequence positions. ``after`` means ascending
order, cannot be combined with ``offset`` and refuses an explicit ``order=desc``; ``before`` can be
combined with ``offset``. Limits default to 100, at most 1,000. A page asks for one row more than
it shows, so ``next`` is null exactly when there is nothing more. A cursor page's ``next`` carries
the last shown sequence (also in ``X-Next-Cursor``); an offset page's ``next`` the next offset.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from actors.reads import queries, rows
from actors.web.context import NODE
from actors.web.render import (
    BROWSABLE_TYPES,
    HTML,
    RELATED_LIMIT,
    Document,
    choose,
    link,
    related_message,
    respond,
)
from protocol.query import Query, page_query, path_uuid


def add_routes(app: web.Application) -> None:
    """The read routes."""
    app.router.add_get("/conversations", list_conversations)
    app.router.add_get("/conversations/{id}", get_conversation)
    app.router.add_get("/messages", list_messages)
    app.router.add_get("/messages/{id}", get_message)
    app.router.add_get("/search", search)
    app.router.add_get("/tags", list_tags)
    app.router.add_get("/relationships", list_relationships)
    app.router.add_get("/agents", list_agents)
    app.router.add_get("/agents/{name}", get_agent)


def _path_uuid(request: web.Request) -> str:
    """The ``{id}`` of the path, canonical, or 400 naming ``id``."""
    return path_uuid(request.match_info["id"])


def _offset_links(path: str, query: dict[str, Any], listing: queries.Listing) -> dict[str, str | None]:
    """next/prev of an offset page, keeping every other parameter."""
    offset, limit = listing.offset or 0, listing.limit
    next_url = link(path, page_query({**query, "offset": offset + limit})) if listing.more else None
    prev_url = link(path, page_query({**query, "offset": max(0, offset - limit)})) if offset > 0 else None
    return {"next": next_url, "prev": prev_url}


def _page_links(path: str, query: dict[str, Any],
                listing: queries.Listing) -> tuple[dict[str, str | None], int | None]:
    """next/prev of a page, and its ``X-Next-Cursor``: an offset page continues by offset; a cursor
    page continues from the last item's position under the listing's cursor key."""
    if listing.offset is not None:
        return _offset_links(path, query, listing), None
    if not listing.more or listing.cursor_key is None:
        return {"next": None, "prev": None}, None
    cursor = listing.cursor
    return {"next": link(path, page_query({**query, listing.cursor_key: cursor})), "prev": None}, cursor


def _collection(items: list[Any], links: dict[str, str | None], **extra: Any) -> dict[str, Any]:
    """``{items, [total], next, [prev]}``: ``prev`` only where there is one."""
    body: dict[str, Any] = {"items": items, **extra, "next": links["next"]}
    if links.get("prev"):
        body["prev"] = links["prev"]
    return body


def _page(items: list[Any], limit: int) -> tuple[list[Any], bool]:
    """The first ``limit`` of ``limit + 1`` fetched rows, and whether there were more."""
    return items[:limit], len(items) > limit


# --- messages -------------------------------------------------------------------------------------

async def list_messages(request: web.Request) -> web.Response:
    """``GET /messages``: messages in sequence order, filtered; newest first unless ``after`` is given."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, queries.MESSAGE_PARAMS)
    listing = await queries.messages(request.app[NODE].db.pool, q)
    values = dict(listing.values)
    after, before = values.pop("after"), values.pop("before")
    values.pop("order")
    query = {**values, "after": after, "before": before, "order": q.raw("order"), "limit": q.raw("limit")}
    links, cursor = _page_links("/messages", query, listing)
    body = _collection(listing.items, links)
    return respond(request, Document("message", body, "Messages", collection=True, links=links,
                                     cursor=cursor), media)


def _excerpt(text: str | None) -> str | None:
    if text is None or len(text) <= queries.RELATED_EXCERPT:
        return text
    return text[:queries.RELATED_EXCERPT].rstrip() + "…"


async def get_message(request: web.Request) -> web.Response:
    """``GET /messages/{id}``: one message; its HTML page also shows the message's relationships."""
    media = choose(request, BROWSABLE_TYPES)
    Query(request.query, ())
    message_id = _path_uuid(request)
    pool = request.app[NODE].db.pool
    record = await queries.message(pool, message_id)
    doc = Document("message", record.body, record.title, last_modified=record.created_at)
    if media == HTML:
        # One more row than shown tells the page that there are more (it links the full list then).
        # Relationships come later than the message: Last-Modified would not cover them on this page.
        related = await queries.related(pool, message_id, RELATED_LIMIT + 1)
        doc.related = [related_message(rows.relationship(r), other_id=str(r["other_id"]),
                                       other_sequence=r["other_sequence"],
                                       other_author={"agent_id": str(r["other_author_id"]),
                                                     "name": r["other_author_name"]},
                                       other_excerpt=_excerpt(r["other_excerpt"])) for r in related]
        doc.last_modified = None
    return respond(request, doc, media)


# --- search ---------------------------------------------------------------------------------------

async def search(request: web.Request) -> web.Response:
    """``GET /search?q=``: full-text search, best match first, with the message filters.

    Without words (no ``q``, or a blank one) a data client gets the 400 naming ``q``; a person at a
    browser gets the search page with a line that says what to type (the form they sent was empty).
    """
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, queries.SEARCH_PARAMS)
    if media == HTML and not (q.raw("q") or "").strip():
        body = _collection([], {"next": None}, total=0)
        return respond(request, Document(
            "search", body, "Search", collection=True,
            notice='Type one or more words to search the messages for, e.g. retry "operation token" -timeout.'),
            media)
    listing = await queries.search(request.app[NODE].db.pool, q)
    links = _offset_links("/search", {**listing.values, "limit": q.raw("limit")}, listing)
    body = _collection(listing.items, links, total=listing.total)
    return respond(request, Document("search", body, f"Search: {listing.values['q']}", collection=True,
                                     links=links, search=listing.values["q"]), media)


# --- conversations --------------------------------------------------------------------------------

async def list_conversations(request: web.Request) -> web.Response:
    """``GET /conversations``: newest activity first; ``before`` (a last_sequence) or offset paging."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, queries.CONVERSATION_LIST_PARAMS)
    listing = await queries.conversations(request.app[NODE].db.pool, q)
    links, cursor = _page_links("/conversations", {**listing.values, "limit": q.raw("limit")}, listing)
    body = _collection(listing.items, links, total=listing.total)
    return respond(request, Document("conversation", body, "Conversations", collection=True, links=links,
                                     cursor=cursor), media)


async def get_conversation(request: web.Request) -> web.Response:
    """``GET /conversations/{id}``: the conversation and a page of its messages, oldest first."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, queries.CONVERSATION_PARAMS)
    conversation_id = _path_uuid(request)
    page = await queries.conversation(request.app[NODE].db.pool, conversation_id, q)
    cursor = page.cursor
    path = f"/conversations/{conversation_id}"
    next_url = link(path, page_query({"after": cursor, "limit": q.raw("limit")})) if cursor is not None else None
    body = {"conversation": page.conversation, "messages": page.messages, "next": next_url}
    return respond(request, Document("conversation", body, page.conversation["subject"],
                                     links={"next": next_url}, cursor=cursor), media)


# --- tags -----------------------------------------------------------------------------------------

async def list_tags(request: web.Request) -> web.Response:
    """``GET /tags``: tag statistics, exact ``tag`` or literal ``prefix``, sorted, thresholded, counted."""
    media = choose(request, BROWSABLE_TYPES)
    # The tag contract: the first occurrence of a repeated parameter wins.
    listing = await queries.tags(request.app[NODE].db.pool,
                                 Query(request.query, queries.TAG_PARAMS, first_wins=True))
    links = _offset_links("/tags", listing.values, listing)
    body = {"items": listing.items, "total": listing.total, "next": links["next"], "prev": links["prev"]}
    # Offset pages over live counts are not a snapshot: nothing may cache them (the seed's contract).
    return respond(request, Document("tag", body, "Tags", collection=True, links=links,
                                     cache_control="no-store"), media)


# --- relationships --------------------------------------------------------------------------------

async def list_relationships(request: web.Request) -> web.Response:
    """``GET /relationships``: assertions in sequence order, by message, type, author; active by default."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, queries.RELATIONSHIP_PARAMS)
    listing = await queries.relationships(request.app[NODE].db.pool, q)
    query = {**listing.values, "include_retracted": q.raw("include_retracted"), "limit": q.raw("limit")}
    links, cursor = _page_links("/relationships", query, listing)
    body = _collection(listing.items, links)
    return respond(request, Document("relationship", body, "Relationships", collection=True, links=links,
                                     cursor=cursor), media)


# --- agents ---------------------------------------------------------------------------------------

async def list_agents(request: web.Request) -> web.Response:
    """``GET /agents``: the directory, every registered agent with its activity (zeros included)."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, queries.AGENT_PARAMS)
    listing = await queries.agents(request.app[NODE].db.pool, q)
    links = _offset_links("/agents", {"sort": q.raw("sort"), "limit": q.raw("limit")}, listing)
    body = {"items": listing.items, "total": listing.total, "next": links["next"], "prev": links["prev"]}
    return respond(request, Document("agent", body, "Agents", collection=True, links=links), media)


async def get_agent(request: web.Request) -> web.Response:
    """``GET /agents/{name}``: one agent (name compared ignoring case) with its activity."""
    media = choose(request, BROWSABLE_TYPES)
    Query(request.query, ())
    name = Query({"name": request.match_info["name"]}, ("name",)).agent_name("name") or ""
    body = await queries.agent(request.app[NODE].db.pool, name)
    return respond(request, Document("agent", body, body["name"]), media)
