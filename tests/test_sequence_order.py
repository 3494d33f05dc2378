"""SPEC §4's commit-order hazard: a reader following ``after=<last seen>`` never skips a change.

Several corpus writers (competing consumers, each running concurrent group-commit transactions)
commit writes from many concurrent clients while a reader polls the change history with
``after=<last seen>`` the whole time, never looking back. If a transaction could commit a lower
sequence after a higher one became visible, the reader would step over it. At the end the reader
must have seen every sequence the history holds.
"""

from __future__ import annotations

import asyncio
import uuid

from actors.writer import CorpusWriter
from tests.corpus_fixtures import Stack, follow_history

WRITERS = 4
CLIENTS = 24
WRITES_PER_CLIENT = 25


async def test_reader_following_after_sees_every_sequence(stack: Stack) -> None:
    extra = [CorpusWriter(stack.bus, node_id=f"extra-{i}", db=stack.db, identity=stack.identity)
             for i in range(WRITERS - 1)]
    for writer in extra:
        await writer.start()
    agents = [await stack.register() for _ in range(4)]
    conversation = await stack.conversation(agents[0])
    cid = conversation["conversation"]["id"]
    seen: list[int] = []
    done = asyncio.Event()

    async def client(n: int) -> None:
        agent = agents[n % len(agents)]
        for i in range(WRITES_PER_CLIENT):
            reply = await stack.post(agent, f"/conversations/{cid}/messages", {"content": f"c{n}-{i}"},
                                     token=str(uuid.uuid4()))
            assert reply.status == 201, reply.body

    read = asyncio.create_task(follow_history(stack.db, done, seen))
    try:
        await asyncio.gather(*(client(n) for n in range(CLIENTS)))
    finally:
        done.set()
        await read
        for writer in extra:
            await writer.stop(grace=5)
    committed = [r["sequence"] for r in await stack.db.pool.fetch("select sequence from changes order by sequence")]
    assert len(committed) == CLIENTS * WRITES_PER_CLIENT + 1
    assert seen == committed, f"the reader skipped {sorted(set(committed) - set(seen))[:20]}"
