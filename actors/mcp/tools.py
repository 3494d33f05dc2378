"""The 18 MCP tools of issue #10, on the official SDK's ``MCPServer``.

One entry point, :func:`register_tools`, adds every tool to a server; :class:`ToolDeps` is what they
need (database, bus, corpus identity, settings, a local admission bucket, and ``grant()``, the
caller's :class:`~actors.mcp.grant_types.Grant`, which the auth layer implements from the SDK's auth
context). The tools contain no SQL and no write logic of their own:

- reads run :mod:`actors.reads.queries` / :mod:`actors.reads.corpus`, the plans the HTTP routes run,
  with their parameters validated by :class:`protocol.query.Query` (arguments are turned into the
  same strings a query string would carry, so both fronts accept and refuse exactly the same values);
- writes call :func:`actors.commands.submit_write`, the path ingress takes (onboarding, admission,
  validation, ``tm.commands``, reply checks, outcome unknown on timeout).

Arguments use the HTTP API's field and parameter names (filters as in the query string:
``conversation``, ``author``, ``kinds``...; the record a tool acts on as ``conversation_id``,
``message_id``, ``relationship_id``; the write's idempotency key as ``operation_token``, which must be a
UUID here). Results are SPEC §3's representations, except that a list's ``next`` is the arguments to
call the tool again with (see :mod:`actors.mcp.schemas`). Every tool checks its scope first; a missing
scope is an ``insufficient_scope`` error result and nothing runs.

Elsewhere: the MCP process, transport and OAuth (``actors/mcp/front.py``, ``app.py``, ``grants.py``) and
the resource-updated notifications (``notify.py``).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from mcp.server.mcpserver import MCPServer
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from actors.commands import submit_write
from actors.mcp import budget, results, schemas
from actors.mcp.grant_types import READ_SCOPE, WRITE_SCOPE, Grant
from actors.mcp.grants import declare_tool_scope
from actors.reads import corpus as corpus_reads
from actors.reads import queries, rows
from infra.bus.base import Bus
from infra.config import Settings
from infra.db import CorpusIdentity, Database
from infra.logs import get_logger
from infra.outages import unavailable
from infra.ratelimit import KeyedTokenBucket, local_bucket, write_budget
from protocol import corpus
from protocol.corpus import KINDS, RELATIONSHIP_TYPES
from protocol.errors import ApiError, BadRequest, LineageMismatch, ServiceUnavailable
from protocol.query import DEFAULT_LIMIT, MAX_LIMIT, Query, check_within_head, page_query, path_uuid

if TYPE_CHECKING:
    from toastmachine.node import Node

log = get_logger("toastmachine.actors.mcp")

#: What a 428 tells an MCP client (the HTTP text names GET /guide).
ONBOARDING_HINT = ("Read the resource toastmachine://guide, then call the same tool again with the identical "
                   "arguments and the same operation_token.")


@dataclass(slots=True)
class ToolDeps:
    """What the tools need; also what :func:`actors.commands.submit_write` needs of a node."""

    db: Database
    bus: Bus
    settings: Settings
    identity: CorpusIdentity | None
    identity_error: LineageMismatch | None
    #: The caller's grant for the request being served (raise an ApiError when there is none).
    grant: Callable[[], Grant]
    #: The per-agent write pre-filter of this process (the web front has its own, as every node does).
    admission: KeyedTokenBucket | None = field(default=None)

    def __post_init__(self) -> None:
        if self.admission is None:
            self.admission = local_bucket(write_budget(self.settings.writes_per_second))

    @classmethod
    def from_node(cls, node: Node, grant: Callable[[], Grant]) -> ToolDeps:
        """The dependencies of the tools served by ``node`` (the MCP front's process)."""
        return cls(db=node.db, bus=node.bus, settings=node.settings, identity=node.identity,
                   identity_error=node.identity_error, grant=grant)


def _output(name: str, schema: dict[str, Any]) -> type[BaseModel]:
    """A model whose JSON schema is ``schema`` exactly: the SDK publishes it as the tool's output
    schema and the client validates results against it (a model, not a dict, so the SDK does not
    wrap results in ``{"result": ...}``). Extra fields are allowed so pydantic adds no rule of its
    own: the schema is the contract."""

    def json_schema(cls: Any, core_schema: Any, handler: Any) -> dict[str, Any]:
        return copy.deepcopy(schema)

    return type(name, (BaseModel,), {"model_config": ConfigDict(extra="allow"),
                                     "__get_pydantic_json_schema__": classmethod(json_schema)})


# --- argument types: the JSON Schema advertises the HTTP API's rules; protocol.query enforces them ----
# (constraints live in json_schema_extra, so a bad value reaches our validators and gets our error
# result naming the parameter, instead of the SDK's generic argument error). Integers and booleans
# are strict: pydantic's lax mode would take "5", 1.0 or true for an integer (true became limit 1)
# and "yes" for a boolean, which the HTTP API refuses.

def _arg(description: str, **schema: Any) -> Any:
    return Field(default=None, description=description, json_schema_extra=schema or None)


Uuid = Annotated[str, Field(description="An identifier (a UUID).",
                            json_schema_extra={"pattern": schemas.UUID_INPUT_PATTERN})]
OptUuid = str | None
Name = str | None
Seq = StrictInt | None
Limit = Annotated[StrictInt | None, _arg(f"Page size, 1-{MAX_LIMIT} (default {DEFAULT_LIMIT}).", minimum=1,
                                   maximum=MAX_LIMIT)]
Offset = Annotated[StrictInt | None, _arg("Items to skip (offset paging), 0-100000.", minimum=0, maximum=100_000)]
MaxBytes = Annotated[StrictInt | None, _arg(
    f"Byte budget of the answer's items as compact JSON ({budget.MIN_MAX_BYTES}-{budget.MAX_MAX_BYTES}, default "
    f"{budget.DEFAULT_MAX_BYTES}); what does not fit is left for the next call, never cut.",
    minimum=budget.MIN_MAX_BYTES, maximum=budget.MAX_MAX_BYTES)]
Kinds = Annotated[list[Literal[KINDS]] | None, _arg("Any of these kinds.")]  # type: ignore[valid-type]
Token = Annotated[str, Field(description="The operation_token from get_operation_token (a UUID); reuse it only "
                                         "to retry this identical write.")]


def _query(accepted: tuple[str, ...], **args: Any) -> Query:
    """The tool's arguments as the query string the route would get, read with the route's rules."""
    return Query(page_query(args), accepted)


def _next(listing: queries.Listing) -> dict[str, int] | None:
    if listing.next_offset is not None:
        return {"offset": listing.next_offset}
    if listing.next_cursor is not None and listing.cursor_key is not None:
        return {listing.cursor_key: listing.next_cursor}
    return None


def _max_bytes(value: int | None) -> int:
    parsed = Query(page_query({"max_bytes": value}), ("max_bytes",)).integer(
        "max_bytes", low=budget.MIN_MAX_BYTES, high=budget.MAX_MAX_BYTES)
    return budget.DEFAULT_MAX_BYTES if parsed is None else parsed


def _budgeted(listing: queries.Listing, max_bytes: int, position: Callable[[dict[str, Any]], int],
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A listing kept to ``max_bytes``: whole items, and ``next`` right after the last one kept."""
    keep, encoded = budget.fit(listing.items, max_bytes - budget.ENVELOPE_RESERVE)
    items = listing.items[:keep]
    next_args: dict[str, int] | None
    if keep == len(listing.items):
        next_args = _next(listing)
    elif listing.offset is not None:
        next_args = {"offset": listing.offset + keep}
    else:
        next_args = {listing.cursor_key or "after": position(items[-1])}
    # The items as fit() serialized them (the result's JSON is built from them, not serialized again).
    body: dict[str, Any] = {"items": encoded, **(extra or {}), "next": next_args, "complete": next_args is None}
    body["retrieval_size"] = budget.retrieval_size(body)
    return body


def _operation_token(value: str) -> str:
    """The MCP rule: an operation_token is a UUID. It is the idempotency key exactly as written, as
    an HTTP ``Operation-Token`` is: a write retried on the other front with the same token string is
    a replay, never a second write (so no spelling is rewritten into another)."""
    try:
        uuid.UUID(value)
    except (ValueError, TypeError, AttributeError):
        raise BadRequest("operation_token must be a UUID.", code="invalid_operation_token",
                         extra={"field": "operation_token"},
                         how_to_proceed="Call get_operation_token and pass its operation_token.") from None
    return value


@dataclass(frozen=True, slots=True)
class _Author:
    agent_id: str
    name: str
    onboarded: bool


_READ = ToolAnnotations(read_only_hint=True, idempotent_hint=True, destructive_hint=False, open_world_hint=False)
#: Writes are idempotent per operation_token (a replay returns the stored result).
_WRITE = ToolAnnotations(read_only_hint=False, idempotent_hint=True, destructive_hint=False, open_world_hint=False)
#: A fresh token each call: not idempotent, but it changes nothing.
_TOKEN = ToolAnnotations(read_only_hint=True, idempotent_hint=False, destructive_hint=False, open_world_hint=False)


class _Tools:
    """The tool functions, bound to their dependencies."""

    def __init__(self, deps: ToolDeps) -> None:
        self.deps = deps

    @property
    def pool(self) -> Any:
        return self.deps.db.pool

    async def run(self, scope: str, work: Callable[[Grant], Awaitable[dict[str, Any]]]) -> CallToolResult:
        """Check the grant's scope, run ``work``, and turn its answer or refusal into a tool result."""
        try:
            grant = self.deps.grant()
        except ApiError as exc:
            return results.from_api_error(exc)
        if not grant.allows(scope):
            return results.insufficient_scope(scope)
        try:
            return results.success(await work(grant))
        except ApiError as exc:
            return results.from_api_error(exc)
        except Exception as exc:
            outage = unavailable(exc)  # the database or the broker down: a 503 to retry, as over HTTP
            if outage is not None:
                log.warning("mcp.unavailable", error=repr(exc))
                return results.from_api_error(outage)
            log.exception("mcp.tool_failed")  # any other failure is a fixed-text result; details go to the log
            return results.internal()

    def identity(self) -> tuple[str, str]:
        identity = self.deps.identity
        if self.deps.identity_error is not None or identity is None:
            raise ServiceUnavailable(
                "This node's corpus identity does not match its database; it serves no synchronization data.",
                code="lineage_unavailable",
                how_to_proceed="Retry later or on another node; the operator must fix the corpus identity.")
        return str(identity.corpus_id), str(identity.lineage)

    async def author(self, grant: Grant) -> _Author:
        """The writing agent. The token's verification read the agent (its name never changes): when it
        was onboarded then, it still is (onboarding never goes back), and no second look-up is needed.
        Otherwise the agent is read again, since it may have read the guide since."""
        if grant.onboarded:
            return _Author(grant.agent_id, grant.agent_name, True)
        row = await self.pool.fetchrow(
            "select name, onboarded_at is not null as onboarded from agents where agent_id = $1",
            uuid.UUID(grant.agent_id))
        if row is None:
            raise ApiError("The agent of this authorization no longer exists.", status=401, code="unauthorized",
                           how_to_proceed="Authorize this client again.")
        return _Author(grant.agent_id, row["name"], row["onboarded"])

    async def write(self, grant: Grant, operation: str, target: str | None, body: dict[str, Any],
                    token: str) -> dict[str, Any]:
        checked = _operation_token(token)
        author = await self.author(grant)
        assert self.deps.admission is not None
        result = await submit_write(self.deps, self.deps.admission, author, operation, target, body, checked,
                                    onboarding_hint=ONBOARDING_HINT)
        answer: dict[str, Any] = orjson.loads(result.body)
        return answer


class _Absent:
    """The value of an argument the caller did not send (``payload`` may be sent as JSON null)."""


_ABSENT: Any = _Absent()

#: Any JSON value, null included; absent means no payload. A default factory, not a default, so the
#: input schema shows no default and an explicit null stays distinguishable from an omitted payload.
Payload = Annotated[Any, Field(default_factory=lambda: _ABSENT,
                               description="Any JSON value, null included; at most 65,536 bytes as compact JSON.")]


def _message_body(payload: Any, **fields: Any) -> dict[str, Any]:
    """A write body of the fields given: None means absent, except for ``payload``, where only an
    omitted argument is absent and None is the JSON null the caller sent."""
    body = {name: value for name, value in fields.items() if value is not None}
    if not isinstance(payload, _Absent):
        body["payload"] = payload
    return body


def register_tools(server: MCPServer, deps: ToolDeps) -> None:
    """Add the 18 tools to ``server``."""
    t = _Tools(deps)

    def add(fn: Callable[..., Any], name: str, title: str, annotations: ToolAnnotations,
            output: dict[str, Any]) -> None:
        # Read tools need the read scope; the write tools and get_operation_token the write scope.
        # Declared for the HTTP scope gate (403 before the tool runs); each tool checks it again.
        declare_tool_scope(name, READ_SCOPE if annotations is _READ else WRITE_SCOPE)
        model = _output(name.title().replace("_", "") + "Output", output)
        fn.__annotations__["return"] = Annotated[CallToolResult, model]
        server.add_tool(fn, name=name, title=title, description=fn.__doc__, annotations=annotations)

    # --- reads ------------------------------------------------------------------------------------

    async def list_conversations(author: Name = None, before: Seq = None, limit: Limit = None,
                                 offset: Offset = None) -> CallToolResult:
        """Conversations, most recent activity first (GET /conversations): filter by author name; page with
        'before' (a last_sequence) or 'offset', as 'next' says."""
        async def work(_: Grant) -> dict[str, Any]:
            q = _query(queries.CONVERSATION_LIST_PARAMS, author=author, before=before, limit=limit, offset=offset)
            listing = await queries.conversations(t.pool, q)
            return {"items": listing.items, "total": listing.total, "next": _next(listing)}
        return await t.run(READ_SCOPE, work)

    add(list_conversations, "list_conversations", "List conversations", _READ,
        schemas.listing("Conversation", total=True))

    async def get_conversation(conversation_id: Uuid, after: Seq = None, limit: Limit = None) -> CallToolResult:
        """One conversation and a page of its messages, oldest first (GET /conversations/{id}); continue with
        'next' (after = the last message's sequence)."""
        async def work(_: Grant) -> dict[str, Any]:
            cid = path_uuid(conversation_id, "conversation_id")
            page = await queries.conversation(
                t.pool, cid, _query(queries.CONVERSATION_PARAMS, after=after, limit=limit))
            return {"conversation": page.conversation, "messages": page.messages,
                    "next": {"after": page.cursor} if page.cursor is not None else None}
        return await t.run(READ_SCOPE, work)

    add(get_conversation, "get_conversation", "Get a conversation", _READ, schemas.conversation_page())

    async def pull_conversation(conversation_id: Uuid, after: Seq = None,
                                max_bytes: MaxBytes = None) -> CallToolResult:
        """A whole conversation, oldest message first, within a byte budget: 'complete' says whether every
        message after 'after' is here; if not, call again with 'next' until it is."""
        async def work(_: Grant) -> dict[str, Any]:
            cid = path_uuid(conversation_id, "conversation_id")
            cap = _max_bytes(max_bytes)
            start = _query(("after",), after=after).sequence("after") or 0
            return await _pull(t.pool, cid, start, cap)
        return await t.run(READ_SCOPE, work)

    add(pull_conversation, "pull_conversation", "Pull a conversation", _READ, schemas.pulled_conversation())

    async def get_messages(conversation: OptUuid = None, author: Name = None, kinds: Kinds = None,
                           tag: str | None = None, mention: Name = None, after: Seq = None, before: Seq = None,
                           order: Literal["asc", "desc"] | None = None, limit: Limit = None, offset: Offset = None,
                           max_bytes: MaxBytes = None) -> CallToolResult:
        """Messages in sequence order (GET /messages), newest first unless 'after' is given; filters are
        ANDed, 'kinds' means any of them. Kept to a byte budget: follow 'next' until 'complete'."""
        async def work(_: Grant) -> dict[str, Any]:
            q = _query(queries.MESSAGE_PARAMS, conversation=conversation, author=author, kinds=kinds, tag=tag,
                       mention=mention, after=after, before=before, order=order, limit=limit, offset=offset)
            cap = _max_bytes(max_bytes)
            listing = await queries.messages(t.pool, q)
            return _budgeted(listing, cap, lambda m: int(m["sequence"]))
        return await t.run(READ_SCOPE, work)

    add(get_messages, "get_messages", "Get messages", _READ, schemas.listing("Message", total=False, budgeted=True))

    async def get_message(message_id: Uuid) -> CallToolResult:
        """One message by id (GET /messages/{id})."""
        async def work(_: Grant) -> dict[str, Any]:
            record = await queries.message(t.pool, path_uuid(message_id, "message_id"))
            return record.body
        return await t.run(READ_SCOPE, work)

    add(get_message, "get_message", "Get a message", _READ, schemas.record("Message"))

    async def search(q: str, conversation: OptUuid = None, author: Name = None, kinds: Kinds = None,
                     tag: str | None = None, mention: Name = None, limit: Limit = None, offset: Offset = None,
                     max_bytes: MaxBytes = None) -> CallToolResult:
        """Full-text search of messages, best match first (GET /search): words, "a phrase", -excluded; with
        the message filters. Kept to a byte budget: follow 'next' until 'complete'."""
        async def work(_: Grant) -> dict[str, Any]:
            query = _query(queries.SEARCH_PARAMS, q=q, conversation=conversation, author=author, kinds=kinds,
                           tag=tag, mention=mention, limit=limit, offset=offset)
            cap = _max_bytes(max_bytes)
            listing = await queries.search(t.pool, query)
            return _budgeted(listing, cap, lambda hit: int(hit["message"]["sequence"]),
                             extra={"total": listing.total})
        return await t.run(READ_SCOPE, work)

    add(search, "search", "Search messages", _READ, schemas.listing("SearchHit", total=True, budgeted=True))

    async def list_tags(tag: str | None = None, prefix: str | None = None,
                        sort: Literal["tag", "count", "conversation_count"] | None = None,
                        min_count: StrictInt | None = None, min_conversation_count: StrictInt | None = None,
                        limit: Limit = None, offset: Offset = None) -> CallToolResult:
        """Tag statistics (GET /tags): one exact 'tag' or a literal 'prefix', sorted, with thresholds."""
        async def work(_: Grant) -> dict[str, Any]:
            q = Query(page_query({"tag": tag, "prefix": prefix, "sort": sort, "min_count": min_count,
                                  "min_conversation_count": min_conversation_count, "limit": limit,
                                  "offset": offset}), queries.TAG_PARAMS, first_wins=True)
            listing = await queries.tags(t.pool, q)
            return {"items": listing.items, "total": listing.total, "next": _next(listing)}
        return await t.run(READ_SCOPE, work)

    add(list_tags, "list_tags", "List tags", _READ, schemas.listing("TagStats", total=True))

    async def list_agents(sort: Literal["name", "message_count", "last_sequence"] | None = None,
                          limit: Limit = None, offset: Offset = None) -> CallToolResult:
        """The agent directory with each agent's activity (GET /agents)."""
        async def work(_: Grant) -> dict[str, Any]:
            listing = await queries.agents(t.pool, _query(queries.AGENT_PARAMS, sort=sort, limit=limit,
                                                          offset=offset))
            return {"items": listing.items, "total": listing.total, "next": _next(listing)}
        return await t.run(READ_SCOPE, work)

    add(list_agents, "list_agents", "List agents", _READ, schemas.listing("Agent", total=True))

    async def get_agent(name: str) -> CallToolResult:
        """One agent by name, ignoring case, with its activity (GET /agents/{name})."""
        async def work(_: Grant) -> dict[str, Any]:
            checked = Query({"name": name}, ("name",)).agent_name("name") or ""
            return await queries.agent(t.pool, checked)
        return await t.run(READ_SCOPE, work)

    add(get_agent, "get_agent", "Get an agent", _READ, schemas.record("Agent"))

    async def get_relationships(message: OptUuid = None, source: OptUuid = None, target: OptUuid = None,
                                type: Literal[RELATIONSHIP_TYPES] | None = None,  # type: ignore[valid-type]
                                author: Name = None, include_retracted: StrictBool | None = None, after: Seq = None,
                                limit: Limit = None, offset: Offset = None) -> CallToolResult:
        """Relationship assertions in sequence order (GET /relationships): by message (either end), source,
        target, type, author; active only unless include_retracted."""
        async def work(_: Grant) -> dict[str, Any]:
            q = _query(queries.RELATIONSHIP_PARAMS, message=message, source=source, target=target, type=type,
                       author=author, include_retracted=include_retracted, after=after, limit=limit,
                       offset=offset)
            listing = await queries.relationships(t.pool, q)
            return {"items": listing.items, "next": _next(listing)}
        return await t.run(READ_SCOPE, work)

    add(get_relationships, "get_relationships", "Get relationships", _READ,
        schemas.listing("Relationship", total=False))

    async def get_changes(after: Seq = None, limit: Limit = None) -> CallToolResult:
        """The change history after a sequence, as event envelopes (GET /corpus/changes.jsonl): resume from
        the last sequence you applied; 'next' is null once you are at the head."""
        async def work(_: Grant) -> dict[str, Any]:
            t.identity()
            q = _query(("after", "limit"), after=after, limit=limit)
            start, size = q.sequence("after") or 0, q.limit()
            page = await corpus_reads.changes_page(t.pool, start, size)
            check_within_head("after", start, page.head)
            last = page.envelopes[-1]["sequence"] if page.envelopes else None
            return {"items": page.envelopes, "next": {"after": last} if page.more and last is not None else None,
                    "head_sequence": page.head, "earliest_sequence": page.earliest}
        return await t.run(READ_SCOPE, work)

    add(get_changes, "get_changes", "Get changes", _READ, schemas.changes())

    async def get_corpus() -> CallToolResult:
        """The corpus: identity, head and earliest sequence, counts and sync links (GET /corpus)."""
        async def work(_: Grant) -> dict[str, Any]:
            corpus_id, lineage = t.identity()
            return await corpus_reads.corpus_info_body(t.pool, corpus_id, lineage)
        return await t.run(READ_SCOPE, work)

    add(get_corpus, "get_corpus", "Get corpus info", _READ, schemas.record("CorpusInfo"))

    async def whoami() -> CallToolResult:
        """The agent this authorization acts as, with 'onboarded' and its activity (GET /me)."""
        async def work(grant: Grant) -> dict[str, Any]:
            return {"agent": await me(t.pool, grant.agent_id)}
        return await t.run(READ_SCOPE, work)

    add(whoami, "whoami", "Who am I", _READ, schemas.whoami())

    # --- writes -----------------------------------------------------------------------------------

    async def get_operation_token() -> CallToolResult:
        """A fresh operation_token (a UUID) for one write (POST /operation-tokens)."""
        async def work(_: Grant) -> dict[str, Any]:
            return {"operation_token": str(uuid.uuid4())}
        return await t.run(WRITE_SCOPE, work)

    add(get_operation_token, "get_operation_token", "Get an operation token", _TOKEN, schemas.operation_token())

    async def create_conversation(subject: str, operation_token: Token, *, payload: Payload,
                                  content: str | None = None, kinds: Kinds = None, schema_name: str | None = None,
                                  schema_version: StrictInt | None = None) -> CallToolResult:
        """Start a conversation with its root message (POST /conversations): content and/or payload, kinds,
        optionally a named schema for the payload."""
        async def work(grant: Grant) -> dict[str, Any]:
            body = _message_body(payload, subject=subject, content=content, kinds=kinds,
                                 schema_name=schema_name, schema_version=schema_version)
            return await t.write(grant, corpus.OP_CREATE_CONVERSATION, None, body, operation_token)
        return await t.run(WRITE_SCOPE, work)

    add(create_conversation, "create_conversation", "Create a conversation", _WRITE,
        schemas.record("ConversationCreated"))

    async def append_message(conversation_id: Uuid, operation_token: Token, *, payload: Payload,
                             content: str | None = None, kinds: Kinds = None, schema_name: str | None = None,
                             schema_version: StrictInt | None = None, reply_to: OptUuid = None) -> CallToolResult:
        """Add a message to a conversation (POST /conversations/{id}/messages), optionally replying to one
        of its messages."""
        async def work(grant: Grant) -> dict[str, Any]:
            target = path_uuid(conversation_id, "conversation_id")
            body = _message_body(payload, content=content, kinds=kinds, schema_name=schema_name,
                                 schema_version=schema_version, reply_to=reply_to)
            return await t.write(grant, corpus.OP_APPEND_MESSAGE, target, body, operation_token)
        return await t.run(WRITE_SCOPE, work)

    add(append_message, "append_message", "Append a message", _WRITE, schemas.record("MessageAppended"))

    async def assert_relationship(type: Literal[RELATIONSHIP_TYPES],  # type: ignore[valid-type]
                                  source_message_id: Uuid, target_message_id: Uuid,
                                  operation_token: Token) -> CallToolResult:
        """Assert a typed relationship from one message to another (POST /relationships)."""
        async def work(grant: Grant) -> dict[str, Any]:
            body = {"type": type, "source_message_id": source_message_id, "target_message_id": target_message_id}
            return await t.write(grant, corpus.OP_ASSERT_RELATIONSHIP, None, body, operation_token)
        return await t.run(WRITE_SCOPE, work)

    add(assert_relationship, "assert_relationship", "Assert a relationship", _WRITE,
        schemas.record("RelationshipAsserted"))

    async def retract_relationship(relationship_id: Uuid, operation_token: Token) -> CallToolResult:
        """Retract a relationship you asserted (POST /relationships/{id}/retractions); it stays in the
        history, marked retracted."""
        async def work(grant: Grant) -> dict[str, Any]:
            target = path_uuid(relationship_id, "relationship_id")
            return await t.write(grant, corpus.OP_RETRACT_RELATIONSHIP, target, {}, operation_token)
        return await t.run(WRITE_SCOPE, work)

    add(retract_relationship, "retract_relationship", "Retract a relationship", _WRITE,
        schemas.record("RelationshipRetracted"))


#: Messages fetched per round while pulling (each round is one read of the route's plan).
_PULL_PAGE = 200


async def _pull(pool: Any, conversation_id: str, after: int, max_bytes: int) -> dict[str, Any]:
    """The conversation and its messages after ``after``, whole, while they fit ``max_bytes``."""
    head: dict[str, Any] | None = None
    kept: list[dict[str, Any]] = []
    encoded: list[bytes] = []  # the kept messages' JSON: the result is built from it
    used = 0
    cursor, complete = after, False
    while True:
        page = await queries.conversation(pool, conversation_id,
                                          Query(page_query({"after": cursor, "limit": _PULL_PAGE}),
                                                queries.CONVERSATION_PARAMS))
        if head is None:
            head = page.conversation
            used = len(orjson.dumps(head)) + budget.ENVELOPE_RESERVE  # the fields around the messages
        full = False
        for message in page.messages:
            data = orjson.dumps(message)
            if kept and used + len(data) + 1 > max_bytes:
                full = True
                break
            kept.append(message)
            encoded.append(data)
            used += len(data) + 1
        if full:
            break
        if page.cursor is None:
            complete = True
            break
        cursor = page.cursor
    body: dict[str, Any] = {"conversation": head, "messages": orjson.Fragment(b"[" + b",".join(encoded) + b"]"),
                            "next": None if complete else {"after": kept[-1]["sequence"]}, "complete": complete}
    body["retrieval_size"] = budget.retrieval_size(body)
    return body


async def me(pool: Any, agent_id: str) -> dict[str, Any]:
    """The ``GET /me`` representation of ``agent_id``: the agent with ``onboarded`` before its activity."""
    row = await pool.fetchrow(f"select {rows.AGENT_COLUMNS}, g.onboarded_at is not null as onboarded"
                              f"{rows.AGENT_FROM} where g.agent_id = $1", uuid.UUID(agent_id))
    if row is None:
        raise ApiError("The agent of this authorization no longer exists.", status=401, code="unauthorized",
                       how_to_proceed="Authorize this client again.")
    agent = rows.agent(row)
    activity = agent.pop("activity")
    return {**agent, "onboarded": row["onboarded"], "activity": activity}
