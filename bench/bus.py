"""Our bus layer against plain aio-pika, on the same broker in the same run.

Measures (a) publish-with-confirm and (b) consume-with-ack throughput of :class:`RabbitBus` with
:class:`Probe` messages, and of plain aio-pika doing the same work: the same JSON bodies (orjson),
the same properties, publisher confirms on, the same number of publishes in flight (a window
awaited with ``asyncio.gather``), the same prefetch, and the same queues (declared with our WORK
arguments, a quorum queue, and with our NODE arguments, a classic one). Prints msgs/s of each and
the ratio ours/plain (target >= 0.8).

On a small machine the broker and this client share the CPUs, and quorum queues fsync, so single
runs vary by tens of percent: the rounds alternate which side goes first and the median is shown.

Run: ``python bench/bus.py [--url amqp://...] [--count N] [--window W] [--prefetch P] [--rounds R]
[--queues work,node] [--verbose]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.bus.base import Delivery, QueueKind, QueueSpec
from infra.bus.rabbitmq import RabbitBus
from protocol.messages import CONTENT_TYPE, Probe

DEFAULT_URL = os.environ.get("TOASTMACHINE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


async def windowed(count: int, window: int, publish: Callable[[int], Awaitable[Any]]) -> float:
    """Publish ``count`` messages, ``window`` in flight at a time; return the seconds taken."""
    started = time.perf_counter()
    for start in range(0, count, window):
        await asyncio.gather(*(publish(n) for n in range(start, min(start + window, count))))
    return time.perf_counter() - started


async def bench_ours(bus: RabbitBus, kind: QueueKind, count: int, window: int, prefetch: int,
                     data: str) -> tuple[float, float]:
    spec = QueueSpec(f"bench.ours.{uuid.uuid4().hex[:8]}", kind, max_length=count)
    queue = await bus.declare_queue(spec)
    try:
        publish_s = await windowed(count, window, lambda n: bus.publish("", queue, Probe(n=n, data=data)))
        done = asyncio.Event()
        seen = 0

        async def handler(d: Delivery) -> None:
            nonlocal seen
            seen += 1
            if seen == count:
                done.set()

        started = time.perf_counter()
        consumer = await bus.consume(queue, handler, prefetch=prefetch)
        await done.wait()
        consume_s = time.perf_counter() - started
        await consumer.drain(10)
        return publish_s, consume_s
    finally:
        await bus.delete_queue(queue)


def plain_arguments(kind: QueueKind, name: str, count: int) -> dict[str, Any]:
    """What RabbitBus declares for a queue of ``kind`` (see infra/bus/rabbitmq.py), spelled out."""
    if kind is QueueKind.WORK:
        return {"durable": True, "arguments": {
            "x-queue-type": "quorum", "x-delivery-limit": 4, "x-dead-letter-exchange": "tm.dead",
            "x-dead-letter-routing-key": name, "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish"}}
    return {"exclusive": True, "auto_delete": True,
            "arguments": {"x-max-length": count, "x-overflow": "drop-head"}}


async def bench_plain(connection: aio_pika.abc.AbstractConnection, kind: QueueKind, count: int, window: int,
                      prefetch: int, data: str) -> tuple[float, float]:
    name = f"bench.plain.{uuid.uuid4().hex[:8]}"
    admin = await connection.channel()
    await admin.declare_queue(name, **plain_arguments(kind, name, count))
    try:
        publisher = await connection.channel(publisher_confirms=True)

        async def publish(n: int) -> None:
            body = orjson.dumps({"n": n, "data": data})
            message = aio_pika.Message(body, content_type=CONTENT_TYPE, type=Probe.TYPE, headers={},
                                       delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await publisher.default_exchange.publish(message, routing_key=name, mandatory=False)

        publish_s = await windowed(count, window, publish)
        await publisher.close()

        consumer_channel = await connection.channel(publisher_confirms=False)
        await consumer_channel.set_qos(prefetch_count=prefetch)
        cq = await consumer_channel.declare_queue(name, passive=True)
        done = asyncio.Event()
        seen = 0

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal seen
            orjson.loads(message.body)
            await message.ack()
            seen += 1
            if seen == count:
                done.set()

        started = time.perf_counter()
        tag = await cq.consume(on_message)
        await done.wait()
        consume_s = time.perf_counter() - started
        await cq.cancel(tag)
        await consumer_channel.close()
        return publish_s, consume_s
    finally:
        await admin.queue_delete(name)
        await admin.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--count", type=int, default=10_000, help="messages per measurement")
    parser.add_argument("--window", type=int, default=100, help="publishes in flight at once")
    parser.add_argument("--prefetch", type=int, default=100)
    parser.add_argument("--size", type=int, default=256, help="length of the Probe's data string")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds; the median is reported")
    parser.add_argument("--queues", default="work,node",
                        help="queue kinds to measure: work (quorum, fsyncs: noisy) and/or node (classic)")
    parser.add_argument("--verbose", action="store_true", help="print every round")
    args = parser.parse_args()
    data = "x" * args.size
    kinds = [QueueKind(k.strip()) for k in args.queues.split(",") if k.strip()]

    bus = RabbitBus(args.url, connection_name="bench-ours")
    await bus.connect()
    connection = await aio_pika.connect(args.url, client_properties={"connection_name": "bench-plain"})
    results: dict[tuple[QueueKind, str], list[tuple[float, float]]] = {}
    try:
        for kind in kinds:
            # Warm up both paths (connections, code paths, the broker's queue machinery).
            await bench_ours(bus, kind, min(args.count, 2000), args.window, args.prefetch, data)
            await bench_plain(connection, kind, min(args.count, 2000), args.window, args.prefetch, data)
            for i in range(args.rounds):
                # Alternate which goes first: the broker's background work (quorum queues write and
                # fsync a log, deleted queues are cleaned up) would otherwise favour one side.
                for who in (("plain", "ours") if i % 2 == 0 else ("ours", "plain")):
                    if who == "ours":
                        result = await bench_ours(bus, kind, args.count, args.window, args.prefetch, data)
                    else:
                        result = await bench_plain(connection, kind, args.count, args.window, args.prefetch, data)
                    results.setdefault((kind, who), []).append(result)
                    if args.verbose:
                        print(f"{kind.value} round {i} {who:5s} publish {args.count / result[0]:8,.0f} msg/s   "
                              f"consume {args.count / result[1]:8,.0f} msg/s", flush=True)
    finally:
        await connection.close()
        await bus.close()

    def rate(kind: QueueKind, who: str, index: int) -> float:
        return args.count / statistics.median(r[index] for r in results[(kind, who)])

    print(f"{args.count} Probe messages ({len(orjson.dumps({'n': 0, 'data': data}))} B bodies), "
          f"window {args.window}, prefetch {args.prefetch}, median of {args.rounds} alternating rounds")
    for kind in kinds:
        label_kind = "WORK (quorum)" if kind is QueueKind.WORK else "NODE (classic)"
        for label, index in (("publish-with-confirm", 0), ("consume-with-ack", 1)):
            ours, plain = rate(kind, "ours", index), rate(kind, "plain", index)
            print(f"  {label_kind:15s} {label:21s} ours {ours:8,.0f} msg/s   plain aio-pika {plain:8,.0f} msg/s"
                  f"   ratio {ours / plain:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
