"""What reaches a client, and the logs, when a request is malformed, oversized or too slow.

Requests go over raw sockets (an HTTP client library would refuse to send most of them). The
parser cases run against a real ``toastmachine web`` process logging JSON, with a real credential
in the rejected request: neither the answer nor any log line may contain it (or any other header
bytes). The timeout cases run on the in-process stack with a short TOASTMACHINE_HTTP_READ_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.corpus_fixtures import Stack
from tests.deployment import deployment

#: A marker next to the credential in every hostile request: a second secret that must not leak.
CANARY = "zq7canary"


async def _exchange(host: str, port: int, raw: bytes, timeout: float = 15) -> bytes:
    """Send ``raw`` on a fresh connection and read until the server closes it."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(timeout):
            return await reader.read()  # read() to EOF: every rejection closes the connection
    finally:
        writer.close()


async def _metric_appears(session: aiohttp.ClientSession, url: str, needle: str, *, then: object = None,
                          timeout: float = 15) -> None:
    """Call ``then`` (if given), then poll the metrics page until ``needle`` shows in it."""
    if callable(then):
        then()
    async with asyncio.timeout(timeout):
        while True:
            async with session.get(url) as resp:
                if needle in await resp.text():
                    return
            await asyncio.sleep(0.05)  # polling an observable, each pass bounded by the timeout above


def _split(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def _hostile_requests(credential: str) -> list[tuple[str, bytes, int, str]]:
    """(reason, raw request, expected status, expected code), each carrying the credential."""
    auth = f"Authorization: Bearer {credential}\r\n".encode()
    host = b"Host: node\r\n"
    return [
        ("nul_in_header", b"GET /corpus HTTP/1.1\r\n" + host + auth + f"X-{CANARY}: a\x00b\r\n\r\n".encode(),
         400, "malformed_request"),
        ("bare_cr_in_header", b"GET /corpus HTTP/1.1\r\n" + host + auth + f"X-{CANARY}: a\rb\r\n\r\n".encode(),
         400, "malformed_request"),
        ("long_authorization", b"GET /corpus HTTP/1.1\r\n" + host
         + f"Authorization: Bearer {credential}{CANARY}{'A' * 9000}\r\n\r\n".encode(), 431, "header_too_large"),
        ("too_many_headers", b"GET /corpus HTTP/1.1\r\n" + host + auth
         + b"".join(f"X-{CANARY}-{i}: {i}\r\n".encode() for i in range(200)) + b"\r\n", 431, "too_many_headers"),
        ("bad_method", f"G{CANARY}(T /corpus HTTP/1.1\r\n".encode() + host + auth + b"\r\n", 400, "malformed_request"),
        ("long_request_line", f"GET /corpus?q={credential}{CANARY}{'a' * 9000} HTTP/1.1\r\n".encode() + host
         + auth + b"\r\n", 414, "uri_too_long"),
    ]


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_parser_rejections_answer_the_envelope_and_leak_no_header_bytes(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    async with deployment(tmp_path, rabbitmq_url, database_url) as dep:
        web = await dep.start("web", "web-hostile", TOASTMACHINE_LOG_FORMAT="json",
                              TOASTMACHINE_HTTP_READ_TIMEOUT="1")
        url = dep.urls["web-hostile"]
        host, port = re.match(r"http://([^:]+):(\d+)", url).groups()  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/register", json={"name": "victim-agent"}) as resp:
                assert resp.status == 201
                credential = (await resp.json())["credential"]
            cases = _hostile_requests(credential)
            answered_traces: list[str] = []
            for reason, raw, status, code in cases:
                got_status, headers, body = _split(await _exchange(host, int(port), raw))
                assert (got_status, headers.get("content-type", "").split(";")[0]) == (status, "application/json"), \
                    (reason, got_status, body[:300])
                envelope = orjson.loads(body)["error"]
                assert envelope["code"] == code, (reason, envelope)
                assert envelope["message"] and envelope["how_to_proceed"]
                assert credential.encode() not in body and CANARY.encode() not in body, reason
                assert headers.get("server") == "ToastMachine", (reason, headers)  # not aiohttp's, with versions
                answered_traces.append(headers.get("x-trace-id", ""))
            # A client that leaves in the middle of a write's body is not a database failure (503).
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST /conversations HTTP/1.1\r\nHost: node\r\nAuthorization: Bearer {credential}\r\n"
                         "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"subject\": ".encode())
            await writer.drain()
            await _metric_appears(session, f"{url}/metrics",
                                  'route="/conversations",status="499"', then=writer.close)
            # A connection that sends nothing is answered 408 and closed; its log line comes last.
            timed_out, timed_out_headers, _ = _split(await _exchange(host, int(port), b""))
            assert timed_out == 408
            answered_traces.append(timed_out_headers.get("x-trace-id", ""))
            await web.wait_for_line(r'"reason": ?"header_timeout"', timeout=15)
            async with session.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
        rejected = [orjson.loads(line) for line in web.output if "http.request_rejected" in line]
        assert [r["level"] for r in rejected] == ["warning"] * (len(cases) + 1)
        # Each refusal's answer names the trace id of its log line (a fresh one each: no request got
        # as far as the middleware, so none could bring its own).
        assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in answered_traces), answered_traces
        assert sorted(r["trace_id"] for r in rejected) == sorted(answered_traces)
        assert len(set(answered_traces)) == len(answered_traces)
        assert sorted(r["reason"] for r in rejected) == sorted(
            ["malformed", "malformed", "header_too_large", "too_many_headers", "bad_method",
             "request_line_too_long", "header_timeout"])
        log = "\n".join(web.output)
        assert credential not in log and CANARY not in log
        assert "Traceback" not in log and "Error handling request" not in log
        assert "database_unavailable" not in log and 'status="503"' not in metrics
        for reason in ("malformed", "header_too_large", "too_many_headers", "bad_method", "request_line_too_long"):
            assert f'toastmachine_http_rejected_total{{reason="{reason}"}}' in metrics, reason


READ_TIMEOUT = 0.5


def _address(stack: Stack) -> tuple[str, int]:
    server = stack.client.server
    return str(server.host), int(server.port)  # type: ignore[arg-type]


async def _closed_by_server(reader: asyncio.StreamReader, timeout: float = 10) -> bytes:
    """Everything the server sends until it closes the connection (fails after ``timeout``)."""
    async with asyncio.timeout(timeout):
        return await reader.read()


@pytest.mark.stack_env(TOASTMACHINE_HTTP_READ_TIMEOUT=str(READ_TIMEOUT))
async def test_unfinished_request_headers_are_answered_408_and_closed(stack: Stack) -> None:
    host, port = _address(stack)
    silent = [await asyncio.open_connection(host, port) for _ in range(3)]
    half = [await asyncio.open_connection(host, port) for _ in range(50)]
    for _, writer in half:
        writer.write(b"GET /corpus HTTP/1.1\r\nHost: node\r\nX-Padding: ")
    trickling_reader, trickling = await asyncio.open_connection(host, port)
    trickling.write(b"GET /corpus HTTP/1.1\r\n")

    async def trickle() -> None:  # slowloris: a header byte every 50 ms, never the end of the headers
        while not trickling.is_closing():
            trickling.write(b"X")
            await asyncio.sleep(0.05)

    feeder = asyncio.create_task(trickle())
    try:
        answers = await asyncio.gather(*(_closed_by_server(r) for r, _ in [*silent, *half,
                                                                            (trickling_reader, trickling)]))
    finally:
        feeder.cancel()
        for _, writer in [*silent, *half, (trickling_reader, trickling)]:
            writer.close()
    for answer in answers:
        status, headers, body = _split(answer)
        assert status == 408 and headers["content-type"] == "application/json", answer[:200]
        assert headers["server"] == "ToastMachine", headers
        assert re.fullmatch(r"[0-9a-f]{32}", headers.get("x-trace-id", "")), headers
        assert orjson.loads(body)["error"]["code"] == "request_timeout"
    metrics = await (await stack.client.get("/metrics")).text()
    assert 'toastmachine_http_rejected_total{reason="header_timeout"} 54.0' in metrics


@pytest.mark.stack_env(TOASTMACHINE_HTTP_READ_TIMEOUT=str(READ_TIMEOUT))
async def test_a_stalled_body_is_answered_408_and_closed(stack: Stack) -> None:
    agent = await stack.register()
    host, port = _address(stack)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST /conversations HTTP/1.1\r\nHost: node\r\nAuthorization: Bearer {agent.credential}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"subject\"".encode())
        status, _, body = _split(await _closed_by_server(reader, timeout=20))
    finally:
        writer.close()
    assert status == 408 and orjson.loads(body)["error"]["code"] == "request_timeout"


@pytest.mark.stack_env(TOASTMACHINE_HTTP_READ_TIMEOUT=str(READ_TIMEOUT), TOASTMACHINE_STREAM_HEARTBEAT="0.2")
async def test_keep_alive_and_streams_outlive_the_read_timeout(stack: Stack) -> None:
    host, port = _address(stack)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for _ in range(2):  # the second request comes after an idle gap longer than the read timeout
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: node\r\n\r\n")
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE).group(1))  # type: ignore[union-attr]
                await reader.readexactly(length)
            assert head.startswith(b"HTTP/1.1 200"), head
            await asyncio.sleep(3 * READ_TIMEOUT)  # the idle time under test, not a synchronisation
    finally:
        writer.close()
    resp = await stack.client.get("/corpus/stream", timeout=aiohttp.ClientTimeout(total=None))
    heartbeats = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(20):
        async for line in resp.content:
            heartbeats += line.startswith(b": heartbeat")
            if loop.time() - started > 4 * READ_TIMEOUT and heartbeats >= 2:
                break
    resp.close()


async def test_error_messages_quote_a_bounded_prefix_of_client_input(stack: Stack) -> None:
    agent = await stack.register()
    huge = "f" * 250_000
    reply = await stack.post(agent, "/conversations", {"subject": "s", "content": "c", huge: 1})
    assert reply.status == 422
    size = len(orjson.dumps(reply.body))
    assert size < 2_000, size  # was 750 KB: the name three times
    error = reply.body["error"]
    assert f'"{"f" * 64}"…' in error["message"]
    assert error["field"] == "f" * 64 + "…" and error["fields"] == ["f" * 64 + "…"]
    many = {f"x{i}": i for i in range(500)}
    reply = await stack.post(agent, "/conversations", {"subject": "s", "content": "c", **many})
    assert reply.status == 422 and "and 490 more" in reply.body["error"]["message"]
    assert len(reply.body["error"]["fields"]) == 10
    # A kind is quoted as JSON (escapes included), never as a Python repr.
    reply = await stack.post(agent, "/conversations", {"subject": "s", "content": "c", "kinds": ["cl\u00e9im"]})
    assert reply.status == 422 and '"cl\\u00e9im"' in reply.body["error"]["message"], reply.body
    reply = await stack.post(agent, "/conversations", {"subject": "s", "content": "c", "kinds": [{"a": 1}]})
    assert reply.status == 422 and "{'a'" not in reply.body["error"]["message"], reply.body
    resp = await stack.client.get("/messages?kinds=nope")
    body = await resp.json()
    assert resp.status == 400 and '"nope"' in body["error"]["message"] and "'nope'" not in body["error"]["message"]
    long_name = "q" * 5_000
    resp = await stack.client.get(f"/messages?{long_name}=1")
    text = await resp.text()
    assert resp.status == 400 and len(text) < 2_000 and f'"{"q" * 64}"…' in orjson.loads(text)["error"]["message"]


async def test_an_overlong_query_string_is_a_414_envelope(stack: Stack) -> None:
    resp = await stack.client.get("/messages?" + "q" * 250_000 + "=1")
    body = await resp.json()
    assert resp.status == 414 and body["error"]["code"] == "uri_too_long" and len(await resp.read()) < 1_000


async def test_a_header_that_takes_one_value_sent_twice_is_refused_by_name(stack: Stack) -> None:
    from multidict import CIMultiDict

    alice, bob = await stack.register("alice"), await stack.register("bob")
    body = orjson.dumps({"subject": "twice", "content": "c"})
    cases = [
        ("/conversations", "Operation-Token", [("Authorization", f"Bearer {alice.credential}"),
                                                ("Operation-Token", "one"), ("Operation-Token", "two")]),
        ("/conversations", "Authorization", [("Authorization", f"Bearer {alice.credential}"),
                                              ("Authorization", f"Bearer {bob.credential}"),
                                              ("Operation-Token", "three")]),
    ]
    for path, name, pairs in cases:
        headers = CIMultiDict([("Content-Type", "application/json"), *pairs])
        resp = await stack.client.post(path, data=body, headers=headers)
        answer = await resp.json()
        assert resp.status == 400, (name, answer)
        assert answer["error"]["code"] == "repeated_header" and answer["error"]["field"] == name, answer
        assert alice.credential not in await resp.text() and bob.credential not in await resp.text()
    # Neither write took effect, under either token or either author.
    resp = await stack.client.get("/conversations")
    assert (await resp.json())["items"] == []
    some_lineage = "6f1c8a52-95d4-4d4e-9a43-0c1a1f5b9e10"
    for path, name, value in (("/corpus/stream", "Last-Event-ID", "0"),
                              ("/corpus/changes.jsonl", "X-Corpus-Lineage", some_lineage)):
        resp = await stack.client.get(path, headers=CIMultiDict([(name, value), (name, value)]))
        error = (await resp.json())["error"]
        assert resp.status == 400 and (error["code"], error["field"]) == ("repeated_header", name), error
    # Sent once, each is taken as before.
    reply = await stack.post(alice, "/conversations", {"subject": "once", "content": "c"})
    assert reply.status == 201, reply.body
