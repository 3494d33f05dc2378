"""Follow a ToastMachine corpus from RabbitMQ, the way an integration should.

1. Ask the node which corpus it serves (``GET /corpus`` → ``corpus_id``), declare a durable queue of
   your own and bind it to that corpus's topic exchange ``tm.events.<corpus_id>`` with the patterns
   you care about (``message.*.*``: every appended message, in every partition; a conversation's
   root message comes in ``conversation.created``, so add ``conversation.*.*`` for those). Several corpora may
   share one broker: ``tm.events`` carries all of them, ``tm.events.<corpus_id>`` only this one.
   Still check each envelope's ``corpus_id`` and ``lineage``.
2. Catch up from ``GET /corpus/changes.jsonl?after=<last applied>`` first: the queue only holds
   what was published after it was bound.
3. Consume the queue with manual acks; apply each change once: skip any sequence at or below the
   last one applied (delivery is at least once, and a republish after a fault repeats some).
4. Remember the last applied sequence durably (a file here, a table in real life), and ack only
   after it is stored, so a crash repeats work instead of losing it.

Run: ``python examples/follow_rabbitmq.py --node http://127.0.0.1:8080 --amqp amqp://guest:guest@127.0.0.1/
--queue my-integration --state ./follow.state [--pattern 'message.*.*'] [--stop-after N]``

Only the standard library, aiohttp and aio-pika: nothing of ToastMachine's own code, as an outside
integration would be written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import aio_pika
import aiohttp

#: Each corpus publishes on its own exchange, bound into ``tm.events`` (which carries every corpus).
EXCHANGE_PREFIX = "tm.events."


class Follower:
    """Applies changes exactly once in effect, whatever way they arrive."""

    def __init__(self, state: Path, corpus_id: str, lineage: str | None = None) -> None:
        self.state = state
        self.corpus_id = corpus_id
        saved = json.loads(state.read_text()) if state.exists() else {}
        self.last: int = saved.get("last_sequence", 0)
        self.lineage: str | None = saved.get("lineage", lineage)
        self.applied = 0

    def apply(self, envelope: dict) -> bool:
        """Apply one change; False when it was already applied (a duplicate)."""
        if envelope["corpus_id"] != self.corpus_id:
            raise SystemExit(f"change of corpus {envelope['corpus_id']}, expected {self.corpus_id}: "
                             "the queue is bound to another corpus's exchange")
        if self.lineage is not None and envelope["lineage"] != self.lineage:
            raise SystemExit(f"change from lineage {envelope['lineage']}, expected {self.lineage}: "
                             "the corpus was restored; start again from /corpus/snapshot.jsonl")
        self.lineage = envelope["lineage"]
        if envelope["sequence"] <= self.last:
            return False
        # This is where an integration does its work; here: print one line per change.
        data = envelope["data"]
        text = (data.get("message") or {}).get("content", "")
        print(f"{envelope['sequence']} {envelope['type']} {text[:60]!r}", flush=True)
        self.last = envelope["sequence"]
        self.applied += 1
        self._save()
        return True

    def _save(self) -> None:
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"last_sequence": self.last, "lineage": self.lineage}))
        tmp.replace(self.state)  # atomic: the state is either the old or the new one


async def catch_up(follower: Follower, node: str, patterns: list[str], stop_after: int | None) -> bool:
    """Apply the changes after the follower's cursor that the binding patterns select, from the JSONL
    export, page by page; True when ``stop_after`` changes were applied before the head."""
    async with aiohttp.ClientSession() as session:
        while True:
            params = {"after": str(follower.last), "limit": "1000"}
            if follower.lineage:
                params["lineage"] = follower.lineage
            async with session.get(f"{node}/corpus/changes.jsonl", params=params) as resp:
                if resp.status != 200:
                    raise SystemExit(f"export answered {resp.status}: {await resp.text()}")
                async for line in resp.content:
                    if line.strip():
                        envelope = json.loads(line)
                        # The queue's routing key: what the binding patterns are matched against.
                        if any(topic_matches(p, f"{envelope['type']}.{envelope['partition']}") for p in patterns):
                            follower.apply(envelope)
                            if stop_after is not None and follower.applied >= stop_after:
                                return True
                        else:
                            follower.last = max(follower.last, envelope["sequence"])
                more = resp.headers["X-Corpus-Has-More"] == "true"
                follower.last = max(follower.last, int(resp.headers["X-Corpus-Next"]))
            if not more:
                return False


async def corpus_id_of(node: str) -> str:
    """The corpus the node serves, from ``GET /corpus``."""
    async with aiohttp.ClientSession() as session, session.get(f"{node}/corpus") as resp:
        if resp.status != 200:
            raise SystemExit(f"/corpus answered {resp.status}: {await resp.text()}")
        return str((await resp.json())["corpus_id"])


async def follow(args: argparse.Namespace) -> int:
    node = args.node.rstrip("/")
    follower = Follower(Path(args.state), await corpus_id_of(node))
    connection = await aio_pika.connect_robust(args.amqp)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=100)
        # Declaring it is harmless (the node's publisher declares the same durable topic exchange).
        exchange = await channel.declare_exchange(EXCHANGE_PREFIX + follower.corpus_id,
                                                  aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(args.queue, durable=True,
                                            arguments={"x-queue-type": "quorum"})
        for pattern in args.pattern:
            await queue.bind(exchange, pattern)
        # Bound first, then caught up: whatever is published from now on is in the queue, and
        # whatever was published before is in the export. Duplicates between the two are skipped.
        if await catch_up(follower, node, args.pattern, args.stop_after):
            return 0
        print(f"caught up at {follower.last}", flush=True)
        async with queue.iterator() as messages:
            async for message in messages:
                async with message.process(requeue=True):  # ack after apply; requeue if apply fails
                    follower.apply(json.loads(message.body))
                if args.stop_after is not None and follower.applied >= args.stop_after:
                    break
    return 0


def topic_matches(pattern: str, routing_key: str) -> bool:
    """Whether a topic binding ``pattern`` selects ``routing_key``, as RabbitMQ decides it: words
    split on ``.``; ``*`` is exactly one word, ``#`` zero or more. Used to take from the export
    exactly what the queue's bindings take (``message.appended.3``: partition 3 only)."""
    words, keys = pattern.split("."), routing_key.split(".")

    def match(i: int, j: int) -> bool:
        if i == len(words):
            return j == len(keys)
        if words[i] == "#":
            return any(match(i + 1, k) for k in range(j, len(keys) + 1))
        return j < len(keys) and words[i] in ("*", keys[j]) and match(i + 1, j + 1)

    return match(0, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, help="base URL of a ToastMachine web node")
    parser.add_argument("--amqp", required=True, help="RabbitMQ URL of the deployment")
    parser.add_argument("--queue", required=True, help="your durable queue's name")
    parser.add_argument("--state", required=True, help="file keeping the last applied sequence")
    parser.add_argument("--pattern", action="append", default=None,
                        help="binding pattern on tm.events.<corpus_id> (repeatable; default message.*.*)")
    parser.add_argument("--stop-after", type=int, default=None, help="exit after applying N changes")
    args = parser.parse_args(argv)
    args.pattern = args.pattern or ["message.*.*"]
    return asyncio.run(follow(args))


if __name__ == "__main__":
    sys.exit(main())
