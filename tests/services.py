"""Which real services the test run can reach, and what to do when one is missing.

Locally a missing RabbitMQ or PostgreSQL skips its suite (and the run's summary says so loudly);
with ``TOASTMACHINE_REQUIRE_SERVICES=1`` (CI) a missing service fails the run instead.
"""

from __future__ import annotations

import asyncio
import functools
import os

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
