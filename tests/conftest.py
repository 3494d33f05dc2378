"""Shared fixtures. Service detection lives in tests/services.py; fixture families in their own modules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests import services
from tests.bus_fixtures import *
from tests.corpus_fixtures import *
from tests.db_fixtures import *
from tests.moto_server import moto_s3  # noqa: F401 - the moto S3 server fixture
from tests.s3_server import s3_server  # noqa: F401 - the SeaweedFS fixture


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    """URL of the real RabbitMQ, on a virtual host of this run's own; skips (locally) or fails (CI)
    when the broker is unreachable."""
    with services.private_vhost(services.require("rabbitmq")) as url:
        yield url


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """DSN of the real PostgreSQL server; skips (locally) or fails (CI) when it is unreachable."""
    return services.require("postgres")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not services.SKIPPED:
        return
    tr = terminalreporter
    tr.write_sep("!", "REAL SERVICES SKIPPED", red=True, bold=True)
    for name, why in sorted(services.SKIPPED.items()):
        tr.write_line(f"  {name}: {why}", red=True, bold=True)
    tr.write_line("  The tests that need them were skipped (with only RabbitMQ/PostgreSQL missing, only the "
                  "embedded database and in-process bus were tested). Start them (see README) or set "
                  "TOASTMACHINE_REQUIRE_SERVICES=1 to make this fatal.", red=True)
