"""Synchronization reads: ``GET /corpus``, ``GET /corpus/changes.jsonl`` and ``GET /corpus/snapshot.jsonl``.

A mirror starts from the snapshot (every current conversation, message and relationship, with
retraction state, as of one stated boundary sequence ``X-Corpus-At``), then follows the change
history with ``changes.jsonl?after=<that boundary>``, page after page, using ``X-Corpus-Next`` as the
next ``after``. Both answers are read inside one REPEATABLE READ, read-only transaction, so the
headers and the body describe the same database snapshot, and both are streamed from a server-side
cursor: a page is never held in memory, whatever its size.

Sequence numbers only mean something within one history lineage (a restore gets a fresh one), so a
follower may send the lineage it is following (``lineage=`` or ``X-Corpus-Lineage``); a different one
is refused with 409 ``lineage_mismatch``. A node whose configured identity does not match its database
answers every route here with 503 ``lineage_unavailable`` (SPEC §4).

Each stream holds one pooled database connection and one snapshot for as long as the client takes to
read it, so streams are bounded per node (:data:`EXPORT_SLOTS`) and a client that stops reading for
:data:`WRITE_TIMEOUT` seconds is cut off.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn
from urllib.parse import urlencode

from aiohttp import web

from actors.reads import rows
from actors.reads.corpus import (  # the paths are this module's routes; others import them from here
    CHANGES_PATH,
    SNAPSHOT_PATH,
    STREAM_PATH,  # noqa: F401
    corpus_info_body,
)
from actors.web.context import NODE
from actors.web.render import BROWSABLE_TYPES, Document, choose, respond
from actors.web.slots import ClientSlots
from infra.db.pool import connection
from infra.http import delivered, negotiate, single_header
from infra.logs import get_logger
from protocol import representations as rep
from protocol.errors import BadRequest, Conflict, NotAcceptable, ServiceUnavailable
from protocol.query import Query, check_within_head

log = get_logger("toastmachine.actors.web.export")

#: The media type of both JSONL routes: one JSON document per line, UTF-8, ``\n``-terminated.
JSONL = "application/x-ndjson"
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
#: Most rows read per round trip (and written per chunk).
FETCH_ROWS = 1000
#: Rows of a page's first fetch, before any of its lines' sizes is known (at most 6.4 MB).
FIRST_FETCH_ROWS = 64
#: Bytes (about) of a chunk written, and of the rows held for it: a page of events near their
#: 100 KiB cap is read ten rows at a time, a page of small ones FETCH_ROWS at a time. Each fetch
#: is sized from the longest line of the one before (planning from the lines' stored sizes first
#: cost a quarter of the export's speed): a page whose lines jump from small to large between two
#: fetches is the one case that holds up to FETCH_ROWS large lines.
CHUNK_BYTES = 1 << 20
#: Rows a snapshot source fetches per round trip: its rows' sizes are not known ahead (a message
#: may hold 256 KiB of content and 64 KiB of payload), so this bounds what three sources hold.
SNAPSHOT_FETCH_ROWS = 64
#: Seconds one chunk may take to reach the client before the stream is cut off.
WRITE_TIMEOUT = 30.0
#: Seconds a request waits for a free export slot before it is answered 503 (retry later).
SLOT_WAIT = 5.0


#: Concurrent JSONL streams of one app; each holds a pooled connection while the client reads.
EXPORT_SLOTS: web.AppKey[ClientSlots] = web.AppKey("export_slots", ClientSlots)

_CHANGES_PARAMS = ("after", "limit", "lineage")


def add_routes(app: web.Application) -> None:
    """The corpus synchronization routes, with this app's bound on concurrent streams."""
    settings = app[NODE].settings
    # Half the pool at most: writes' auth lookups, the SSE catch-up and /corpus still get connections.
    app[EXPORT_SLOTS] = export_slots(max(1, settings.db_pool_size // 2), settings.export_max_per_client)
    app.router.add_get("/corpus", corpus_info)
    app.router.add_get(CHANGES_PATH, changes)
    app.router.add_get(SNAPSHOT_PATH, snapshot)


# --- request checks ----------------------------------------------------------------------------


def node_identity(request: web.Request) -> tuple[str, str]:
    """(corpus_id, lineage) of this node, or 503 ``lineage_unavailable``."""
    node = request.app[NODE]
    if node.identity_error is not None or node.identity is None:
        raise ServiceUnavailable(
            "This node's corpus identity does not match its database; it serves no synchronization data.",
            code="lineage_unavailable",
            how_to_proceed="Keep your cursor and follow another node of this corpus, or retry once the "
                           "operator fixed the corpus identity.")
    return str(node.identity.corpus_id), str(node.identity.lineage)


def identity_headers(corpus_id: str, lineage: str) -> dict[str, str]:
    """The headers naming the corpus and history lineage an answer belongs to."""
    return {"X-Corpus-Id": corpus_id, "X-Corpus-Lineage": lineage, "Cache-Control": "no-store"}


_PARAM_HELP = {
    "after": "Send the sequence of the last change you applied (0 for the start), e.g. the previous page's "
             "X-Corpus-Next; never compute it as after + limit.",
    "limit": f"Send at most {MAX_LIMIT} (the default is {DEFAULT_LIMIT}).",
}


def check_lineage(request: web.Request, corpus_id: str, lineage: str) -> str | None:
    """The lineage the client follows (``lineage=`` or ``X-Corpus-Lineage``), refused with 400 if the
    two are given and disagree and with 409 if it is not ours; returns the parameter's value (to
    echo in links), or None when it came only in the header (or not at all)."""
    given: dict[str, str] = {}
    for source, raw in (("lineage", request.query.get("lineage")),
                        ("X-Corpus-Lineage", single_header(request, "X-Corpus-Lineage"))):
        if raw is None:
            continue
        try:
            given[source] = str(uuid.UUID(raw.strip()))
        except ValueError:
            raise BadRequest(f"{source!r} must be a history lineage (a UUID).", code="invalid_parameter",
                             extra={"field": source},
                             how_to_proceed="Send the X-Corpus-Lineage value of the history you follow.") from None
    if len(set(given.values())) > 1:
        raise BadRequest("'lineage' and the X-Corpus-Lineage header name different histories.",
                         code="invalid_parameter", extra={"field": "lineage"},
                         how_to_proceed="Send the lineage once (parameter or header), or the same value in both.")
    for source, theirs in given.items():
        if theirs != lineage:
            raise Conflict(
                f"Your cursor belongs to history lineage {theirs}; this node serves lineage {lineage}. "
                "Sequence numbers of different lineages are unrelated.",
                code="lineage_mismatch", headers=identity_headers(corpus_id, lineage),
                extra={"field": source, "lineage": lineage},
                how_to_proceed=f"Discard your local copy and cursor, load GET {SNAPSHOT_PATH}, then follow "
                               f"{CHANGES_PATH}?after=<its X-Corpus-At>&lineage={lineage}.")
    return given.get("lineage")


def _accept_jsonl(request: web.Request) -> None:
    if negotiate(request.headers.get("Accept"), (JSONL, "application/jsonl")) is None:
        raise NotAcceptable(f"This route produces only {JSONL}.", how_to_proceed=f"Send 'Accept: {JSONL}' or */*.")


# --- streaming ---------------------------------------------------------------------------------


def export_slots(total: int, per_client: int) -> ClientSlots:
    """The node's caps on concurrent exports: ``total`` in all, ``per_client`` per client address
    (one client reading slowly must not hold every connection the exports may take); a request
    waits up to :data:`SLOT_WAIT` in all for both, then 503 ``export_busy``."""

    def refuse(cap: str) -> NoReturn:
        if cap == "client":
            message = f"This client address already has {per_client} synchronization streams open on this node."
            how = "Read your open exports to the end (or close them) before starting another, then retry with " \
                  "the same cursor."
        else:
            message = "Too many synchronization streams are open on this node."
            how = "Retry after the seconds in Retry-After with the same cursor."
        raise ServiceUnavailable(message, code="export_busy", headers={"Retry-After": "2"}, how_to_proceed=how)

    return ClientSlots(total, per_client, refuse, wait=SLOT_WAIT)


async def _start(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={**headers, "Content-Type": JSONL, "X-Accel-Buffering": "no"})
    await response.prepare(request)
    return response


async def _pump(request: web.Request, response: web.StreamResponse,
                chunks: AsyncIterator[bytes]) -> None:
    """Write ``chunks`` to the prepared ``response``; an error now can only cut the connection.

    The status line is already sent, so a failure mid-stream cannot become an error envelope. The
    connection is aborted instead, so the client sees an incomplete chunked body (an error), never a
    page that merely looks short; every complete line it got is still valid to apply.
    """
    try:
        async for chunk in chunks:
            async with asyncio.timeout(WRITE_TIMEOUT):
                await response.write(chunk)
        await delivered(request, response)
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client went away, or the node is stopping
    except TimeoutError:
        log.info("export.client_stuck", path=request.path)
        _abort(request)
    except Exception:
        log.exception("export.failed", path=request.path)
        _abort(request)


def _abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


# --- GET /corpus/changes.jsonl -----------------------------------------------------------------

#: Head, earliest and the last sequence of the requested page, in the transaction's snapshot.
_PAGE_BOUNDS = (
    "select (select coalesce(max(sequence), 0) from changes) as head,"
    " (select coalesce(min(sequence), 0) from changes) as earliest,"
    " (select max(sequence) from (select sequence from changes where sequence > $1"
    "  order by sequence limit $2) as page) as last")
#: The stored envelopes as UTF-8 bytes, newline included: written out without decoding them.
_PAGE = ("select convert_to(event || E'\\n', 'UTF8') from changes"
         " where sequence > $1 and sequence <= $2 order by sequence")


async def changes(request: web.Request) -> web.StreamResponse:
    """``GET /corpus/changes.jsonl?after=&limit=&lineage=``: the change history, one envelope per line."""
    corpus_id, lineage = node_identity(request)
    q = Query(request.query, _CHANGES_PARAMS)
    after = q.integer("after", how_to_proceed=_PARAM_HELP["after"]) or 0
    limit = q.integer("limit", low=1, high=MAX_LIMIT, how_to_proceed=_PARAM_HELP["limit"]) or DEFAULT_LIMIT
    echoed_lineage = check_lineage(request, corpus_id, lineage)
    _accept_jsonl(request)
    async with request.app[EXPORT_SLOTS].hold(request), connection(request.app[NODE].db) as conn, \
            conn.transaction(isolation="repeatable_read", readonly=True):
        bounds = await conn.fetchrow(_PAGE_BOUNDS, after, limit)
        head, last = bounds["head"], bounds["last"]
        check_within_head("after", after, head)
        next_after = last if last is not None else after
        query: dict[str, str | int] = {"after": next_after, "limit": limit}
        if echoed_lineage is not None:
            query["lineage"] = echoed_lineage
        headers = {
            **identity_headers(corpus_id, lineage),
            "X-Corpus-After": str(after), "X-Corpus-At": str(head), "X-Corpus-Next": str(next_after),
            "X-Corpus-Has-More": "true" if next_after < head else "false",
            "X-Corpus-Earliest": str(bounds["earliest"]),
            "Link": f'<{CHANGES_PATH}?{urlencode(query)}>; rel="next"',
        }
        if last is None or request.method == "HEAD":
            response = await _start(request, headers)
            await delivered(request, response)
            return response
        # Opened before the status line goes out: past it, a failure can only cut the connection.
        cursor = await conn.cursor(_PAGE, after, last)
        response = await _start(request, headers)
        await _pump(request, response, _page_chunks(cursor))
    return response


async def _page_chunks(cursor: Any) -> AsyncIterator[bytes]:
    """The page's lines, one chunk per fetch: :data:`FIRST_FETCH_ROWS` first, then as many as the
    longest line of the fetch before fits :data:`CHUNK_BYTES` times (at least one, at most
    :data:`FETCH_ROWS`)."""
    count = FIRST_FETCH_ROWS
    while True:
        rows = await cursor.fetch(count)
        if not rows:
            return
        lines = [row[0] for row in rows]
        count = max(1, min(FETCH_ROWS, CHUNK_BYTES // max(map(len, lines))))
        yield b"".join(lines)


# --- GET /corpus/snapshot.jsonl ----------------------------------------------------------------

_SNAPSHOT_HEAD = "select coalesce(max(sequence), 0) from changes"
# Every entity row is committed in the same transaction as the change that created it, so within
# one snapshot an entity is visible exactly when its change is: joining through ``changes`` is exact.
_SNAPSHOT_CONVERSATIONS = (
    f"select {rows.CONVERSATION_COLUMNS}{rows.CONVERSATION_FROM} order by ca.created_sequence")
_SNAPSHOT_MESSAGES = f"select {rows.MESSAGE_COLUMNS}{rows.MESSAGE_FROM} order by f.sequence"
_SNAPSHOT_RELATIONSHIPS = (
    "select ch.sequence, r.id, r.type, r.source_message_id, r.target_message_id, r.author_id,"
    " a.name as author_name, r.created_at, x.id as retraction_id, xc.sequence as retraction_sequence,"
    " x.created_at as retraction_created_at"
    " from changes ch join relationships r on r.id = ch.relationship_id join agents a on a.agent_id = r.author_id"
    " left join retractions x on x.relationship_id = r.id"
    " left join changes xc on xc.retraction_id = x.id"
    " where ch.relationship_id is not null order by ch.sequence")


#: (kind, query, builder) in the order entities sharing a sequence are written: a conversation
#: before its root message.
_SNAPSHOT_SOURCES: tuple[tuple[str, str, Callable[[Any], dict[str, Any]]], ...] = (
    ("conversation", _SNAPSHOT_CONVERSATIONS, rows.conversation),
    ("message", _SNAPSHOT_MESSAGES, rows.message),
    ("relationship", _SNAPSHOT_RELATIONSHIPS, rows.relationship),
)


class _Source:
    """One kind's rows, read ahead a batch at a time from its cursor."""

    def __init__(self, rank: int, kind: str, cursor: Any, build: Callable[[Any], dict[str, Any]]) -> None:
        self.rank, self.kind, self.cursor, self.build = rank, kind, cursor, build
        self.rows: list[Any] = []
        self.at = 0
        self.done = False

    async def peek(self) -> Any | None:
        if self.at == len(self.rows) and not self.done:
            self.rows, self.at = await self.cursor.fetch(SNAPSHOT_FETCH_ROWS), 0
            self.done = not self.rows
        return None if self.done else self.rows[self.at]

    def line(self) -> bytes:
        row = self.rows[self.at]
        self.at += 1
        return rep.dumps({"kind": self.kind, "sequence": row["sequence"], "data": self.build(row)}) + b"\n"


async def _snapshot_chunks(sources: list[_Source]) -> AsyncIterator[bytes]:
    """The kinds' rows merged in (sequence, kind rank) order, in chunks of about :data:`CHUNK_BYTES`
    (or :data:`FETCH_ROWS` lines)."""
    chunk: list[bytes] = []
    size = 0
    while True:
        best: _Source | None = None
        best_key: tuple[int, int] | None = None
        for source in sources:
            row = await source.peek()
            if row is not None and (best_key is None or (row["sequence"], source.rank) < best_key):
                best, best_key = source, (row["sequence"], source.rank)
        if best is None:
            break
        line = best.line()
        chunk.append(line)
        size += len(line)
        if len(chunk) >= FETCH_ROWS or size >= CHUNK_BYTES:
            yield b"".join(chunk)
            chunk, size = [], 0
    if chunk:
        yield b"".join(chunk)


async def snapshot(request: web.Request) -> web.StreamResponse:
    """``GET /corpus/snapshot.jsonl``: current state as resource lines, at boundary ``X-Corpus-At``."""
    corpus_id, lineage = node_identity(request)
    Query(request.query, ())
    _accept_jsonl(request)
    async with request.app[EXPORT_SLOTS].hold(request), connection(request.app[NODE].db) as conn, \
            conn.transaction(isolation="repeatable_read", readonly=True):
        at = await conn.fetchval(_SNAPSHOT_HEAD)  # the first statement fixes the transaction's snapshot
        headers = {**identity_headers(corpus_id, lineage), "X-Corpus-At": str(at),
                   "Link": f'<{CHANGES_PATH}?{urlencode({"after": at, "lineage": lineage})}>; rel="next"'}
        if request.method == "HEAD":
            response = await _start(request, headers)
            await delivered(request, response)
            return response
        # The cursors are opened before the status line goes out (see changes()).
        sources = [_Source(rank, kind, await conn.cursor(query), build)
                   for rank, (kind, query, build) in enumerate(_SNAPSHOT_SOURCES)]
        response = await _start(request, headers)
        await _pump(request, response, _snapshot_chunks(sources))
    return response


# --- GET /corpus -------------------------------------------------------------------------------

async def corpus_info(request: web.Request) -> web.Response:
    """``GET /corpus``: identity, head and earliest sequence, counts and the synchronization links.

    Negotiated like the read routes (actors.web.render): JSON, JSON-LD, Markdown, or a page for
    browsers; any other ``Accept`` is 406.
    """
    media = choose(request, BROWSABLE_TYPES)
    corpus_id, lineage = node_identity(request)
    Query(request.query, ())
    body = await corpus_info_body(request.app[NODE].db.pool, corpus_id, lineage)
    identity = identity_headers(corpus_id, lineage)
    return respond(request, Document("corpus", body, "Corpus", headers=identity,
                                     cache_control=identity["Cache-Control"]), media)

