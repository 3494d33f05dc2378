"""The MCP tools and resources (issue #10 items 5 and 6) through the SDK's own client.

Each test runs the official ``mcp`` client against a real ``MCPServer`` with :func:`register_tools`
and :func:`register_resources`, connected in-process by the SDK (``Client(server)``, its in-memory
transport), over the ``stack`` of tests/corpus_fixtures.py: a real corpus writer, database and bus
(embedded PostgreSQL + in-process bus, and PostgreSQL + RabbitMQ). Data is written and compared
through the real HTTP API of the same stack.

There is no OAuth in this branch (another slice builds it): ``ToolDeps.grant`` returns a Grant for an
agent registered through the real ``POST /register``, with the scopes each test chooses.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator
from mcp import Client
from mcp_types import CallToolResult, TextContent

from actors.mcp import schemas
from actors.mcp.grant_types import READ_SCOPE, WRITE_SCOPE, Grant
from actors.mcp.resources import CORPUS_URI, GUIDE_URI, register_resources
from actors.mcp.server import ToastMachineServer
from actors.mcp.tools import ToolDeps, register_tools
from actors.web.context import NODE
from actors.writer import CorpusWriter
from infra.ratelimit import write_budget
from protocol.schemas import FORMAT_CHECKER
from tests.corpus_fixtures import Agent, Stack

READ_TOOLS = {"list_conversations", "get_conversation", "pull_conversation", "get_messages", "get_message",
              "search", "list_tags", "list_agents", "get_agent", "get_relationships", "get_changes", "get_corpus",
              "whoami"}
WRITE_TOOLS = {"get_operation_token", "create_conversation", "append_message", "assert_relationship",
               "retract_relationship"}
BOTH = frozenset({READ_SCOPE, WRITE_SCOPE})

pytestmark = pytest.mark.timeout(120)


@dataclass(slots=True)
class Mcp:
    """An SDK client connected to the tools of one stack, acting as ``grant``."""

    client: Client
    stack: Stack
    grant: list[Grant]
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)

    def act_as(self, agent: Agent, scopes: frozenset[str] = BOTH) -> None:
        self.grant[0] = Grant(agent.agent_id, agent.name, "test-client", scopes)

    async def call(self, tool: str, /, **arguments: Any) -> CallToolResult:
        """Call ``name``; check that the text is the structured content's JSON and, for a success,
        that it validates against the declared output schema."""
        result = await self.client.call_tool(tool, arguments)
        assert result.structured_content is not None, result
        text = result.content[0]
        assert isinstance(text, TextContent) and orjson.loads(text.text) == result.structured_content
        if not result.is_error:
            Draft202012Validator(self.schemas[tool], format_checker=FORMAT_CHECKER).validate(
                result.structured_content)
        return result

    async def ok(self, tool: str, /, **arguments: Any) -> dict[str, Any]:
        result = await self.call(tool, **arguments)
        assert not result.is_error, result.structured_content
        return result.structured_content  # type: ignore[return-value]

    async def error(self, tool: str, /, **arguments: Any) -> dict[str, Any]:
        result = await self.call(tool, **arguments)
        assert result.is_error, result.structured_content
        Draft202012Validator(schemas.error()).validate(result.structured_content)
        error = result.structured_content["error"]  # type: ignore[index]
        return error  # type: ignore[no-any-return]

    async def changes(self) -> int:
        return int(await self.stack.db.pool.fetchval("select count(*) from changes"))


@contextlib.asynccontextmanager
async def connect(stack: Stack, agent: Agent, scopes: frozenset[str] = BOTH) -> AsyncIterator[Mcp]:
    node = stack.client.app[NODE]
    holder = [Grant(agent.agent_id, agent.name, "test-client", scopes)]
    deps = ToolDeps.from_node(node, lambda: holder[0])
    server = ToastMachineServer("toastmachine-test")
    register_tools(server, deps)
    register_resources(server, deps)
    async with Client(server, raise_exceptions=True) as client:
        mcp = Mcp(client, stack, holder)
        for tool in (await client.list_tools()).tools:
            assert tool.output_schema is not None
            mcp.schemas[tool.name] = tool.output_schema
        yield mcp


async def _get(stack: Stack, path: str, **params: Any) -> Any:
    resp = await stack.client.get(path, params={k: str(v) for k, v in params.items() if v is not None})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def _seed(stack: Stack) -> dict[str, Any]:
    """Two agents, two conversations, tagged and mentioning messages, a payload, a relationship
    asserted and one retracted."""
    alice, bob = await stack.register("alice-mcp"), await stack.register("bob-mcp")
    first = await stack.conversation(alice, "Retry policy", content="How should #retries back off? @bob-mcp")
    cid = first["conversation"]["id"]
    second = await stack.message(bob, cid, content="Exponential #retries with jitter", kinds=["claim"],
                                 reply_to=first["message"]["id"])
    third = await stack.message(alice, cid, payload={"n": 1, "ok": True}, kinds=["verification"])
    other = await stack.conversation(bob, "Timeouts", content="What #timeouts do writers use?")
    rel = await stack.post(bob, "/relationships", {"type": "supports", "source_message_id": second["message"]["id"],
                                                   "target_message_id": first["message"]["id"]})
    assert rel.status == 201, rel.body
    gone = await stack.post(alice, "/relationships", {"type": "extends", "source_message_id": third["message"]["id"],
                                                      "target_message_id": first["message"]["id"]})
    retracted = await stack.post(alice, f"/relationships/{gone.body['relationship']['id']}/retractions", {})
    assert retracted.status == 201, retracted.body
    return {"alice": alice, "bob": bob, "cid": cid, "other": other["conversation"]["id"],
            "first": first["message"]["id"], "second": second["message"]["id"], "third": third["message"]["id"],
            "rel": rel.body["relationship"]["id"]}


async def test_tools_declare_schemas_titles_and_annotations(stack: Stack) -> None:
    alice = await stack.register()
    async with connect(stack, alice) as mcp:
        tools = {t.name: t for t in (await mcp.client.list_tools()).tools}
        assert set(tools) == READ_TOOLS | WRITE_TOOLS
        for name, tool in tools.items():
            assert tool.title and tool.description, name
            assert tool.output_schema is not None, name
            Draft202012Validator.check_schema(tool.output_schema)
            assert tool.output_schema["type"] == "object" and tool.input_schema["type"] == "object"
            assert tool.annotations is not None and tool.annotations.destructive_hint is False, name
            assert tool.annotations.read_only_hint is (name in READ_TOOLS or name == "get_operation_token"), name
            assert tool.annotations.idempotent_hint is (name != "get_operation_token"), name
        assert "operation_token" in tools["append_message"].input_schema["required"]
        resources = {str(r.uri): r for r in (await mcp.client.list_resources()).resources}
        assert resources[GUIDE_URI].mime_type == "text/markdown"
        assert resources[CORPUS_URI].mime_type == "application/json"


async def test_every_read_tool_answers_what_the_http_api_answers(stack: Stack) -> None:
    s = await _seed(stack)
    async with connect(stack, s["alice"]) as mcp:
        http = await _get(stack, "/conversations")
        mine = await mcp.ok("list_conversations")
        assert mine["items"] == http["items"] and mine["total"] == http["total"] and mine["next"] is None

        http = await _get(stack, f"/conversations/{s['cid']}")
        got = await mcp.ok("get_conversation", conversation_id=s["cid"].upper())
        assert got == {"conversation": http["conversation"], "messages": http["messages"], "next": None}

        message_filters: tuple[dict[str, Any], ...] = (
            {}, {"author": "BOB-MCP"}, {"kinds": "claim,verification"}, {"tag": "retries"}, {"mention": "bob-mcp"},
            {"conversation": s["cid"]}, {"after": 1}, {"before": 3})
        for params in message_filters:
            http = await _get(stack, "/messages", **params)
            args = {k: (v.split(",") if k == "kinds" else v) for k, v in params.items()}
            got = await mcp.ok("get_messages", **args)
            assert got["items"] == http["items"], params
            assert got["complete"] is True and got["next"] is None

        assert await mcp.ok("get_message", message_id=s["second"]) == await _get(stack, f"/messages/{s['second']}")

        http = await _get(stack, "/search", q="retries")
        got = await mcp.ok("search", q="retries")
        assert got["items"] == http["items"] and got["total"] == http["total"] == 2

        http = await _get(stack, "/tags", sort="count")
        got = await mcp.ok("list_tags", sort="count")
        assert (got["items"], got["total"]) == (http["items"], http["total"])

        http = await _get(stack, "/agents", sort="message_count")
        got = await mcp.ok("list_agents", sort="message_count")
        assert (got["items"], got["total"]) == (http["items"], http["total"])
        assert await mcp.ok("get_agent", name="Alice-MCP") == await _get(stack, "/agents/alice-mcp")

        for params in ({}, {"include_retracted": "true"}, {"message": s["first"]}, {"type": "supports"}):
            http = await _get(stack, "/relationships", **params)
            args = {k: (v == "true" if k == "include_retracted" else v) for k, v in params.items()}
            assert (await mcp.ok("get_relationships", **args))["items"] == http["items"], params

        assert await mcp.ok("get_corpus") == await _get(stack, "/corpus")
        resp = await stack.client.get("/me", headers=s["alice"].headers())
        assert (await mcp.ok("whoami")) == {"agent": await resp.json()}

        resp = await stack.client.get("/corpus/changes.jsonl", params={"after": "2", "limit": "3"},
                                      headers={"Accept": "application/x-ndjson"})
        lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
        got = await mcp.ok("get_changes", after=2, limit=3)
        assert got["items"] == lines and got["next"] == {"after": lines[-1]["sequence"]}
        assert got["head_sequence"] == int(resp.headers["X-Corpus-At"])
        beyond = await mcp.error("get_changes", after=got["head_sequence"] + 5)  # as the export and the stream
        assert beyond["field"] == "after" and "beyond the head" in beyond["message"], beyond

        resource = await mcp.client.read_resource(CORPUS_URI)
        assert orjson.loads(resource.contents[0].text) == await _get(stack, "/corpus")  # type: ignore[union-attr]


async def test_paging_rules_and_errors_are_the_http_apis(stack: Stack) -> None:
    s = await _seed(stack)
    async with connect(stack, s["alice"]) as mcp:
        # Cursor pages, continued with 'next', give the same items as the route's next links.
        http_items: list[Any] = []
        page = await _get(stack, "/messages", limit=2)
        while True:
            http_items += page["items"]
            if page["next"] is None:
                break
            page = await _get(stack, page["next"].split("?")[0], **dict(
                p.split("=") for p in page["next"].split("?")[1].split("&")))
        mine: list[Any] = []
        args: dict[str, Any] = {"limit": 2}
        while True:
            got = await mcp.ok("get_messages", **args)
            mine += got["items"]
            if got["next"] is None:
                break
            assert set(got["next"]) == {"before"}  # newest first: the route's cursor
            args = {**args, **got["next"]}
        assert mine == http_items and len(mine) == 4

        got = await mcp.ok("list_agents", limit=1)
        assert got["next"] == {"offset": 1} and got["total"] == 2

        # The route's refusals, with the route's codes and parameter names.
        error = await mcp.error("get_messages", after=1, offset=2)
        assert (error["category"], error["upstream_code"], error["field"], error["http_status"]) == (
            "invalid_argument", "invalid_parameter", "offset", 400)
        assert error["outcome"] == "not_applied" and error["retryable"] is False
        assert (await mcp.error("get_messages", after=1, order="desc"))["field"] == "order"
        assert (await mcp.error("list_tags", tag="a", prefix="b"))["field"] == "prefix"
        assert (await mcp.error("get_messages", limit=1001))["field"] == "limit"
        assert (await mcp.error("search", q="   "))["field"] == "q"
        assert (await mcp.error("get_messages", author="x"))["field"] == "author"
        assert (await mcp.error("get_conversation", conversation_id="nope"))["field"] == "conversation_id"
        missing = await mcp.error("get_message", message_id=str(uuid.uuid4()))
        assert (missing["category"], missing["upstream_code"], missing["http_status"]) == (
            "not_found", "message_not_found", 404)
        assert (await mcp.error("get_agent", name="nobody-here"))["upstream_code"] == "agent_not_found"
        # Hostile values are refused by the same validators, naming the argument; none is an internal error.
        for tool, args, field_name in (("get_messages", {"tag": "a\x00b"}, "tag"), ("search", {"q": "x" * 501}, "q"),
                                       ("get_messages", {"after": -1}, "after"), ("list_tags", {"min_count": 2**40}, "min_count"),
                                       ("get_relationships", {"message": "1; drop table agents"}, "message"),
                                       ("get_changes", {"after": 2**60}, "after")):
            error = await mcp.error(tool, **args)
            assert (error["category"], error["field"]) == ("invalid_argument", field_name), (tool, args)
            assert "drop table" not in error["message"] and "select" not in error["message"].lower()


#: Arguments of the wrong type (or missing) for a tool of each family, and the argument named.
_WRONG_TYPES: list[tuple[str, dict[str, Any], str, str]] = [
    ("list_conversations", {"limit": "plenty<script>"}, "limit", "invalid_argument"),
    # No coercion: what the HTTP API refuses as the wrong type, a tool refuses too.
    ("list_conversations", {"limit": True}, "limit", "invalid_argument"),
    ("list_conversations", {"limit": "5"}, "limit", "invalid_argument"),
    ("get_messages", {"limit": 5.0}, "limit", "invalid_argument"),
    ("get_changes", {"after": "1"}, "after", "invalid_argument"),
    ("get_relationships", {"include_retracted": "yes"}, "include_retracted", "invalid_argument"),
    ("get_relationships", {"include_retracted": 1}, "include_retracted", "invalid_argument"),
    ("create_conversation", {"subject": "s", "content": "c", "schema_name": "claim", "schema_version": "1",
                             "operation_token": str(uuid.uuid4())}, "schema_version", "invalid_argument"),
    ("create_conversation", {"subject": "s", "content": "c", "schema_name": "claim", "schema_version": True,
                             "operation_token": str(uuid.uuid4())}, "schema_version", "invalid_argument"),
    ("get_conversation", {"conversation_id": 12345}, "conversation_id", "invalid_argument"),
    ("get_conversation", {}, "conversation_id", "missing_argument"),
    ("pull_conversation", {"conversation_id": str(uuid.uuid4()), "max_bytes": [1, 2]}, "max_bytes",
     "invalid_argument"),
    ("get_messages", {"kinds": "claim"}, "kinds", "invalid_argument"),
    ("get_messages", {"kinds": ["not-a-kind"]}, "kinds", "invalid_argument"),
    ("get_messages", {"order": "sideways"}, "order", "invalid_argument"),
    ("get_message", {"message_id": {"$ne": None}}, "message_id", "invalid_argument"),
    ("search", {}, "q", "missing_argument"),
    ("list_tags", {"min_count": "many"}, "min_count", "invalid_argument"),
    ("list_agents", {"sort": 7}, "sort", "invalid_argument"),
    ("get_agent", {"name": ["alice"]}, "name", "invalid_argument"),
    ("get_relationships", {"include_retracted": "perhaps"}, "include_retracted", "invalid_argument"),
    ("get_changes", {"after": "SELECT 1"}, "after", "invalid_argument"),
    ("create_conversation", {"subject": ["x"], "operation_token": str(uuid.uuid4())}, "subject", "invalid_argument"),
    ("create_conversation", {"subject": "s"}, "operation_token", "missing_argument"),
    ("append_message", {"conversation_id": str(uuid.uuid4()), "operation_token": 42, "content": "hi"},
     "operation_token", "invalid_argument"),
    ("assert_relationship", {"type": "loves", "source_message_id": str(uuid.uuid4()),
                             "target_message_id": str(uuid.uuid4()), "operation_token": str(uuid.uuid4())},
     "type", "invalid_argument"),
    ("retract_relationship", {"relationship_id": None, "operation_token": str(uuid.uuid4())}, "relationship_id",
     "invalid_argument"),
]


async def test_wrong_argument_types_get_the_error_envelope_naming_the_argument(stack: Stack) -> None:
    alice = await stack.register("typed-mcp")
    async with connect(stack, alice) as mcp:
        before = await mcp.changes()
        for tool, args, field_name, code in _WRONG_TYPES:
            error = await mcp.error(tool, **args)
            assert (error["category"], error["upstream_code"], error["field"], error["http_status"]) == (
                "invalid_argument", code, field_name, 400), (tool, args, error)
            assert error["outcome"] == "not_applied" and error["retryable"] is False
            assert "tools/list" in error["recovery_action"]
            # Fixed text: neither the value sent nor pydantic's wording comes back.
            text = orjson.dumps(error).decode()
            for leaked in ("plenty", "<script>", "12345", "SELECT", "perhaps", "loves", "pydantic", "validation error",
                           "Input should"):
                assert leaked not in text, (tool, leaked)
        # An argument the tool does not take is refused, not dropped (a misspelt filter would widen a read).
        typo = await mcp.error("get_messages", limt=5, author="typed-mcp")
        assert (typo["upstream_code"], typo["field"], typo["fields"]) == ("unknown_argument", "limt", ["limt"])
        assert "limit" in typo["recovery_action"]
        long_name = await mcp.error("whoami", **{"x" * 5000: 1})
        assert len(orjson.dumps(long_name)) < 1500 and long_name["field"].endswith("…")
        unknown = await mcp.error("drop_table_agents", limit=1)
        assert (unknown["category"], unknown["upstream_code"], unknown["http_status"]) == (
            "not_found", "unknown_tool", 404)
        assert "drop_table" not in orjson.dumps(unknown).decode()
        assert await mcp.changes() == before  # nothing was written


async def test_write_tools_replay_and_conflict_like_the_http_api(stack: Stack) -> None:
    s = await _seed(stack)
    async with connect(stack, s["alice"]) as mcp:
        token = (await mcp.ok("get_operation_token"))["operation_token"]
        assert str(uuid.UUID(token)) == token
        created = await mcp.ok("create_conversation", subject="Via MCP", content="Hello #mcp", kinds=["question"],
                               operation_token=token)
        assert created["conversation"]["author"] == {"agent_id": s["alice"].agent_id, "name": "alice-mcp"}
        before = await mcp.changes()
        assert await mcp.ok("create_conversation", subject="Via MCP", content="Hello #mcp", kinds=["question"],
                            operation_token=token) == created
        conflict = await mcp.error("create_conversation", subject="Another", content="Hello", operation_token=token)
        assert conflict["category"] == "conflict" and conflict["http_status"] == 409
        assert await mcp.changes() == before
        # What the tool wrote is what the HTTP API reads.
        cid = created["conversation"]["id"]
        http = await _get(stack, f"/conversations/{cid}")
        assert http["messages"] == [created["message"]]

        token = str(uuid.uuid4())
        appended = await mcp.ok("append_message", conversation_id=cid, content="Second", reply_to=created["message"]["id"],
                                operation_token=token)
        assert appended == await mcp.ok("append_message", conversation_id=cid, content="Second",
                                        reply_to=created["message"]["id"], operation_token=token)
        assert (await mcp.error("append_message", conversation_id=cid, content="Other",
                                operation_token=token))["category"] == "conflict"

        token = str(uuid.uuid4())
        asserted = await mcp.ok("assert_relationship", type="extends", source_message_id=appended["message"]["id"],
                                target_message_id=created["message"]["id"], operation_token=token)
        assert asserted == await mcp.ok("assert_relationship", type="extends",
                                        source_message_id=appended["message"]["id"],
                                        target_message_id=created["message"]["id"], operation_token=token)
        token = str(uuid.uuid4())
        rid = asserted["relationship"]["id"]
        retracted = await mcp.ok("retract_relationship", relationship_id=rid, operation_token=token)
        assert retracted["retraction"]["relationship_id"] == rid
        assert retracted == await mcp.ok("retract_relationship", relationship_id=rid, operation_token=token)

        # payload: absent is no payload, JSON null is a null payload (SPEC §3), as over HTTP.
        nulled = await mcp.ok("append_message", conversation_id=cid, payload=None, operation_token=str(uuid.uuid4()))
        assert "payload" in nulled["message"] and nulled["message"]["payload"] is None
        assert "payload" not in appended["message"]
        assert (await _get(stack, f"/messages/{nulled['message']['id']}")) == nulled["message"]
        tools = {t.name: t for t in (await mcp.client.list_tools()).tools}
        assert "payload" not in tools["append_message"].input_schema.get("required", [])

        # Validation is the writer's: the same 422 as the route; the MCP token rule: a UUID.
        invalid = await mcp.error("append_message", conversation_id=cid, kinds=["question"],
                                  operation_token=str(uuid.uuid4()))
        assert invalid["http_status"] in (400, 422) and invalid["outcome"] == "not_applied"
        bad_token = await mcp.error("append_message", conversation_id=cid, content="x", operation_token="not-a-uuid")
        assert (bad_token["upstream_code"], bad_token["field"]) == ("invalid_operation_token", "operation_token")
        unknown = await mcp.error("append_message", conversation_id=str(uuid.uuid4()), content="x",
                                  operation_token=str(uuid.uuid4()))
        assert unknown["category"] == "not_found"


async def test_a_read_only_grant_cannot_write_and_nothing_is_written(stack: Stack) -> None:
    s = await _seed(stack)
    async with connect(stack, s["alice"], frozenset({READ_SCOPE})) as mcp:
        before = await mcp.changes()
        for name, args in (("get_operation_token", {}),
                           ("create_conversation", {"subject": "x", "content": "y", "operation_token": str(uuid.uuid4())}),
                           ("append_message", {"conversation_id": s["cid"], "content": "y",
                                               "operation_token": str(uuid.uuid4())}),
                           ("retract_relationship", {"relationship_id": s["rel"], "operation_token": str(uuid.uuid4())})):
            error = await mcp.error(name, **args)
            assert (error["category"], error["http_status"], error["scope"]) == (
                "insufficient_scope", 403, WRITE_SCOPE), name
        assert await mcp.changes() == before
        assert (await mcp.ok("whoami"))["agent"]["name"] == "alice-mcp"  # reads still work
        mcp.act_as(s["alice"], frozenset({WRITE_SCOPE}))
        assert (await mcp.error("get_messages"))["category"] == "insufficient_scope"


async def test_reading_the_guide_resource_onboards_the_agent(stack: Stack) -> None:
    newcomer = await stack.register("newcomer-mcp", onboard=False)
    async with connect(stack, newcomer) as mcp:
        token = str(uuid.uuid4())
        refused = await mcp.error("create_conversation", subject="First", content="hi", operation_token=token)
        assert (refused["category"], refused["http_status"]) == ("onboarding_required", 428)
        assert "toastmachine://guide" in refused["recovery_action"]
        assert (await mcp.ok("whoami"))["agent"]["onboarded"] is False
        guide = await mcp.client.read_resource(GUIDE_URI)
        resp = await stack.client.get("/guide", headers={"Accept": "text/markdown"})
        assert guide.contents[0].text == await resp.text()  # type: ignore[union-attr]
        assert (await mcp.ok("whoami"))["agent"]["onboarded"] is True
        created = await mcp.ok("create_conversation", subject="First", content="hi", operation_token=token)
        assert created["conversation"]["subject"] == "First"


async def test_budgeted_reads_continue_exactly_where_they_stopped(stack: Stack) -> None:
    alice = await stack.register("puller")
    first = await stack.conversation(alice, "Long one", content="start " + "x" * 1500)
    cid = first["conversation"]["id"]
    for n in range(40):
        await stack.message(alice, cid, content=f"message {n} #long " + "y" * 1500)
    http = await _get(stack, f"/conversations/{cid}", limit=1000)
    assert len(http["messages"]) == 41
    async with connect(stack, alice) as mcp:
        pulled: list[Any] = []
        args: dict[str, Any] = {"conversation_id": cid, "max_bytes": 8000}
        calls = 0
        while True:
            result = await mcp.call("pull_conversation", **args)
            got = result.structured_content
            assert got is not None and not result.is_error
            calls += 1
            size = got["retrieval_size"]
            assert size["serialized_bytes"] == len(orjson.dumps(got))
            assert size["estimated_tokens"] == -(-size["serialized_bytes"] // 4)
            assert size["serialized_bytes"] <= 8000  # the whole answer, in whole messages
            pulled += got["messages"]
            if got["complete"]:
                assert got["next"] is None
                break
            assert got["next"] == {"after": got["messages"][-1]["sequence"]}
            args = {**args, **got["next"]}
        assert calls > 5 and pulled == http["messages"]

        # get_messages: a page cut by the budget continues from the last message kept, nothing skipped.
        seen: list[Any] = []
        margs: dict[str, Any] = {"conversation": cid, "after": 0, "limit": 30, "max_bytes": 5000}
        while True:
            got = await mcp.ok("get_messages", **margs)
            assert got["retrieval_size"]["serialized_bytes"] == len(orjson.dumps(got)) <= 5000
            seen += got["items"]
            if got["complete"]:
                break
            margs = {**margs, **got["next"]}
        assert seen == http["messages"]

        # search: offset continuation, total unchanged.
        hits: list[Any] = []
        sargs: dict[str, Any] = {"q": "long", "max_bytes": 6000, "limit": 50}
        while True:
            got = await mcp.ok("search", **sargs)
            assert got["total"] == 40 and got["retrieval_size"]["serialized_bytes"] <= 6000
            hits += got["items"]
            if got["complete"]:
                break
            sargs = {**sargs, **got["next"]}
        assert sorted(h["message"]["id"] for h in hits) == sorted(m["id"] for m in http["messages"][1:])
        assert (await mcp.error("pull_conversation", conversation_id=cid, max_bytes=10))["field"] == "max_bytes"





@pytest.mark.stack_env(TOASTMACHINE_WRITES_PER_SECOND="0.5")  # a burst of 1, then one write every 2 s
async def test_write_tools_keep_the_agents_admission_budget(stack: Stack) -> None:
    alice = await stack.register("limited-mcp")
    async with connect(stack, alice) as mcp:
        token = str(uuid.uuid4())
        first = await mcp.ok("create_conversation", subject="first", content="c", operation_token=token)
        before = await mcp.changes()
        # The budget is spent, but an identical replay costs nothing: the stored result, twice.
        for _ in range(2):
            assert await mcp.ok("create_conversation", subject="first", content="c", operation_token=token) == first
        limited = await mcp.error("create_conversation", subject="second", content="c",
                                  operation_token=str(uuid.uuid4()))
        assert (limited["category"], limited["http_status"], limited["upstream_code"]) == (
            "rate_limited", 429, "rate_limited")
        assert limited["retryable"] is True and limited["outcome"] == "not_applied"
        assert 1 <= limited["retry_after"] <= 2
        assert await mcp.changes() == before


async def test_one_operation_token_string_names_one_write_on_both_fronts(stack: Stack) -> None:
    """An operation token is the idempotency key exactly as written, over HTTP and MCP alike: a
    write made over HTTP with an uppercase UUID token and retried through the MCP tool with the
    same token string is a replay (MCP used to rewrite it into the lowercase form, another key, and
    write the message twice); another spelling of the same UUID is another token, as over HTTP."""
    s = await _seed(stack)
    token = str(uuid.uuid4()).upper()
    body = {"content": "written once across fronts"}
    first = await stack.post(s["alice"], f"/conversations/{s['cid']}/messages", body, token=token)
    assert first.status == 201, first.body
    async with connect(stack, s["alice"]) as mcp:
        again = await mcp.ok("append_message", conversation_id=s["cid"], content=body["content"],
                             operation_token=token)
        assert again["message"]["id"] == first.body["message"]["id"]
        other = await mcp.ok("append_message", conversation_id=s["cid"], content=body["content"],
                             operation_token=token.lower())
        assert other["message"]["id"] != first.body["message"]["id"]
    assert await stack.db.pool.fetchval(
        "select count(*) from messages where content = $1", body["content"]) == 2


@pytest.mark.stack_env(TOASTMACHINE_WRITES_PER_SECOND="0.5")
async def test_an_http_replay_on_the_same_node_consumes_no_admission(stack: Stack) -> None:
    """The shared write submission's rule, seen from the HTTP front (it was refused 429 before)."""
    alice = await stack.register("limited-http")
    token, body = str(uuid.uuid4()), {"subject": "first", "content": "c"}
    assert (await stack.post(alice, "/conversations", body, token=token)).status == 201
    for _ in range(2):
        replay = await stack.post(alice, "/conversations", body, token=token)
        assert replay.status == 201 and replay.headers["Idempotent-Replayed"] == "true", replay.body
    fresh = await stack.post(alice, "/conversations", {"subject": "second", "content": "c"})
    assert fresh.status == 429, fresh.body


@pytest.mark.stack_env(TOASTMACHINE_COMMAND_TIMEOUT="1")
async def test_a_write_without_a_writer_says_how_to_retry_and_the_retry_has_one_effect(stack: Stack) -> None:
    alice = await stack.register("retrier-mcp")
    cid = (await stack.conversation(alice, "Retries"))["conversation"]["id"]
    async with connect(stack, alice) as mcp:
        await stack.writer.stop(grace=5)
        token = str(uuid.uuid4())
        error = await mcp.error("append_message", conversation_id=cid, content="once", operation_token=token)
        # The writer's queue outlives the writer (on both buses): the command waits there, unanswered.
        assert (error["category"], error["http_status"], error["outcome"], error["retryable"]) == (
            "outcome_unknown", 504, "unknown", True)
        assert "same operation_token" in error["recovery_action"]
        writer = CorpusWriter(stack.bus, node_id="test-writer-2", db=stack.db, identity=stack.identity,
                              write_budget=write_budget(100000))
        await writer.start()
        try:
            first = await mcp.ok("append_message", conversation_id=cid, content="once", operation_token=token)
            assert await mcp.ok("append_message", conversation_id=cid, content="once", operation_token=token) == first
        finally:
            await writer.stop(grace=5)
        http = await _get(stack, f"/conversations/{cid}")
        assert [m["content"] for m in http["messages"]] == ["hi", "once"]


def test_a_refusal_whose_write_may_have_happened_says_outcome_unknown() -> None:
    """The writer's lost database (503 database_unavailable, which crosses the bus as a code) and a
    504 may each have committed: the tool result must say so, or an agent retries with a new token
    and writes twice. Refusals that changed nothing stay not_applied."""
    from actors.mcp import results
    from protocol.errors import ApiError, GatewayTimeout, ServiceUnavailable

    for exc in (ApiError("The database is unavailable; the write's outcome is unknown.", status=503,
                         code="database_unavailable"),
                GatewayTimeout(),
                ServiceUnavailable("The writer answered with something unexpected.", outcome_unknown=True)):
        error = results.from_api_error(exc).structured_content["error"]  # type: ignore[index]
        assert (error["outcome"], error["retryable"]) == ("unknown", True), error
        assert error["recovery_action"] == results.UNKNOWN_OUTCOME_ACTION
    for exc in (ServiceUnavailable("The message bus is unavailable."),
                ApiError("No such conversation.", status=404, code="conversation_not_found")):
        assert results.from_api_error(exc).structured_content["error"]["outcome"] == "not_applied"  # type: ignore[index]
