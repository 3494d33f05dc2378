"""Shared fixtures and the run's hooks. Service detection lives in tests/services.py; fixture families in
their own modules.

The suite runs in parallel (pytest-xdist, ``-n`` in pyproject's addopts). Two hooks here keep that
correct: every test runs under the machine's service lock (:mod:`tests.service_lock`: shared, or
exclusive for tests marked ``exclusive``), and the skipped-services banner collects what every worker
skipped.
"""

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
from tests.service_lock import LOCK_DIR, ServiceLock


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


_LOCK = ServiceLock(LOCK_DIR)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Run the test (setup, call and teardown, so session fixtures made or torn down with it too)
    holding the service lock: exclusively for ``@pytest.mark.exclusive``, else shared."""
    with _LOCK.held(exclusive=item.get_closest_marker("exclusive") is not None):
        return (yield)


#: Key of a worker's skipped services in the output pytest-xdist sends back to the controller.
_SKIPPED_KEY = "toastmachine_skipped_services"


def pytest_sessionfinish(session: pytest.Session) -> None:
    # On an xdist worker: hand what it skipped to the controller, which prints the banner.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[_SKIPPED_KEY] = dict(services.SKIPPED)


class _WorkerSkips:
    """Controller side of the banner under xdist: each worker's skipped services, as it finishes."""

    def pytest_testnodedown(self, node: Any, error: object) -> None:
        services.SKIPPED.update(getattr(node, "workeroutput", {}).get(_SKIPPED_KEY, {}))


def pytest_configure(config: pytest.Config) -> None:
    # pytest_testnodedown is an xdist hook: registered only when xdist is there to call it.
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerSkips(), "toastmachine-worker-skips")


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
