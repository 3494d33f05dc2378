"""Prometheus metrics of one process, in a registry of its own (no global state between apps/tests)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from infra.bus.base import Bus
from infra.runtime import Actor, ActorHealth, ActorState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

A = TypeVar("A", bound=Actor)
#: The metric families a :class:`SingleActiveCollector` fills (both take ``add_metric``).
Family = GaugeMetricFamily | CounterMetricFamily


class Metrics:
    """HTTP request counters and latencies, plus live bus and actor gauges read at scrape time.

    Args:
        bus: read for connection state and message counters (None until connected).
        actors: callable returning the current per-actor health of this process.
    """

    def __init__(self, bus: Callable[[], Bus | None], actors: Callable[[], Mapping[str, ActorHealth]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "toastmachine_http_requests", "HTTP requests answered, by route and status.",
            ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram(
            "toastmachine_http_request_duration_seconds", "HTTP request latency, by route.",
            ["method", "route"], registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.rejected = Counter(
            "toastmachine_http_rejected", "Requests refused before reaching a route (unparseable, too "
            "large, too slow), by reason.", ["reason"], registry=self.registry)
        self.stream_rows = Counter(
            "toastmachine_stream_catchup_rows", "Change rows SSE streams read from the history to catch up.",
            registry=self.registry)
        self.stream_pages = Counter(
            "toastmachine_stream_catchup_pages", "History pages SSE streams read to catch up.",
            registry=self.registry)
        self.stream_refused = Counter(
            "toastmachine_stream_refused", "SSE streams refused by a concurrency cap, by cap.",
            ["cap"], registry=self.registry)
        # The archive and the publisher as the database records them, set by a web node at each
        # scrape: the archiver and publisher processes serve no HTTP, so in a Procfile deployment
        # these are where their progress is seen (a stopped publisher leaves writes committed but
        # never followed).
        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(f"toastmachine_corpus_{name}", documentation, registry=self.registry)

        self.corpus_archive_verified = gauge(
            "archive_verified_through", "Highest change sequence in a verified archive segment, as the database "
            "records it (NaN: the database did not answer).")
        self.corpus_archive_lag = gauge(
            "archive_lag_events", "Committed changes not yet in a verified archive segment, as the database "
            "records them (counted exactly up to a bound, then the sequence difference).")
        self.corpus_archive_store_up = gauge(
            "archive_store_up", "1 while the active archiver's store answered it last, 0 while it fails (from "
            "archiver_store_state).")
        self.corpus_publisher_cursor = gauge(
            "publisher_cursor", "The event publisher's cursor: every change up to it is confirmed on tm.events "
            "(NaN: the database did not answer).")
        self.corpus_publisher_lag = gauge(
            "publisher_lag_events", "Committed changes after the publisher's cursor, not yet published "
            "(counted up to 100,000).")
        self.corpus_publisher_active = gauge(
            "publisher_active", "1 while some process holds the publisher lock, 0 while none does (no change is "
            "published then).")
        self.registry.register(_LiveCollector(bus, actors))

    def set_corpus_archive(self, detail: Mapping[str, Any]) -> None:
        """Set the corpus archive gauges from the archive detail a readiness check builds (NaN for
        what it could not read)."""
        nan = float("nan")
        self.corpus_archive_verified.set(float(detail.get("verified_through", nan)))
        self.corpus_archive_lag.set(float(detail.get("lag_events", nan)))
        store = detail.get("store")
        self.corpus_archive_store_up.set(nan if not isinstance(store, Mapping) else
                                         1.0 if store.get("status") == "ok" else 0.0)

    def set_corpus_publisher(self, detail: Mapping[str, Any]) -> None:
        """Set the corpus publisher gauges from the publisher detail a readiness check builds."""
        nan = float("nan")
        self.corpus_publisher_cursor.set(float(detail.get("cursor", nan)))
        self.corpus_publisher_lag.set(float(detail.get("lag_events", nan)))
        status = detail.get("status")
        self.corpus_publisher_active.set(1.0 if status == "active" else 0.0 if status == "none_active" else nan)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    def __init__(self, bus: Callable[[], Bus | None], actors: Callable[[], Mapping[str, ActorHealth]]) -> None:
        self._bus = bus
        self._actors = actors

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        bus = self._bus()
        if bus is not None:
            s = bus.stats
            up = GaugeMetricFamily("toastmachine_bus_connected", "1 while the bus connection is open.",
                                   labels=["backend"])
            up.add_metric([bus.backend], 1.0 if s.connected else 0.0)
            yield up
            counters = CounterMetricFamily("toastmachine_bus_messages", "Bus messages by outcome.",
                                           labels=["backend", "outcome"])
            for outcome in ("published", "delivered", "acked", "nacked", "dead_lettered"):
                counters.add_metric([bus.backend, outcome], float(getattr(s, outcome)))
            yield counters
            batches = CounterMetricFamily(
                "toastmachine_bus_request_batches", "Requests sent together as one batch message, and those messages.",
                labels=["backend", "what"])
            batches.add_metric([bus.backend, "messages"], float(s.request_batches))
            batches.add_metric([bus.backend, "requests"], float(s.batched_requests))
            yield batches
            reconnects = CounterMetricFamily("toastmachine_bus_reconnects", "Bus reconnections.",
                                             labels=["backend"])
            reconnects.add_metric([bus.backend], float(s.reconnects))
            yield reconnects
        actors = self._actors()
        running = GaugeMetricFamily("toastmachine_actor_running", "1 while the actor is running.",
                                    labels=["actor"])
        restarts = CounterMetricFamily("toastmachine_actor_restarts", "Restarts after a crash.",
                                       labels=["actor"])
        for name, health in sorted(actors.items()):
            running.add_metric([name], 1.0 if health.state is ActorState.RUNNING else 0.0)
            restarts.add_metric([name], float(health.restarts))
        yield running
        yield restarts


class SingleActiveCollector(Collector, abc.ABC, Generic[A]):
    """Prometheus families of a single-active actor (one lock holder per corpus: the publisher, the
    archiver) as it runs in this process, read at scrape time.

    Subclasses set :attr:`kind`, name their families in :meth:`families` and fill them from the actor
    in :meth:`fill`; while this process runs no such actor, the families are exported empty.

    Args:
        current: returns the actor this process runs now (the supervisor replaces it on restart).
    """

    #: The actor class whose state is exported; any other current actor exports nothing.
    kind: type[A]

    def __init__(self, current: Callable[[], Actor | None]) -> None:
        self._current = current

    @staticmethod
    @abc.abstractmethod
    def families() -> tuple[Family, ...]:
        """Fresh, empty metric families (one set per scrape)."""

    @abc.abstractmethod
    def fill(self, actor: A, families: tuple[Family, ...]) -> None:
        """Add this scrape's samples from ``actor`` to ``families`` (as :meth:`families` ordered them)."""

    def describe(self) -> Iterable[Metric]:
        return list(self.families())

    def collect(self) -> Iterable[Metric]:
        actor = self._current()
        families = self.families()
        if isinstance(actor, self.kind):
            self.fill(actor, families)
        return list(families)


def register_once(registry: CollectorRegistry, collector: Collector) -> None:
    """Register ``collector`` unless one exporting the same names already is (later calls are no-ops):
    the registered collector reads the current actor, so a restarted actor needs no new one."""
    with contextlib.suppress(ValueError):  # the registry refuses names it already exports
        registry.register(collector)
