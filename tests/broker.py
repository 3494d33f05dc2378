"""Restarting the machine's RabbitMQ from a test (``rabbitmqctl stop_app`` / ``start_app``).

Only tests marked ``@pytest.mark.exclusive`` may do this: the broker goes away for every run on the
machine, and the service lock (:mod:`tests.service_lock`) makes sure no other test is running.

A restart in the middle of a suite is the one thing that reaches every run's virtual host
(:func:`tests.services.private_vhost`), and each of those keeps the quorum queues of the tests that
ran in it (a node's work queues are durable and named per corpus): about 300 in all by the end of a run,
each stopped by ``stop_app`` and recovered by ``start_app``. Seen here: ``stop_app`` hung for good on
a broker holding 600 quorum queues with messages, and a broker still starting accepts TCP
connections that then wait; and once a CI run's two fixtures timed out opening connections to their
virtual hosts, a cause not reproduced since.

So :func:`broker_restarted` first deletes the queues left in the other test virtual hosts (no test
is running in them while the exclusive test holds the lock, and no test uses a queue another test
left), and after ``start_app`` waits until every virtual host takes a connection and declares a
quorum queue before the exclusive test (and so the lock) lets go.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aio_pika

from tests import procs

#: Virtual hosts made by :func:`tests.services.private_vhost`, of this run and of any other.
TEST_VHOST_PREFIX = "tm-test-"
#: How long the broker may take to come back with every virtual host.
BACK_WITHIN = 180.0


async def rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl`` and return what it printed; fails the test on a non-zero exit."""
    proc = await asyncio.create_subprocess_exec("rabbitmqctl", *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await procs.communicate(proc, 120)
    except TimeoutError:
        raise AssertionError(f"rabbitmqctl {' '.join(args)}: no answer within 120 s") from None
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"rabbitmqctl {' '.join(args)}: {text}"
    return text


def _url(amqp_url: str, vhost: str) -> str:
    return urlsplit(amqp_url)._replace(path="/" + vhost).geturl()


async def _vhosts() -> list[str]:
    out = await rabbitmqctl("-q", "list_vhosts", "--no-table-headers", "name")
    return [line.strip() for line in out.splitlines() if line.strip()]


async def delete_left_queues(amqp_url: str, *, keep: str) -> int:
    """Delete every queue of every test virtual host but ``keep``; return how many.

    Only while holding the service lock exclusively: then no test is running anywhere on the
    machine, so nothing consumes those queues (RabbitMQ's own count of a quorum queue's consumers
    lags, and it refuses ``if-unused`` deletes of quorum queues, so neither can tell).
    """
    deleted = 0
    for vhost in await _vhosts():
        if not vhost.startswith(TEST_VHOST_PREFIX) or vhost == keep:
            continue
        out = await rabbitmqctl("-q", "list_queues", "-p", vhost, "--no-table-headers", "name")
        left = [line.strip() for line in out.splitlines() if line.strip()]
        if not left:
            continue
        connection = await aio_pika.connect(_url(amqp_url, vhost))
        try:
            channel = await connection.channel()
            for name in left:
                with contextlib.suppress(aio_pika.exceptions.AMQPError):
                    await channel.queue_delete(name)
                    deleted += 1
                if channel.is_closed:  # a failed delete closes the channel
                    channel = await connection.channel()
        finally:
            await connection.close()
    return deleted


async def _vhost_back(url: str) -> None:
    """Until a connection to ``url``'s virtual host declares (and deletes) a quorum queue."""
    while True:
        try:
            connection = await aio_pika.connect(url, timeout=10)
            try:
                channel = await connection.channel()
                queue = await channel.declare_queue(f"tm-test-probe-{uuid.uuid4().hex}", durable=True,
                                                    arguments={"x-queue-type": "quorum"})
                await queue.delete(if_unused=False, if_empty=False)
                return
            finally:
                await connection.close()
        except (aio_pika.exceptions.AMQPError, OSError, TimeoutError):
            await asyncio.sleep(0.2)


async def broker_back(amqp_url: str) -> None:
    """After ``start_app``: wait until the broker has started and every virtual host on it takes a
    connection and declares a quorum queue (the quorum system may still answer
    ``cluster_not_formed`` after ``await_startup``)."""
    await rabbitmqctl("await_startup")
    vhosts = await _vhosts()
    async with asyncio.timeout(BACK_WITHIN):
        await asyncio.gather(*(_vhost_back(_url(amqp_url, vhost)) for vhost in vhosts))


@contextlib.asynccontextmanager
async def broker_restarted(amqp_url: str) -> AsyncIterator[None]:
    """Stop the broker for the block, then start it and wait until it is back for everyone.

    ``amqp_url`` is the test's own (its virtual host keeps its queues); the block should keep the
    outage short.
    """
    own = urlsplit(amqp_url).path.lstrip("/")
    await delete_left_queues(amqp_url, keep=own)
    await rabbitmqctl("stop_app")
    try:
        yield
    finally:
        await rabbitmqctl("start_app")
        await broker_back(amqp_url)
