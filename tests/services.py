"""Which real services the test run can reach, and what to do when one is missing.

Locally a missing RabbitMQ or PostgreSQL skips its suite (and the run's summary says so loudly);
with ``TOASTMACHINE_REQUIRE_SERVICES=1`` (CI) a missing service fails the run instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

AMQP_URL = os.environ.get("TOASTMACHINE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
DATABASE_URL = os.environ.get("TOASTMACHINE_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REQUIRED = os.environ.get("TOASTMACHINE_REQUIRE_SERVICES", "") not in ("", "0", "false", "no")

#: service name -> why it was skipped; printed by conftest's terminal summary.
SKIPPED: dict[str, str] = {}


@functools.cache
def rabbitmq_problem() -> str | None:
    """None when RabbitMQ at AMQP_URL accepts a connection, else the reason."""
    import aio_pika

    async def probe() -> None:
        conn = await asyncio.wait_for(aio_pika.connect(AMQP_URL), 10)
        await conn.close()

    try:
        asyncio.run(probe())
    except Exception as e:  # noqa: BLE001 - any failure means "not reachable"
        return f"{type(e).__name__}: {e}"
    return None


@functools.cache
def postgres_problem() -> str | None:
    """None when PostgreSQL at DATABASE_URL accepts a connection, else the reason."""
    import asyncpg

    async def probe() -> None:
        conn = await asyncio.wait_for(asyncpg.connect(DATABASE_URL), 10)
        await conn.close()

    try:
        asyncio.run(probe())
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def require(service: str) -> str:
    """Return the URL of ``service`` ("rabbitmq" or "postgres"), or skip/fail the test."""
    problem = rabbitmq_problem() if service == "rabbitmq" else postgres_problem()
    url = AMQP_URL if service == "rabbitmq" else DATABASE_URL
    if problem is None:
        return url
    if REQUIRED:
        pytest.fail(f"{service} is required (TOASTMACHINE_REQUIRE_SERVICES=1) but unreachable at {url}: {problem}")
    SKIPPED[service] = f"unreachable at {url}: {problem}"
    pytest.skip(f"{service} unreachable: {problem}")


@contextlib.contextmanager
def private_vhost(amqp_url: str) -> Iterator[str]:
    """``amqp_url`` moved to a fresh RabbitMQ virtual host, deleted afterwards.

    Corpus-bound names keep two corpora apart on one broker, but a run's ``tm.dead.letters`` and
    firehose bindings on ``tm.events`` would still mix with another run's; a vhost per run keeps
    them apart. Needs
    ``rabbitmqctl`` on this machine (CI has it); without it the URL is used as given.
    """
    if shutil.which("rabbitmqctl") is None:
        yield amqp_url
        return
    parts = urlsplit(amqp_url)
    name = f"tm-test-{uuid.uuid4().hex[:12]}"
    _rabbitmqctl("add_vhost", name)
    try:
        _rabbitmqctl("set_permissions", "-p", name, parts.username or "guest", ".*", ".*", ".*")
        yield parts._replace(path="/" + name).geturl()
    finally:
        _rabbitmqctl("delete_vhost", name)


def _rabbitmqctl(*args: str) -> None:
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stdout}{done.stderr}")


async def drop_broker_connections(amqp_url: str, reason: str) -> None:
    """Have the broker close every client connection of ``amqp_url``'s virtual host, as a network
    cut or a broker restart would (``rabbitmqctl close_all_connections -p VHOST``): a real fault
    that leaves other test runs on the same broker alone."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not available to inject the fault")
    vhost = urlsplit(amqp_url).path.lstrip("/") or "/"
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl", "close_all_connections", "-p", vhost, reason,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")
