"""``GET /openapi.json``: it documents exactly the routes the app serves, it is valid OpenAPI 3.1, and
real answers of a running stack (JSON, JSON-LD, JSONL, SSE, errors) validate against it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import jsonschema
import orjson
import pytest
from multidict import CIMultiDict
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from schemathesis.specs.openapi.definitions import OPENAPI_31

from actors.web.app import make_app
from actors.web.openapi import build_openapi
from infra.bus.base import Bus
from infra.db import Database
from tests.corpus_fixtures import Stack
from tests.sse import frames
from tests.webclient import test_node

DOC_URI = "urn:toastmachine:openapi"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return build_openapi()


# --- the document against the router ----------------------------------------------------------


def _served_routes() -> set[tuple[str, str]]:
    """(path template, method) of every route the app registers; HEAD is implied by GET."""
    # Building the app connects nothing: the database and the bus are only used once it serves.
    app = make_app(test_node(cast(Database, None), cast(Bus, None)))
    out: set[tuple[str, str]] = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        assert path, f"route without a path: {route}"
        if route.method == "HEAD":
            continue
        out.add((path, route.method.lower()))
    return out


def test_every_route_is_documented_and_every_documented_route_exists(doc: dict[str, Any]) -> None:
    served = _served_routes()
    documented = {(path, method) for path, item in doc["paths"].items() for method in item if method in METHODS}
    assert served - documented == set(), "routes the app serves but /openapi.json does not document"
    assert documented - served == set(), "routes /openapi.json documents but the app does not serve"


# --- the document is valid -------------------------------------------------------------------


def test_document_is_valid_openapi_31(doc: dict[str, Any]) -> None:
    assert doc["openapi"] == "3.1.0"
    errors = sorted(jsonschema.Draft202012Validator(OPENAPI_31).iter_errors(doc), key=lambda e: e.json_path)
    assert not errors, "\n".join(f"{e.json_path}: {e.message[:300]}" for e in errors)
    for name, schema in doc["components"]["schemas"].items():
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            raise AssertionError(f"components.schemas.{name}: {e.message}") from None


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _pointer(doc: dict[str, Any], pointer: str) -> Any:
    node: Any = doc
    for part in pointer.lstrip("/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def test_every_ref_resolves_and_every_operation_is_complete(doc: dict[str, Any]) -> None:
    for target in set(_refs(doc)):
        assert target.startswith("#/"), target
        _pointer(doc, target[1:])  # raises KeyError when it does not resolve
    ids = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            ids.append(op["operationId"])
            assert op["responses"], (path, method)
            for param in op.get("parameters", []):
                if "$ref" in param:
                    param = _pointer(doc, param["$ref"][1:])
                if param["in"] == "path":
                    assert "{" + param["name"] + "}" in path
    assert len(ids) == len(set(ids)), "operationIds must be unique"


def test_document_is_served_with_an_etag_and_304() -> None:
    """The handler itself, through a real app (no database needed for this route)."""
    from aiohttp.test_utils import TestClient, TestServer

    async def run() -> None:
        app = make_app(test_node(cast(Database, None), cast(Bus, None), {"TOASTMACHINE_PUBLIC_URL":
                                                                          "https://corpus.example",
                                                                          "TOASTMACHINE_MCP_PUBLIC_URL":
                                                                          "https://mcp.corpus.example"}))
        app.cleanup_ctx.clear()  # the hub would connect to the bus: this test serves no stream
        app.on_shutdown.clear()
        client = TestClient(TestServer(app))
        await client.start_server()
        try:
            resp = await client.get("/openapi.json")
            assert resp.status == 200 and resp.content_type == "application/json"
            body = await resp.json()
            assert body["servers"] == [{"url": "https://corpus.example"}]
            # Where AI apps connect: the MCP front's own origin.
            assert body["x-mcp"]["url"] == "https://mcp.corpus.example/mcp"
            assert body["x-mcp"]["authorization_server"] == "https://mcp.corpus.example"
            etag = resp.headers["ETag"]
            again = await client.get("/openapi.json", headers={"If-None-Match": etag})
            assert again.status == 304 and again.headers["ETag"] == etag
        finally:
            await client.close()

    import asyncio

    asyncio.run(run())


# --- real answers against the document -------------------------------------------------------


class Contract:
    """Validates real responses against the schema the document gives for them."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        resource = Resource.from_contents(doc, default_specification=DRAFT202012)
        self.registry: Registry[Any] = Registry().with_resource(DOC_URI, resource)
        self.checked: set[tuple[str, str, int, str]] = set()

    def _response(self, template: str, method: str, status: int) -> tuple[str, dict[str, Any]]:
        responses = self.doc["paths"][template][method]["responses"]
        assert str(status) in responses, f"{method.upper()} {template} does not document status {status}"
        base = "/paths/" + template.replace("~", "~0").replace("/", "~1") + f"/{method}/responses/{status}"
        response = responses[str(status)]
        if "$ref" in response:
            base = response["$ref"][1:]
            response = _pointer(self.doc, base)
        return base, response

    def validate_value(self, pointer: str, value: Any) -> None:
        validator = jsonschema.Draft202012Validator({"$ref": f"{DOC_URI}#{pointer}"}, registry=self.registry)
        errors = list(validator.iter_errors(value))
        assert not errors, "\n".join(f"{e.json_path}: {e.message[:400]}" for e in errors) + f"\n{value!r}"[:2000]

    def check(self, template: str, method: str, status: int, content_type: str, body: bytes,
              headers: CIMultiDict[str]) -> None:
        base, response = self._response(template, method, status)
        self.checked.add((template, method, status, content_type))
        if status == 304:
            assert body == b""
            return
        content = response.get("content", {})
        assert content_type in content, f"{method.upper()} {template} {status}: undocumented {content_type}"
        media = content[content_type]
        pointer = f"{base}/content/{content_type.replace('/', '~1')}"
        if content_type in ("application/json", "application/ld+json"):
            self.validate_value(pointer + "/schema", orjson.loads(body))
        elif content_type == "application/x-ndjson":
            item = media["x-item-schema"]["$ref"][1:]
            for line in body.decode().splitlines():
                self.validate_value(item, orjson.loads(line))
        else:
            assert media["schema"] == {"type": "string"}
        for name, header in response.get("headers", {}).items():
            if name in headers:
                header = _pointer(self.doc, header["$ref"][1:]) if "$ref" in header else header
                validator = jsonschema.Draft202012Validator(header["schema"])
                assert validator.is_valid(headers[name]), (template, name, headers[name])


def _template(doc: dict[str, Any], path: str) -> str:
    """The documented path template matching a concrete path."""
    parts = path.split("?")[0].strip("/").split("/")
    for template in doc["paths"]:
        t_parts = template.strip("/").split("/")
        if len(t_parts) == len(parts) and all(t.startswith("{") or t == p for t, p in zip(t_parts, parts,
                                                                                          strict=True)):
            return template
    raise AssertionError(f"no documented path matches {path}")


async def _seed(stack: Stack) -> dict[str, Any]:
    alice = await stack.register("alice")
    bob = await stack.register("Bob_2")
    await stack.register("carol-quiet")
    created = await stack.conversation(alice, "Is #seed data valid?", content="Claim: yes. #seed @Bob_2",
                                       kinds=["claim", "question"])
    cid, root = created["conversation"]["id"], created["message"]["id"]
    checked = await stack.message(bob, cid, content="Verified. #seed", kinds=["verification"], reply_to=root)
    nulled = await stack.message(bob, cid, payload=None)
    await stack.message(alice, cid, payload={"statement": "s", "confidence": 0.5}, schema_name="claim",
                        schema_version=1)
    supports = await stack.post(bob, "/relationships", {"type": "supports", "target_message_id": root,
                                                         "source_message_id": checked["message"]["id"]})
    assert supports.status == 201, supports.body
    contra = await stack.post(bob, "/relationships", {"type": "contradicts", "target_message_id": root,
                                                      "source_message_id": nulled["message"]["id"]})
    rid = contra.body["relationship"]["id"]
    retracted = await stack.post(bob, f"/relationships/{rid}/retractions", {})
    assert retracted.status == 201, retracted.body
    return {"alice": alice, "bob": bob, "cid": cid, "root": root, "rid": rid,
            "supports": supports.body["relationship"]["id"], "created": created, "retracted": retracted}


async def test_real_answers_follow_the_document(stack: Stack, doc: dict[str, Any], tmp_path: Path) -> None:
    contract = Contract(doc)
    seed = await _seed(stack)
    # The archive of the seed (segments of 2, the last one sealed by age), read by the web front.
    from actors.archiver import SealPolicy
    from actors.web.archive import ARCHIVE_STORE
    from tests.test_archiver import archiving, local, until

    store = local(tmp_path)
    stack.client.app[ARCHIVE_STORE]["store"] = store
    async with archiving(stack, store, SealPolicy(events=2, seconds=0), manifest_page=2):
        async def archived() -> bool:
            head = await stack.db.pool.fetchval("select max(sequence) from changes")
            through = await stack.db.pool.fetchval("select published_through from archive_watermarks where stream = 0")
            return bool(through == head)
        await until(archived, what="the seed to be archived")
    alice, bob, cid, root, rid = seed["alice"], seed["bob"], seed["cid"], seed["root"], seed["rid"]
    client = stack.client

    async def get(path: str, status: int = 200, accept: str | None = None, **headers: str) -> CIMultiDict[str]:
        send = dict(headers)
        if accept is not None:
            send["Accept"] = accept
        resp = await client.get(path, headers=send)
        body = await resp.read()
        assert resp.status == status, (path, resp.status, body[:500])
        received = CIMultiDict(resp.headers)
        contract.check(_template(doc, path), "get", resp.status, resp.content_type, body, received)
        return received

    async def post(agent: Any, path: str, body: Any, status: int, **kw: Any) -> Any:
        reply = await stack.post(agent, path, body, **kw)
        assert reply.status == status, (path, reply.status, reply.body)
        raw = orjson.dumps(reply.body) if reply.body is not None else b""
        contract.check(_template(doc, path), "post", reply.status, "application/json", raw,
                       CIMultiDict(reply.headers))
        return reply

    # Reads in every representation, with paging and filters.
    reads = ["/", "/healthz", "/readyz", "/corpus", "/openapi.json", "/guide", "/conversations",
             f"/conversations/{cid}", f"/conversations/{cid}?limit=1", f"/messages/{root}", "/messages",
             "/messages?limit=1", "/messages?after=0&limit=2", "/messages?before=99&offset=1&limit=1",
             "/messages?kinds=claim,verification&author=alice", f"/messages?conversation={cid}&tag=seed",
             "/messages?mention=bob_2", "/search?q=seed", "/search?q=verified&limit=1", "/search?q=nothinglikeit",
             "/tags", "/tags?prefix=s&sort=count&min_count=1", "/tags?tag=seed", "/relationships",
             "/relationships?include_retracted=true", f"/relationships?message={root}&type=supports&limit=1",
             "/agents", "/agents?sort=last_sequence&limit=2&offset=1", "/agents/ALICE", "/agents/carol-quiet",
             "/conversations?author=alice&limit=1", "/conversations?offset=1"]
    for path in reads:
        await get(path)
    for path in ["/conversations", f"/conversations/{cid}", f"/messages/{root}", "/messages", "/search?q=seed",
                 "/agents", "/agents/alice", "/tags", "/relationships", "/corpus"]:
        for accept in ("application/ld+json", "text/markdown", "text/html"):
            await get(path, accept=accept)
    await get("/search", accept="text/html")  # a browser's empty search: the form, not a 400
    await get("/", accept="text/html")
    for icon in ("/favicon.svg", "/favicon.ico"):
        etag = (await get(icon))["ETag"]
        await get(icon, 304, **{"If-None-Match": etag})
    await get("/guide", accept="text/markdown")
    await get("/guide", accept="text/html")
    await get("/guide", Authorization=f"Bearer {alice.credential}")
    await get("/me", Authorization=f"Bearer {alice.credential}")
    await get("/metrics")
    etag = (await get("/messages"))["ETag"]
    await get("/messages", 304, **{"If-None-Match": etag})
    etag = (await get("/guide"))["ETag"]
    await get("/guide", 304, **{"If-None-Match": etag})
    await get("/corpus/changes.jsonl")
    await get("/corpus/changes.jsonl?after=1&limit=2")
    await get("/corpus/snapshot.jsonl")
    await get("/corpus/archive")
    for media in ("application/ld+json", "text/markdown", "text/html"):
        await get("/corpus/archive", accept=media)
    archive = orjson.loads(await (await client.get("/corpus/archive")).read())
    segment = f"/corpus/archive/segments/{archive['segments'][0]['name']}"
    segment_etag = (await get(segment))["ETag"]
    await get(segment, 304, **{"If-None-Match": segment_etag})
    manifest_etag = (await get(archive["links"]["manifest"]))["ETag"]
    await get(archive["links"]["manifest"], 304, **{"If-None-Match": manifest_etag})
    pages = orjson.loads(await (await client.get(archive["links"]["manifest"])).read())["pages"]
    assert pages, "the seed's archive has manifest pages (pages of 2 segments)"
    page = f"/corpus/archive/manifest-pages/{pages[0]['first_index']:010d}-{pages[0]['last_index']:010d}"
    page_etag = (await get(page))["ETag"]
    await get(page, 304, **{"If-None-Match": page_etag})
    await get("/corpus/archive/manifest-pages/0000000000-0000000099", 404)
    await get(f"/corpus/archive/checkpoints/{archive['tree_size']}")
    await get(f"/corpus/archive/proof?sequence={archive['segments'][0]['first_sequence']}")
    await get(f"/corpus/archive/proof?sequence=1&size={archive['tree_size']}")
    for path in ("/corpus/archive/proof", "/corpus/archive/proof?sequence=0", "/corpus/archive/checkpoints/x",
                 "/corpus/archive?x=1", "/corpus/archive/manifest.json?x=1"):
        await get(path, 400)
    for path in ("/corpus/archive/proof?sequence=999999", "/corpus/archive/checkpoints/999999",
                 "/corpus/archive/segments/nope"):
        await get(path, 404)
    await get("/corpus/archive", 406, accept="image/png")

    # Errors: bad parameters, unknown records, negotiation, lineage, credentials.
    for path in ["/messages?limit=0", "/messages?after=1&offset=0", "/messages?after=1&order=desc",
                 "/messages?kinds=post,post", "/messages?bogus=1", "/search", "/search?q=%20",
                 "/tags?tag=a&prefix=a", "/relationships?type=likes", "/conversations/not-a-uuid",
                 "/agents?sort=age", "/corpus?x=1", "/corpus/changes.jsonl?after=-1",
                 "/corpus/changes.jsonl?limit=10001", "/corpus/stream?after=x"]:
        await get(path, 400)
    for path in [f"/conversations/{uuid.uuid4()}", f"/messages/{uuid.uuid4()}", "/agents/nobody"]:
        await get(path, 404)
    for path in ("/messages", "/", "/corpus", "/openapi.json", "/tags", "/relationships"):
        await get(path, 406, accept="image/png")
    await get("/corpus/changes.jsonl", 406, accept="application/json")
    await get(f"/corpus/changes.jsonl?lineage={uuid.uuid4()}", 409)
    await get("/me", 401)
    await get("/me", 401, Authorization="Bearer tm_wrong")
    await get("/guide", 401, Authorization="Basic abc")

    # The live stream: catch-up frames and ready, each as documented.
    async with client.get("/corpus/stream?after=0") as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        async for frame in frames(resp):
            if not frame.data:
                continue  # the "retry:" field and heartbeat comments carry no event
            event: dict[str, Any] = {"event": frame.event, "data": frame.data}
            if frame.id is not None:
                event["id"] = frame.id
            contract.validate_value("/components/schemas/StreamEvent", event)
            # jsonschema does not apply contentSchema: check the data of the event's branch directly.
            branch = {"ready": 1, "stream-error": 2}.get(frame.event, 0)
            contract.validate_value(f"/components/schemas/StreamEvent/oneOf/{branch}/properties/data/contentSchema",
                                    frame.json())
            if frame.event == "ready":
                break

    # Writes: 201, replay, and the refusals in the order the ingress checks them.
    await post(None, "/register", {"name": "dave", "description": "writes"}, 201)
    await post(None, "/register", {"name": "DAVE"}, 409)
    await post(None, "/register", {"name": "x"}, 422)
    await post(None, "/register", [], 400)
    await post(alice, "/operation-tokens", {}, 201)
    token = str(uuid.uuid4())
    await post(alice, f"/conversations/{cid}/messages", {"content": "again"}, 201, token=token)
    replay = await post(alice, f"/conversations/{cid}/messages", {"content": "again"}, 201, token=token)
    assert CIMultiDict(replay.headers).get("Idempotent-Replayed") == "true"
    await post(alice, f"/conversations/{cid}/messages", {"content": "other"}, 409, token=token)
    await post(None, "/conversations", {"subject": "s", "content": "c"}, 401)
    await post(alice, "/conversations", {"subject": "s", "content": "c"}, 400, token=None)
    await post(alice, "/conversations", {"subject": "s", "content": "c"}, 415,
               data=b'{"subject": "s", "content": "c"}', headers={"Content-Type": "text/plain"})
    await post(alice, "/conversations", None, 413, data=b"x" * (257 * 1024),
               headers={"Content-Type": "application/json"})
    await post(alice, "/conversations", {"subject": " ", "content": "c"}, 422)
    await post(alice, "/conversations", {"subject": "s", "content": "c", "extra": 1}, 422)
    await post(alice, f"/conversations/{uuid.uuid4()}/messages", {"content": "c"}, 404)
    await post(alice, "/conversations/not-a-uuid/messages", {"content": "c"}, 400)
    await post(bob, "/relationships/not-a-uuid/retractions", {}, 400)
    verification = await _any_message(stack, bob.agent_id)
    await post(alice, "/relationships", {"type": "extends", "source_message_id": root,
                                         "target_message_id": root}, 422)
    await post(bob, "/relationships", {"type": "retracts", "source_message_id": verification,
                                       "target_message_id": root}, 403)
    await post(bob, "/relationships", {"type": "supports", "source_message_id": verification,
                                       "target_message_id": root}, 409)
    await post(alice, f"/relationships/{seed['supports']}/retractions", {}, 403)
    await post(bob, f"/relationships/{rid}/retractions", None, 409)
    newcomer = await stack.register("newcomer", onboard=False)
    await post(newcomer, "/conversations", {"subject": "s", "content": "c"}, 428)

    # Every operation of the document was exercised at least once.
    exercised = {(t, m) for t, m, _, _ in contract.checked}
    documented = {(p, m) for p, item in doc["paths"].items() for m in item}
    assert documented - exercised == set()


async def _any_message(stack: Stack, agent_id: str) -> str:
    """The id of a verification message by ``agent_id`` (the source of the seeded supports)."""
    row = await stack.db.pool.fetchrow(
        "select id from messages where author_id = $1 and 'verification' = any(kinds)", uuid.UUID(agent_id))
    return str(row["id"])
