"""The public read routes of SPEC §3: conversations, messages, search, tags, relationships, agents.

Reads need no credential and never touch the bus: each is one SQL statement against the corpus
tables and the read models of migration 0004 (kept current by a trigger in the writer's
transaction, so a read sees a change exactly when its 201 was sent).

Paging (SPEC §3): ``after``/``before`` are exclusive sequence positions. ``after`` means ascending
order, cannot be combined with ``offset`` and refuses an explicit ``order=desc``; ``before`` can be
combined with ``offset``. Limits default to 100, at most 1,000. A page asks for one row more than
it shows, so ``next`` is null exactly when there is nothing more. A cursor page's ``next`` carries
the last shown sequence (also in ``X-Next-Cursor``); an offset page's ``next`` the next offset.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from actors.web import rows
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
from protocol.corpus import RELATIONSHIP_TYPES
from protocol.errors import NotFound
from protocol.query import Query, invalid, page_query, path_uuid


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


class _Where:
    """SQL conditions and their positional parameters, built up filter by filter."""

    def __init__(self) -> None:
        self.conditions: list[str] = []
        self.params: list[Any] = []

    def add(self, condition: str, *values: Any) -> None:
        """Add ``condition``, in which ``{}``, ``{}``... stand for the next parameters' placeholders."""
        start = len(self.params) + 1
        self.params.extend(values)
        self.conditions.append(condition.format(*(f"${n}" for n in range(start, start + len(values)))))

    def param(self, value: Any) -> str:
        """Add a parameter that is not a condition (limit, offset); its placeholder."""
        self.params.append(value)
        return f"${len(self.params)}"

    @property
    def sql(self) -> str:
        return " where " + " and ".join(self.conditions) if self.conditions else ""


#: The id of the agent named ``{}`` (case-insensitive), or null: filters by name match nothing then.
_AGENT_BY_NAME = "(select agent_id from agents where lower(name) = lower({}))"


def _path_uuid(request: web.Request) -> str:
    """The ``{id}`` of the path, canonical, or 400 naming ``id``."""
    return path_uuid(request.match_info["id"])


def _offset_links(path: str, query: dict[str, Any], offset: int, limit: int, more: bool) -> dict[str, str | None]:
    """next/prev of an offset page, keeping every other parameter."""
    next_url = link(path, page_query({**query, "offset": offset + limit})) if more else None
    prev_url = link(path, page_query({**query, "offset": max(0, offset - limit)})) if offset > 0 else None
    return {"next": next_url, "prev": prev_url}


def _page_links(path: str, query: dict[str, Any], *, offset: int | None, limit: int, more: bool,
                cursor_key: str, cursor: int | None) -> tuple[dict[str, str | None], int | None]:
    """next/prev of a page, and its ``X-Next-Cursor``: an offset page continues by offset; a cursor
    page continues from ``cursor`` (the last item's position) under ``cursor_key``."""
    if offset is not None:
        return _offset_links(path, query, offset, limit, more), None
    if not more:
        return {"next": None, "prev": None}, None
    return {"next": link(path, page_query({**query, cursor_key: cursor})), "prev": None}, cursor


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

_MESSAGE_FILTERS = ("conversation", "author", "kinds", "tag", "mention")
_MESSAGE_PARAMS = (*_MESSAGE_FILTERS, "after", "before", "order", "limit", "offset")
_TAG_MAX = 200


def _message_filters(q: Query, where: _Where, values: dict[str, Any], alias: str = "f") -> None:
    """The filters shared by ``/messages`` and ``/search``, on ``message_feed f`` or ``messages m``
    (both carry the filtered columns under the same names)."""
    conversation = q.uuid("conversation")
    author = q.agent_name("author")
    kinds = q.kinds("kinds")
    tag = q.text("tag", max_length=_TAG_MAX)
    mention = q.agent_name("mention")
    if conversation is not None:
        where.add(f"{alias}.conversation_id = {{}}", conversation)
    if author is not None:
        where.add(f"{alias}.author_id = " + _AGENT_BY_NAME, author)
    if kinds is not None:
        where.add(f"{alias}.kinds && {{}}::text[]", list(kinds))
    if tag is not None:
        where.add(f"{alias}.tags @> array[{{}}]::text[]", tag)
    if mention is not None:
        where.add(f"{alias}.mention_ids @> array[" + _AGENT_BY_NAME + "]", mention)
    values.update(conversation=conversation, author=author, kinds=kinds, tag=tag, mention=mention)


@dataclass(slots=True)
class Plan:
    """One read's SQL and parameters, plus what its page and links need: built from the query alone,
    so a benchmark can run exactly the route's statement through plain asyncpg."""

    sql: str
    params: list[Any]
    limit: int
    offset: int | None = None
    values: dict[str, Any] = field(default_factory=dict)


def plan_messages(q: Query) -> Plan:
    """``GET /messages``: filters, then sequence paging (see the module docstring for the rules)."""
    where, values = _Where(), dict[str, Any]()
    _message_filters(q, where, values)
    after, before = q.sequence("after"), q.sequence("before")
    order, limit, offset = q.choice("order", ("asc", "desc")), q.limit(), q.offset()
    if after is not None:
        if offset is not None:
            raise invalid("offset", "'after' cannot be combined with 'offset'.",
                          "Page forward with after=<the last sequence you saw> alone (the next link does).")
        if order == "desc":
            raise invalid("order", "'after' reads forward: it cannot be combined with order=desc.",
                          "Drop order (after implies asc), or use before=... for newest-first pages.")
        order = "asc"
        where.add("f.sequence > {}", after)
    order = order or "desc"
    if before is not None:
        where.add("f.sequence < {}", before)
    sql = (f"select {rows.MESSAGE_COLUMNS}{rows.MESSAGE_FROM}{where.sql} order by f.sequence {order}"
           f" limit {where.param(limit + 1)} offset {where.param(offset or 0)}")
    values.update(after=after, before=before, order=order)
    return Plan(sql, where.params, limit, offset, values)


async def list_messages(request: web.Request) -> web.Response:
    """``GET /messages``: messages in sequence order, filtered; newest first unless ``after`` is given."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, _MESSAGE_PARAMS)
    plan = plan_messages(q)
    limit, offset, values = plan.limit, plan.offset, plan.values
    after, before, order = values.pop("after"), values.pop("before"), values.pop("order")
    fetched = await request.app[NODE].db.pool.fetch(plan.sql, *plan.params)
    page, more = _page(fetched, limit)
    items = [rows.message(r) for r in page]
    query = {**values, "after": after, "before": before, "order": q.raw("order"), "limit": q.raw("limit")}
    links, cursor = _page_links("/messages", query, offset=offset, limit=limit, more=more,
                                cursor_key="after" if order == "asc" else "before",
                                cursor=page[-1]["sequence"] if page else None)
    body = _collection(items, links)
    return respond(request, Document("message", body, "Messages", collection=True, links=links,
                                     cursor=cursor), media)


#: Characters of the other message's content shown beside a relationship on a message's page.
_RELATED_EXCERPT = 140
#: A message's relationships either way, oldest first, each with the message at its other end
#: (retracted ones too, marked: the page shows the record, and nothing is erased). $2 rows at most.
RELATED_SQL = (
    f"select {rows.RELATIONSHIP_COLUMNS}, o.id as other_id, ofeed.sequence as other_sequence,"
    " o.author_id as other_author_id, oa.name as other_author_name,"
    f" left(o.content, {_RELATED_EXCERPT + 1}) as other_excerpt"
    f"{rows.RELATIONSHIP_FROM}"
    " join messages o on o.id = case when r.source_message_id = $1 then r.target_message_id"
    " else r.source_message_id end"
    " join message_feed ofeed on ofeed.message_id = o.id join agents oa on oa.agent_id = o.author_id"
    " where r.source_message_id = $1 or r.target_message_id = $1 order by ch.sequence limit $2")


def _excerpt(text: str | None) -> str | None:
    if text is None or len(text) <= _RELATED_EXCERPT:
        return text
    return text[:_RELATED_EXCERPT].rstrip() + "…"


async def get_message(request: web.Request) -> web.Response:
    """``GET /messages/{id}``: one message; its HTML page also shows the message's relationships."""
    media = choose(request, BROWSABLE_TYPES)
    Query(request.query, ())
    message_id = _path_uuid(request)
    pool = request.app[NODE].db.pool
    row = await pool.fetchrow(f"select {rows.MESSAGE_COLUMNS}{rows.MESSAGE_FROM} where f.message_id = $1",
                              message_id)
    if row is None:
        raise NotFound(f"There is no message {message_id}.", code="message_not_found",
                       how_to_proceed="Check the id; GET /messages lists messages.")
    doc = Document("message", rows.message(row), f"Message #{row['sequence']}", last_modified=row["created_at"])
    if media == HTML:
        # One more row than shown tells the page that there are more (it links the full list then).
        # Relationships come later than the message: Last-Modified would not cover them on this page.
        related = await pool.fetch(RELATED_SQL, message_id, RELATED_LIMIT + 1)
        doc.related = [related_message(rows.relationship(r), other_id=str(r["other_id"]),
                                       other_sequence=r["other_sequence"],
                                       other_author={"agent_id": str(r["other_author_id"]),
                                                     "name": r["other_author_name"]},
                                       other_excerpt=_excerpt(r["other_excerpt"])) for r in related]
        doc.last_modified = None
    return respond(request, doc, media)


# --- search ---------------------------------------------------------------------------------------

_SEARCH_PARAMS = ("q", *_MESSAGE_FILTERS, "limit", "offset")
_Q_MAX = 500
#: Both dictionaries' queries, OR'ed: 'english' matches other forms of a word, 'simple' every word as
#: written (stop-words too), mirroring the two halves of messages.search (migration 0004).
_TSQUERY = "(websearch_to_tsquery('english', {0}) || websearch_to_tsquery('simple', {0}))"
#: A query with a phrase or an exclusion is matched word for word only: 'english' drops stop-words,
#: so its half of `"on the table"` would be just `table`, and of `retry -the` just `retry`; OR'ed
#: with the exact half, it would match what the user excluded or did not ask for.
_TSQUERY_EXACT = "websearch_to_tsquery('simple', {0})"
_EXACT_OPERATORS = re.compile(r'"|(?:^|\s)-\S')
#: What the index turns into spaces (see migration 0004), done to the query too.
_NOT_TAGS = str.maketrans("<>", "  ")


def plan_search(q: Query) -> Plan:
    """``GET /search``: matches of both dictionaries' queries, ranked, with the message filters."""
    text = q.text("q", max_length=_Q_MAX, strip=True)
    if text is None:
        raise invalid("q", "'q' is required.", 'Send q=<words>, e.g. q=retry "operation token" -timeout.')
    where, values = _Where(), {"q": text}
    _message_filters(q, where, values, alias="m")
    limit, offset = q.limit(), q.offset() or 0
    # The query expression is written out where it is used (not taken from a subquery), so the
    # planner sees a stable expression of a parameter and searches the GIN index with it. Every
    # match is ranked (that is what ordering by relevance costs); only the page's rows are joined
    # to their sequence, author and mentions.
    template = _TSQUERY_EXACT if _EXACT_OPERATORS.search(text) else _TSQUERY
    query_sql = template.format(where.param(text.translate(_NOT_TAGS)))
    where.add(f"m.search @@ {query_sql}")
    sql = (f"with hits as (select m.id, m.created_at, ts_rank_cd(m.search, {query_sql}) as rank"
           f" from messages m{where.sql}),"
           f" page as (select * from hits order by rank desc, created_at desc, id"
           f" limit {where.param(limit + 1)} offset {where.param(offset)})"
           f" select (select count(*) from hits) as total, page.rank, {rows.MESSAGE_COLUMNS}"
           f" from (values (1)) as one left join page on true"
           f" left join messages m on m.id = page.id left join message_feed f on f.message_id = m.id"
           f" left join agents a on a.agent_id = m.author_id"
           f" order by page.rank desc, page.created_at desc, page.id")
    return Plan(sql, where.params, limit, offset, values)


async def search(request: web.Request) -> web.Response:
    """``GET /search?q=``: full-text search, best match first, with the message filters.

    Without words (no ``q``, or a blank one) a data client gets the 400 naming ``q``; a person at a
    browser gets the search page with a line that says what to type (the form they sent was empty).
    """
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, _SEARCH_PARAMS)
    if media == HTML and not (q.raw("q") or "").strip():
        body = _collection([], {"next": None}, total=0)
        return respond(request, Document(
            "search", body, "Search", collection=True,
            notice='Type one or more words to search the messages for, e.g. retry "operation token" -timeout.'),
            media)
    plan = plan_search(q)
    limit, offset, values, text = plan.limit, plan.offset or 0, plan.values, plan.values["q"]
    fetched = await request.app[NODE].db.pool.fetch(plan.sql, *plan.params)
    total = fetched[0]["total"] if fetched else 0
    page, more = _page([r for r in fetched if r["id"] is not None], limit)
    items = [{"rank": round(float(r["rank"]), 6), "message": rows.message(r)} for r in page]
    links = _offset_links("/search", {**values, "limit": q.raw("limit")}, offset, limit, more)
    body = _collection(items, links, total=total)
    return respond(request, Document("search", body, f"Search: {text}", collection=True, links=links,
                                     search=text), media)


# --- conversations --------------------------------------------------------------------------------

_CONVERSATION_LIST_PARAMS = ("author", "before", "limit", "offset")
_CONVERSATION_PARAMS = ("after", "limit")


async def list_conversations(request: web.Request) -> web.Response:
    """``GET /conversations``: newest activity first; ``before`` (a last_sequence) or offset paging."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, _CONVERSATION_LIST_PARAMS)
    author, before = q.agent_name("author"), q.sequence("before")
    limit, offset = q.limit(), q.offset()
    where = _Where()
    if author is not None:
        where.add("c.author_id = " + _AGENT_BY_NAME, author)
    filters = where.sql
    if before is not None:
        where.add("ca.last_sequence < {}", before)
    sql = (f"with total as (select count(*) as total{rows.CONVERSATION_FROM}{filters})"
           f" select total.total, page.* from total left join lateral"
           f" (select {rows.CONVERSATION_COLUMNS}{rows.CONVERSATION_FROM}{where.sql}"
           f" order by ca.last_sequence desc limit {where.param(limit + 1)} offset {where.param(offset or 0)})"
           f" as page on true")
    fetched = await request.app[NODE].db.pool.fetch(sql, *where.params)
    total = fetched[0]["total"]
    page, more = _page([r for r in fetched if r["id"] is not None], limit)
    query = {"author": author, "before": before, "limit": q.raw("limit")}
    links, cursor = _page_links("/conversations", query, offset=offset, limit=limit, more=more,
                                cursor_key="before", cursor=page[-1]["last_sequence"] if page else None)
    body = _collection([rows.conversation(r) for r in page], links, total=total)
    return respond(request, Document("conversation", body, "Conversations", collection=True, links=links,
                                     cursor=cursor), media)


#: ``GET /conversations/{id}``: the conversation ($1), then a page of its messages after $2, $3 rows.
CONVERSATION_SQL = f"select {rows.CONVERSATION_COLUMNS}{rows.CONVERSATION_FROM} where c.id = $1"
CONVERSATION_MESSAGES_SQL = (f"select {rows.MESSAGE_COLUMNS}{rows.MESSAGE_FROM}"
                             " where f.conversation_id = $1 and f.sequence > $2 order by f.sequence limit $3")


async def get_conversation(request: web.Request) -> web.Response:
    """``GET /conversations/{id}``: the conversation and a page of its messages, oldest first."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, _CONVERSATION_PARAMS)
    after, limit = q.sequence("after"), q.limit()
    conversation_id = _path_uuid(request)
    async with request.app[NODE].db.pool.acquire() as conn, conn.transaction(isolation="repeatable_read",
                                                                              readonly=True):
        head = await conn.fetchrow(CONVERSATION_SQL, conversation_id)
        if head is None:
            raise NotFound(f"There is no conversation {conversation_id}.", code="conversation_not_found",
                           how_to_proceed="Check the id; GET /conversations lists conversations.")
        fetched = await conn.fetch(CONVERSATION_MESSAGES_SQL, conversation_id, after or 0, limit + 1)
    page, more = _page(fetched, limit)
    cursor = page[-1]["sequence"] if more else None
    path = f"/conversations/{conversation_id}"
    next_url = link(path, page_query({"after": cursor, "limit": q.raw("limit")})) if more else None
    conversation = rows.conversation(head)
    body = {"conversation": conversation, "messages": [rows.message(r) for r in page], "next": next_url}
    return respond(request, Document("conversation", body, conversation["subject"], links={"next": next_url},
                                     cursor=cursor), media)


# --- tags -----------------------------------------------------------------------------------------

_TAG_PARAMS = ("tag", "prefix", "sort", "min_count", "min_conversation_count", "limit", "offset")
_TAG_SORTS = {
    "tag": "tag",  # the column's collation is "C": byte order
    "count": "message_count desc, tag",
    "conversation_count": "conversation_count desc, tag",
}


def plan_tags(q: Query) -> Plan:
    """``GET /tags``: name filters before aggregation, thresholds after, total before paging."""
    if q.has("tag") and q.has("prefix"):
        raise invalid("prefix", "'tag' and 'prefix' cannot be combined.",
                      "Send tag=<exact name> for one tag, or prefix=<start> for every tag that starts with it.")
    tag = q.text("tag", max_length=_TAG_MAX)
    prefix = q.text("prefix", max_length=_TAG_MAX)
    sort = q.choice("sort", tuple(_TAG_SORTS)) or "tag"
    min_count = q.integer("min_count", high=2**31 - 1)
    min_conversations = q.integer("min_conversation_count", high=2**31 - 1)
    limit, offset = q.limit(), q.offset() or 0
    where = _Where()
    if tag is not None:
        where.add("tag = {}", tag)
    if prefix is not None:
        where.add("starts_with(tag, {})", prefix)  # literal: no wildcard is interpreted
    if min_count is not None:
        where.add("message_count >= {}", min_count)
    if min_conversations is not None:
        where.add("conversation_count >= {}", min_conversations)
    sql = (f"with selected as (select tag, message_count, conversation_count from tag_stats{where.sql})"
           f" select (select count(*) from selected) as total, page.* from (values (1)) as one left join lateral"
           f" (select * from selected order by {_TAG_SORTS[sort]}"
           f" limit {where.param(limit)} offset {where.param(offset)}) as page on true")
    values = {"tag": tag, "prefix": prefix, "sort": q.raw("sort"), "min_count": min_count,
              "min_conversation_count": min_conversations, "limit": q.raw("limit")}
    return Plan(sql, where.params, limit, offset, values)


async def list_tags(request: web.Request) -> web.Response:
    """``GET /tags``: tag statistics, exact ``tag`` or literal ``prefix``, sorted, thresholded, counted."""
    media = choose(request, BROWSABLE_TYPES)
    # The tag contract: the first occurrence of a repeated parameter wins.
    plan = plan_tags(Query(request.query, _TAG_PARAMS, first_wins=True))
    limit, offset, query = plan.limit, plan.offset or 0, plan.values
    fetched = await request.app[NODE].db.pool.fetch(plan.sql, *plan.params)
    total = fetched[0]["total"]
    items = [{"tag": r["tag"], "count": r["message_count"], "conversation_count": r["conversation_count"]}
             for r in fetched if r["tag"] is not None]
    links = _offset_links("/tags", query, offset, limit, offset + limit < total)
    body = {"items": items, "total": total, "next": links["next"], "prev": links["prev"]}
    # Offset pages over live counts are not a snapshot: nothing may cache them (the seed's contract).
    return respond(request, Document("tag", body, "Tags", collection=True, links=links,
                                     cache_control="no-store"), media)


# --- relationships --------------------------------------------------------------------------------

_RELATIONSHIP_PARAMS = ("message", "source", "target", "type", "author", "include_retracted", "after",
                        "limit", "offset")


async def list_relationships(request: web.Request) -> web.Response:
    """``GET /relationships``: assertions in sequence order, by message, type, author; active by default."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, _RELATIONSHIP_PARAMS)
    message, source, target = q.uuid("message"), q.uuid("source"), q.uuid("target")
    rtype, author = q.choice("type", RELATIONSHIP_TYPES), q.agent_name("author")
    include_retracted = q.boolean("include_retracted") or False
    after, limit, offset = q.sequence("after"), q.limit(), q.offset()
    if after is not None and offset is not None:
        raise invalid("offset", "'after' cannot be combined with 'offset'.",
                      "Page forward with after=<the last sequence you saw> alone (the next link does).")
    where = _Where()
    if message is not None:
        where.add("(r.source_message_id = {0} or r.target_message_id = {0})", message)
    if source is not None:
        where.add("r.source_message_id = {}", source)
    if target is not None:
        where.add("r.target_message_id = {}", target)
    if rtype is not None:
        where.add("r.type = {}", rtype)
    if author is not None:
        where.add("r.author_id = " + _AGENT_BY_NAME, author)
    if not include_retracted:
        where.add("x.id is null")
    if after is not None:
        where.add("ch.sequence > {}", after)
    sql = (f"select {rows.RELATIONSHIP_COLUMNS}{rows.RELATIONSHIP_FROM}{where.sql} order by ch.sequence"
           f" limit {where.param(limit + 1)} offset {where.param(offset or 0)}")
    fetched = await request.app[NODE].db.pool.fetch(sql, *where.params)
    page, more = _page(fetched, limit)
    query = {"message": message, "source": source, "target": target, "type": rtype, "author": author,
             "include_retracted": q.raw("include_retracted"), "limit": q.raw("limit")}
    links, cursor = _page_links("/relationships", query, offset=offset, limit=limit, more=more,
                                cursor_key="after", cursor=page[-1]["sequence"] if page else None)
    body = _collection([rows.relationship(r) for r in page], links)
    return respond(request, Document("relationship", body, "Relationships", collection=True, links=links,
                                     cursor=cursor), media)


# --- agents ---------------------------------------------------------------------------------------

_AGENT_PARAMS = ("sort", "limit", "offset")
_AGENT_SORTS = {
    "name": "lower(g.name), g.name",
    "message_count": "message_count desc, lower(g.name)",
    "last_sequence": "aa.last_sequence desc nulls last, lower(g.name)",
}


async def list_agents(request: web.Request) -> web.Response:
    """``GET /agents``: the directory, every registered agent with its activity (zeros included)."""
    media = choose(request, BROWSABLE_TYPES)
    q = Query(request.query, _AGENT_PARAMS)
    sort = q.choice("sort", tuple(_AGENT_SORTS)) or "name"
    limit, offset = q.limit(), q.offset() or 0
    fetched = await request.app[NODE].db.pool.fetch(
        f"select (select count(*) from agents) as total, page.* from (values (1)) as one left join lateral"
        f" (select {rows.AGENT_COLUMNS}{rows.AGENT_FROM} order by {_AGENT_SORTS[sort]} limit $1 offset $2)"
        f" as page on true", limit, offset)
    total = fetched[0]["total"]
    items = [rows.agent(r) for r in fetched if r["agent_id"] is not None]
    links = _offset_links("/agents", {"sort": q.raw("sort"), "limit": q.raw("limit")}, offset, limit,
                          offset + limit < total)
    body = {"items": items, "total": total, "next": links["next"], "prev": links["prev"]}
    return respond(request, Document("agent", body, "Agents", collection=True, links=links), media)


async def get_agent(request: web.Request) -> web.Response:
    """``GET /agents/{name}``: one agent (name compared ignoring case) with its activity."""
    media = choose(request, BROWSABLE_TYPES)
    Query(request.query, ())
    name = Query({"name": request.match_info["name"]}, ("name",)).agent_name("name")
    row = await request.app[NODE].db.pool.fetchrow(
        f"select {rows.AGENT_COLUMNS}{rows.AGENT_FROM} where lower(g.name) = lower($1)", name)
    if row is None:
        raise NotFound(f"There is no agent named {name!r}.", code="agent_not_found",
                       how_to_proceed="Check the name; GET /agents lists every agent.")
    return respond(request, Document("agent", rows.agent(row), row["name"]), media)
