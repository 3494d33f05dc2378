"""Every public read of SPEC §3 as one plan and one execution, shared by the web front and the MCP front.

Each function takes the read's parameters as a :class:`~protocol.query.Query` (so both fronts
validate with the same rules and answer a bad value with the same ``invalid_parameter`` error) and
the database pool, runs one SQL statement (or one read-only transaction) and returns the
representations plus the paging facts (:class:`Listing`). How a front shows "the next page" is its
own business: the web front turns the facts into ``next``/``prev`` links and ``X-Next-Cursor``,
the MCP front into cursor arguments.

Paging (SPEC §3): ``after``/``before`` are exclusive sequence positions. ``after`` means ascending
order, cannot be combined with ``offset`` and refuses an explicit ``order=desc``; ``before`` can be
combined with ``offset``. Limits default to 100, at most 1,000. A page asks for one row more than
it shows, so ``more`` is false exactly when there is nothing more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from actors.reads import rows
from protocol.corpus import RELATIONSHIP_TYPES
from protocol.errors import NotFound, ServiceUnavailable
from protocol.query import Query, invalid

#: The parameters each read accepts (anything else is a 400 naming it).
MESSAGE_FILTERS = ("conversation", "author", "kinds", "tag", "mention")
MESSAGE_PARAMS = (*MESSAGE_FILTERS, "after", "before", "order", "limit", "offset")
SEARCH_PARAMS = ("q", *MESSAGE_FILTERS, "limit", "offset")
CONVERSATION_LIST_PARAMS = ("author", "before", "limit", "offset")
CONVERSATION_PARAMS = ("after", "limit")
TAG_PARAMS = ("tag", "prefix", "sort", "min_count", "min_conversation_count", "limit", "offset")
RELATIONSHIP_PARAMS = ("message", "source", "target", "type", "author", "include_retracted", "after",
                       "limit", "offset")
AGENT_PARAMS = ("sort", "limit", "offset")

_TAG_MAX = 200


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


@dataclass(slots=True)
class Plan:
    """One read's SQL and parameters, plus what its page and links need: built from the query alone,
    so a benchmark can run exactly the route's statement through plain asyncpg."""

    sql: str
    params: list[Any]
    limit: int
    offset: int | None = None
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Listing:
    """One page of a collection read, front-neutral.

    ``items`` are representations; ``more`` says whether a next page exists; ``total`` is the count
    of the whole filtered collection where the read counts (else None). An offset page (``offset``
    not None) continues at ``offset + limit``; a cursor page continues with ``cursor_key=cursor``
    (the last shown item's position). ``values`` are the parsed filters, for a front's links.
    """

    items: list[dict[str, Any]]
    more: bool
    limit: int
    offset: int | None
    cursor_key: str | None = None
    cursor: int | None = None
    total: int | None = None
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def next_offset(self) -> int | None:
        """Where the next offset page starts, or None (no more, or a cursor page)."""
        return (self.offset or 0) + self.limit if self.more and self.offset is not None else None

    @property
    def next_cursor(self) -> int | None:
        """The cursor of the next cursor page, or None (no more, or an offset page)."""
        return self.cursor if self.more and self.offset is None else None


def _page(items: list[Any], limit: int) -> tuple[list[Any], bool]:
    """The first ``limit`` of ``limit + 1`` fetched rows, and whether there were more."""
    return items[:limit], len(items) > limit


# --- messages -------------------------------------------------------------------------------------

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


async def messages(pool: asyncpg.Pool, q: Query) -> Listing:
    """``GET /messages``: messages in sequence order, filtered; newest first unless ``after`` is given.
    ``values`` carries the filters and ``after``, ``before``, ``order`` (the order actually used)."""
    plan = plan_messages(q)
    fetched = await pool.fetch(plan.sql, *plan.params)
    page, more = _page(fetched, plan.limit)
    return Listing([rows.message(r) for r in page], more, plan.limit, plan.offset,
                   cursor_key="after" if plan.values["order"] == "asc" else "before",
                   cursor=page[-1]["sequence"] if page else None, values=plan.values)


@dataclass(slots=True)
class Record:
    """One record's representation, with when it was created (for ``Last-Modified``)."""

    body: dict[str, Any]
    created_at: datetime
    title: str


MESSAGE_SQL = f"select {rows.MESSAGE_COLUMNS}{rows.MESSAGE_FROM} where f.message_id = $1"


async def message(pool: asyncpg.Pool, message_id: str) -> Record:
    """``GET /messages/{id}``: one message by its canonical id, or 404 ``message_not_found``."""
    row = await pool.fetchrow(MESSAGE_SQL, message_id)
    if row is None:
        raise NotFound(f"There is no message {message_id}.", code="message_not_found",
                       how_to_proceed="Check the id; GET /messages lists messages.")
    return Record(rows.message(row), row["created_at"], f"Message #{row['sequence']}")


#: Characters of the other message's content shown beside a relationship on a message's page.
RELATED_EXCERPT = 140
#: A message's relationships either way, oldest first, each with the message at its other end
#: (retracted ones too, marked: the page shows the record, and nothing is erased). $2 rows at most.
RELATED_SQL = (
    f"select {rows.RELATIONSHIP_COLUMNS}, o.id as other_id, ofeed.sequence as other_sequence,"
    " o.author_id as other_author_id, oa.name as other_author_name,"
    f" left(o.content, {RELATED_EXCERPT + 1}) as other_excerpt"
    f"{rows.RELATIONSHIP_FROM}"
    " join messages o on o.id = case when r.source_message_id = $1 then r.target_message_id"
    " else r.source_message_id end"
    " join message_feed ofeed on ofeed.message_id = o.id join agents oa on oa.agent_id = o.author_id"
    " where r.source_message_id = $1 or r.target_message_id = $1 order by ch.sequence limit $2")


async def related(pool: asyncpg.Pool, message_id: str, limit: int) -> list[asyncpg.Record]:
    """Up to ``limit`` relationships touching ``message_id`` with the other end's columns (see
    :data:`RELATED_SQL`); rows, because only the HTML page shows them, in its own shape."""
    return await pool.fetch(RELATED_SQL, message_id, limit)


# --- search ---------------------------------------------------------------------------------------

_Q_MAX = 500
#: The query as PostgreSQL reads it word for word ('simple': every word as written, stop-words too).
_SIMPLE = "websearch_to_tsquery('simple', {0})"
#: Both dictionaries' queries OR'ed ('english' also matches other forms of a word), mirroring the two
#: halves of messages.search (migration 0004); unless the query excludes a word, as PostgreSQL
#: reads it (a '!' in its reading: ``-word``, ``- word``, ``(-word)`` alike), when it is matched
#: word for word only: 'english' drops stop-words, so its half of ``retry -the`` would be just
#: ``retry``, and OR'ed with the exact half it would match what the user excluded.
_TSQUERY = ("(case when strpos(" + _SIMPLE + "::text, '!') > 0 then " + _SIMPLE
            + " else websearch_to_tsquery('english', {0}) || " + _SIMPLE + " end)")
#: A quoted phrase is matched word for word: 'english''s half of ``"on the table"`` would be
#: just ``table``.
_TSQUERY_EXACT = _SIMPLE
#: What the index turns into spaces (see migration 0004), done to the query too.
_NOT_TAGS = str.maketrans("<>", "  ")


#: Words (phrase words included) a search query may hold: ranking costs every match times every
#: word, and a query with more is never a better question.
MAX_SEARCH_WORDS = 16
#: Seconds a search may take before it is cancelled and answered 503 ``search_timeout``.
SEARCH_TIMEOUT = 10.0
#: A query's words: a quoted phrase (its words counted one by one) or a run of non-spaces.
_SEARCH_TOKEN = re.compile(r'-?"[^"]*"?|\S+')
_WORD = re.compile(r"\w+")
_ONLY_EXCLUSIONS = ("'q' has no word to match: a query of only exclusions (-word) would match every message.",
                    "Add a word to look for, e.g. q=retry -timeout.")


def _check_search_words(text: str) -> None:
    """400 when ``text`` has more than :data:`MAX_SEARCH_WORDS` words (before any statement: the
    cost is the ranking's). A query of only exclusions is told apart by PostgreSQL's own reading
    of it, in the search's statement (:func:`plan_search`)."""
    words = 0
    tokens = _SEARCH_TOKEN.findall(text)
    for i, token in enumerate(tokens):
        count = len(_WORD.findall(token))
        if not count or (token.lower() == "or" and 0 < i < len(tokens) - 1):
            continue  # punctuation, or the OR operator between two terms
        words += count
    if words > MAX_SEARCH_WORDS:
        raise invalid("q", f"'q' has {words} words; a search takes at most {MAX_SEARCH_WORDS}.",
                      "Search for the few words that matter most, and narrow with author, kind or tag.")


def plan_search(q: Query) -> Plan:
    """``GET /search``: matches of both dictionaries' queries, ranked, with the message filters.

    The statement also answers ``only_exclusions``: PostgreSQL reads the query as nothing but
    excluded words (its ``querytree`` is ``T``, which would match and rank every message); then it
    matches nothing, and :func:`search` answers 400."""
    text = q.text("q", max_length=_Q_MAX, strip=True)
    if text is None:
        raise invalid("q", "'q' is required.", 'Send q=<words>, e.g. q=retry "operation token" -timeout.')
    _check_search_words(text)
    where, values = _Where(), {"q": text}
    _message_filters(q, where, values, alias="m")
    limit, offset = q.limit(), q.offset() or 0
    # The query expression is written out where it is used (not taken from a subquery), so the
    # planner sees a stable expression of a parameter and searches the GIN index with it. Every
    # match is ranked (that is what ordering by relevance costs); only the page's rows are joined
    # to their sequence, author and mentions.
    param = where.param(text.translate(_NOT_TAGS))
    query_sql = (_TSQUERY_EXACT if '"' in text else _TSQUERY).format(param)
    simple = _SIMPLE.format(param)
    only_exclusions = f"(numnode({simple}) > 0 and querytree({simple}) = 'T')"
    where.add(f"m.search @@ {query_sql}")
    where.add(f"not {only_exclusions}")
    sql = (f"with hits as (select m.id, m.created_at, ts_rank_cd(m.search, {query_sql}) as rank"
           f" from messages m{where.sql}),"
           f" page as (select * from hits order by rank desc, created_at desc, id"
           f" limit {where.param(limit + 1)} offset {where.param(offset)})"
           f" select (select count(*) from hits) as total, {only_exclusions} as only_exclusions,"
           f" page.rank, {rows.MESSAGE_COLUMNS}"
           f" from (values (1)) as one left join page on true"
           f" left join messages m on m.id = page.id left join message_feed f on f.message_id = m.id"
           f" left join agents a on a.agent_id = m.author_id"
           f" order by page.rank desc, page.created_at desc, page.id")
    return Plan(sql, where.params, limit, offset, values)


async def search(pool: asyncpg.Pool, q: Query) -> Listing:
    """``GET /search?q=``: full-text search, best match first, counted; items are ``{rank, message}``."""
    plan = plan_search(q)
    try:
        # asyncpg cancels the statement on the server when the timeout passes.
        fetched = await pool.fetch(plan.sql, *plan.params, timeout=SEARCH_TIMEOUT)
    except TimeoutError:
        raise ServiceUnavailable(f"The search took longer than {SEARCH_TIMEOUT:g} s and was stopped.",
                                 code="search_timeout",
                                 how_to_proceed="Search for rarer words, or narrow it with author, kind, tag "
                                                "or conversation.") from None
    if fetched and fetched[0]["only_exclusions"]:
        raise invalid("q", *_ONLY_EXCLUSIONS)
    total = fetched[0]["total"] if fetched else 0
    page, more = _page([r for r in fetched if r["id"] is not None], plan.limit)
    items = [{"rank": round(float(r["rank"]), 6), "message": rows.message(r)} for r in page]
    return Listing(items, more, plan.limit, plan.offset or 0, total=total, values=plan.values)


# --- conversations --------------------------------------------------------------------------------

async def conversations(pool: asyncpg.Pool, q: Query) -> Listing:
    """``GET /conversations``: newest activity first; ``before`` (a last_sequence) or offset paging."""
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
    fetched = await pool.fetch(sql, *where.params)
    page, more = _page([r for r in fetched if r["id"] is not None], limit)
    return Listing([rows.conversation(r) for r in page], more, limit, offset, cursor_key="before",
                   cursor=page[-1]["last_sequence"] if page else None, total=fetched[0]["total"],
                   values={"author": author, "before": before})


#: ``GET /conversations/{id}``: the conversation ($1), then a page of its messages after $2, $3 rows.
CONVERSATION_SQL = f"select {rows.CONVERSATION_COLUMNS}{rows.CONVERSATION_FROM} where c.id = $1"
CONVERSATION_MESSAGES_SQL = (f"select {rows.MESSAGE_COLUMNS}{rows.MESSAGE_FROM}"
                             " where f.conversation_id = $1 and f.sequence > $2 order by f.sequence limit $3")


@dataclass(slots=True)
class ConversationPage:
    """A conversation and one page of its messages, oldest first; ``cursor`` (the last shown
    message's sequence) continues it as ``after``, None when there is nothing more."""

    conversation: dict[str, Any]
    messages: list[dict[str, Any]]
    cursor: int | None


async def conversation(pool: asyncpg.Pool, conversation_id: str, q: Query) -> ConversationPage:
    """``GET /conversations/{id}``: the conversation and a page of its messages after ``after``,
    read in one repeatable-read transaction so the head and the page agree."""
    after, limit = q.sequence("after"), q.limit()
    async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        head = await conn.fetchrow(CONVERSATION_SQL, conversation_id)
        if head is None:
            raise NotFound(f"There is no conversation {conversation_id}.", code="conversation_not_found",
                           how_to_proceed="Check the id; GET /conversations lists conversations.")
        fetched = await conn.fetch(CONVERSATION_MESSAGES_SQL, conversation_id, after or 0, limit + 1)
    page, more = _page(fetched, limit)
    return ConversationPage(rows.conversation(head), [rows.message(r) for r in page],
                            page[-1]["sequence"] if more else None)


# --- tags -----------------------------------------------------------------------------------------

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


async def tags(pool: asyncpg.Pool, q: Query) -> Listing:
    """``GET /tags``: tag statistics, exact ``tag`` or literal ``prefix``, sorted, thresholded, counted."""
    plan = plan_tags(q)
    offset = plan.offset or 0
    fetched = await pool.fetch(plan.sql, *plan.params)
    total = fetched[0]["total"]
    items = [{"tag": r["tag"], "count": r["message_count"], "conversation_count": r["conversation_count"]}
             for r in fetched if r["tag"] is not None]
    return Listing(items, offset + plan.limit < total, plan.limit, offset, total=total, values=plan.values)


# --- relationships --------------------------------------------------------------------------------

async def relationships(pool: asyncpg.Pool, q: Query) -> Listing:
    """``GET /relationships``: assertions in sequence order, by message, type, author; active by default."""
    message_id, source, target = q.uuid("message"), q.uuid("source"), q.uuid("target")
    rtype, author = q.choice("type", RELATIONSHIP_TYPES), q.agent_name("author")
    include_retracted = q.boolean("include_retracted") or False
    after, limit, offset = q.sequence("after"), q.limit(), q.offset()
    if after is not None and offset is not None:
        raise invalid("offset", "'after' cannot be combined with 'offset'.",
                      "Page forward with after=<the last sequence you saw> alone (the next link does).")
    where = _Where()
    if message_id is not None:
        where.add("(r.source_message_id = {0} or r.target_message_id = {0})", message_id)
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
    fetched = await pool.fetch(sql, *where.params)
    page, more = _page(fetched, limit)
    values = {"message": message_id, "source": source, "target": target, "type": rtype, "author": author}
    return Listing([rows.relationship(r) for r in page], more, limit, offset, cursor_key="after",
                   cursor=page[-1]["sequence"] if page else None, values=values)


# --- agents ---------------------------------------------------------------------------------------

_AGENT_SORTS = {
    "name": "lower(g.name), g.name",
    "message_count": "message_count desc, lower(g.name)",
    "last_sequence": "aa.last_sequence desc nulls last, lower(g.name)",
}


async def agents(pool: asyncpg.Pool, q: Query) -> Listing:
    """``GET /agents``: the directory, every registered agent with its activity (zeros included)."""
    sort = q.choice("sort", tuple(_AGENT_SORTS)) or "name"
    limit, offset = q.limit(), q.offset() or 0
    fetched = await pool.fetch(
        f"select (select count(*) from agents) as total, page.* from (values (1)) as one left join lateral"
        f" (select {rows.AGENT_COLUMNS}{rows.AGENT_FROM} order by {_AGENT_SORTS[sort]} limit $1 offset $2)"
        f" as page on true", limit, offset)
    total = fetched[0]["total"]
    items = [rows.agent(r) for r in fetched if r["agent_id"] is not None]
    return Listing(items, offset + limit < total, limit, offset, total=total)


async def agent(pool: asyncpg.Pool, name: str) -> dict[str, Any]:
    """``GET /agents/{name}``: one agent (name compared ignoring case, already validated) or 404."""
    row = await pool.fetchrow(f"select {rows.AGENT_COLUMNS}{rows.AGENT_FROM} where lower(g.name) = lower($1)",
                              name)
    if row is None:
        raise NotFound(f"There is no agent named {name!r}.", code="agent_not_found",
                       how_to_proceed="Check the name; GET /agents lists every agent.")
    return rows.agent(row)
