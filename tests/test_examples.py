"""The README's integration example, run as a user would run it, against a node on RabbitMQ and PostgreSQL."""

from __future__ import annotations

import asyncio
import re
import sys
import uuid
from pathlib import Path

import pytest

from tests.corpus_fixtures import Stack, publishing

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "follow_rabbitmq.py"
LINE = re.compile(r"^(\d+) message\.appended '(.*)'$")


async def _run_example(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


async def _lines_until(proc: asyncio.subprocess.Process, pattern: str, seen: list[str], timeout: float) -> None:
    assert proc.stdout is not None
    async with asyncio.timeout(timeout):
        while True:
            raw = await proc.stdout.readline()
            if not raw:
                raise AssertionError("the example ended early:\n" + "\n".join(seen))
            line = raw.decode().rstrip()
            seen.append(line)
            if re.search(pattern, line):
                return


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.parametrize("stack_backends", ["services"], indirect=True)
async def test_follow_rabbitmq_example_applies_every_message_once_across_restarts(
        stack: Stack, rabbitmq_url: str, tmp_path: Path) -> None:
    alice = await stack.register()
    cid = (await stack.conversation(alice))["conversation"]["id"]
    for i in range(5):
        await stack.message(alice, cid, content=f"before-{i}")
    node = str(stack.client.make_url("")).rstrip("/")
    queue = f"test.example.{uuid.uuid4().hex[:8]}"
    state = tmp_path / "follow.state"
    args = ("--node", node, "--amqp", rabbitmq_url, "--queue", queue, "--state", str(state))
    seen: list[str] = []
    async with publishing(stack):
        # First run: catches up from the export (5 messages), then follows the queue for 5 more.
        proc = await _run_example(*args, "--stop-after", "10")
        await _lines_until(proc, r"^caught up at \d+", seen, 60)
        for i in range(5):
            await stack.message(alice, cid, content=f"live-{i}")
        async with asyncio.timeout(60):
            out, _ = await proc.communicate()
        seen += out.decode().splitlines()
        assert proc.returncode == 0, "\n".join(seen)
        # Second run, same state: only what came after the first run's last applied change.
        for i in range(3):
            await stack.message(alice, cid, content=f"later-{i}")
        proc = await _run_example(*args, "--stop-after", "3")
        async with asyncio.timeout(60):
            out, _ = await proc.communicate()
        seen += out.decode().splitlines()
        assert proc.returncode == 0, "\n".join(seen)
    applied = [(int(m.group(1)), m.group(2)) for m in map(LINE.match, seen) if m]
    expected = [(r["sequence"], r["content"]) for r in await stack.db.pool.fetch(
        "select c.sequence, m.content from changes c join messages m on m.id = c.message_id "
        "where c.type = 'message.appended' order by c.sequence")]
    assert applied == expected, "\n".join(seen)


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.parametrize("stack_backends", ["services"], indirect=True)
async def test_follow_rabbitmq_example_takes_from_the_export_what_its_bindings_take(
        stack: Stack, rabbitmq_url: str, tmp_path: Path) -> None:
    """Bound to one partition (``message.appended.<p>``), the example applies only that partition's
    messages, from the export as from the queue (the catch-up once kept the type and dropped the
    partition), and ``--stop-after`` also counts the catch-up (it once ran the whole export first)."""
    alice = await stack.register()
    conversations: dict[int, str] = {}
    while len(conversations) < 2:  # two conversations in different partitions
        created = await stack.conversation(alice)
        partition = int(await stack.db.pool.fetchval(
            "select partition from conversations where id = $1", uuid.UUID(created["conversation"]["id"])))
        conversations.setdefault(partition, created["conversation"]["id"])
    (mine, cid), (_, other) = sorted(conversations.items())
    for i in range(3):
        await stack.message(alice, cid, content=f"mine-{i}")
        await stack.message(alice, other, content=f"other-{i}")
    node = str(stack.client.make_url("")).rstrip("/")
    args = ("--node", node, "--amqp", rabbitmq_url, "--queue", f"test.example.{uuid.uuid4().hex[:8]}",
            "--pattern", f"message.appended.{mine}")
    seen: list[str] = []
    # Stopped inside the catch-up: two applied, no "caught up".
    early = await _run_example(*args, "--state", str(tmp_path / "early.state"), "--stop-after", "2")
    async with asyncio.timeout(60):
        out, _ = await early.communicate()
    lines = out.decode().splitlines()
    assert early.returncode == 0 and len([m for m in map(LINE.match, lines) if m]) == 2, lines
    assert not any(line.startswith("caught up") for line in lines), lines
    async with publishing(stack):
        proc = await _run_example(*args, "--state", str(tmp_path / "follow.state"), "--stop-after", "5")
        await _lines_until(proc, r"^caught up at \d+", seen, 60)
        for i in range(2):
            await stack.message(alice, other, content=f"other-live-{i}")
            await stack.message(alice, cid, content=f"mine-live-{i}")
        async with asyncio.timeout(60):
            out, _ = await proc.communicate()
        seen += out.decode().splitlines()
        assert proc.returncode == 0, "\n".join(seen)
    applied = [m.group(2) for m in map(LINE.match, seen) if m]
    assert applied == ["mine-0", "mine-1", "mine-2", "mine-live-0", "mine-live-1"], "\n".join(seen)
