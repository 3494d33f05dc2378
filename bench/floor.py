"""The floor under any write path built on this stack, measured on this machine.

``bench/write.py`` runs these beside its baselines, in the same run, to show how much of the
machine a write must cost whatever the design, given what issue #12 and SPEC §1 fix: an HTTP request
answered by aiohttp, and one confirmed AMQP publish per change on ``tm.events`` (through aiormq, the
client under aio-pika), plus the rows of baseline (b) in PostgreSQL. Each part is measured alone:

- **HTTP**: ``concurrency`` clients post a write-sized JSON body to a plain aiohttp app on uvloop (a
  process of its own, no access log) whose handler only decodes it and answers 201 with a
  message-sized JSON body. CPU of that server process and of this client.
- **Event publish**: one confirmed, persistent publish per event on a topic exchange with no queue
  bound (the cheapest case for the broker), the event's size, routing key, message id and headers,
  ``window`` in flight as the publisher keeps them. CPU of this process (the publishing client) and
  of RabbitMQ.

Only processes' own CPU time is counted (not the kernel's network work), and the floor leaves out
everything a real node must do besides (authentication, validation, the command hop to the writer and
its reply, the writer's own code, the hubs' batch): the ratio it implies is an upper bound.

``python bench/floor.py serve`` is the HTTP side's server process (it prints its port).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import aiormq
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.measure import CpuMeter, Round, drive

#: Publishes in flight at once on the event side (the publisher's own default window).
PUBLISH_WINDOW = 100


# --- the HTTP side --------------------------------------------------------------------------------


async def _answer(request: web.Request) -> web.Response:
    """Decode the posted JSON and answer 201 with a body shaped like a stored message, nothing else."""
    posted = orjson.loads(await request.read())
    message = {"id": str(uuid.uuid4()), "conversation_id": request.match_info["id"], "author_id": str(uuid.uuid4()),
               "sequence": 1, "created_at": "2026-01-01T00:00:00.000Z", "kinds": ["message"],
               "content": posted.get("content"), "tags": [], "mentions": [], "reply_to": None, "payload": None}
    return web.Response(status=201, body=orjson.dumps({"message": message}), content_type="application/json")


def serve() -> None:
    """Run the plain aiohttp app on 127.0.0.1, on a free port printed on stdout, until terminated."""
    import uvloop

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/conversations/{id}/messages", _answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        print(sock.getsockname()[1], flush=True)
        # Until the benchmark closes our stdin (or dies): reading it returns at EOF.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)

    uvloop.run(main())


@asynccontextmanager
async def plain_server() -> AsyncIterator[tuple[str, int]]:
    """The plain aiohttp app in a process of its own: its base URL and pid.

    The server also exits when its stdin closes, so that it does not outlive a benchmark that was
    killed outright."""
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "serve", stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not line.strip().isdigit():
            raise RuntimeError("the plain aiohttp server did not start")
        yield f"http://127.0.0.1:{int(line)}", proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def measure_http(base: str, pid: int, session: aiohttp.ClientSession, count: int, concurrency: int,
                       content: str) -> Round:
    """``count`` posts, ``concurrency`` at a time; CPU groups ``server`` and ``bench`` (this client)."""
    url = f"{base}/conversations/{uuid.uuid4()}/messages"
    headers = {"Authorization": f"Bearer {'t' * 43}", "Content-Type": "application/json"}

    async def post(_i: int, n: int) -> str | None:
        body = orjson.dumps({"content": content, "kinds": ["message"]})
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()
            return None if response.status == 201 else str(response.status)

    await drive(min(count, 500), concurrency, post)  # warm the connections
    meter = CpuMeter.start({"server": pid, "bench": os.getpid()})
    result = await drive(count, concurrency, post)
    result.cpu = meter.busy()
    return result


# --- the event side -------------------------------------------------------------------------------


async def measure_publish(amqp_url: str, count: int, event_bytes: int, window: int = PUBLISH_WINDOW) -> Round:
    """``count`` confirmed publishes of ``event_bytes`` each, ``window`` in flight; CPU groups ``bench``
    (this process, the publishing client) and ``rabbitmq``."""
    connection = await aiormq.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = f"tm.bench.floor.{uuid.uuid4().hex[:12]}"
        await channel.exchange_declare(exchange, exchange_type="topic", durable=False)
        body = b"x" * event_bytes
        lineage, corpus_id = str(uuid.uuid4()), str(uuid.uuid4())

        async def publish(_i: int, n: int) -> str | None:
            properties = aiormq.spec.Basic.Properties(
                content_type="application/json", delivery_mode=2, message_type="corpus.change-event",
                message_id=f"{lineage}:{n}",
                headers={"corpus_id": corpus_id, "lineage": lineage, "sequence": n, "schema_version": 1,
                         "trace_id": "0" * 32})
            confirm = await channel.basic_publish(body, exchange=exchange, routing_key=f"message.appended.{n % 16}",
                                                  properties=properties)
            return None if isinstance(confirm, aiormq.spec.Basic.Ack) else type(confirm).__name__

        try:
            await drive(min(count, 500), window, publish)
            meter = CpuMeter.start({"bench": os.getpid()})
            result = await drive(count, window, publish)
            result.cpu = meter.busy()
        finally:
            # Not over a channel the failure closed: the exchange then goes with the connection's
            # end only if the broker restarts (it is not durable), and the failure is what matters.
            with contextlib.suppress(aiormq.exceptions.AMQPError, ConnectionError):
                await channel.exchange_delete(exchange)
        return result
    finally:
        await connection.close()


def cpus() -> int:
    """CPUs this process may run on (the machine's budget)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit("usage: python bench/floor.py serve   (the floor is measured by bench/write.py)")
