"""The actors a process can run, by name: ``toastmachine run NAME`` and the Procfile use these names."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from actors import archiver
from actors.publisher import EventPublisher, export_metrics
from actors.writer import CorpusWriter
from infra.archive_keys import archive_origin, load_signing_key_noting
from infra.archive_store import ArchiveStore
from infra.ratelimit import write_budget
from infra.runtime import Actor

if TYPE_CHECKING:
    from toastmachine.node import Node


def _writer(node: Node) -> Actor:
    return CorpusWriter(node.bus, node_id=node.settings.node_id, db=node.db, identity=node.identity,
                        identity_error=node.identity_error, prefetch=node.settings.prefetch,
                        max_batch=node.settings.writer_max_batch, linger=node.settings.writer_linger_ms / 1000,
                        write_budget=write_budget(node.settings.writes_per_second))


def _publisher(node: Node) -> Actor:
    export_metrics(node.metrics.registry,
                   lambda: node.supervisor.actors.get("publisher") if node.supervisor is not None else None)
    dsn = node.settings.database_url or (node.embedded.dsn if node.embedded is not None else None)
    return EventPublisher(node.bus, node.db, node_id=node.settings.node_id, identity=node.identity, dsn=dsn)


def _archiver(node: Node) -> Actor:
    archiver.export_metrics(node.metrics.registry,
                            lambda: node.supervisor.actors.get("archiver") if node.supervisor is not None else None)
    settings = node.settings
    dsn = settings.database_url or (node.embedded.dsn if node.embedded is not None else None)
    signer, generated = (load_signing_key_noting(settings, archive_origin(node.identity.corpus_id))
                         if node.identity else (None, None))
    policy = archiver.SealPolicy(settings.archive_segment_events, settings.archive_segment_bytes,
                                 settings.archive_segment_seconds)
    return archiver.Archiver(node.bus, node.db, identity=node.identity, store=ArchiveStore.from_settings(settings),
                             signer=signer, node_id=settings.node_id, dsn=dsn, policy=policy,
                             sweep_interval=settings.archive_sweep_seconds,
                             batch_segments=settings.archive_batch_segments,
                             manifest_page=settings.archive_manifest_page, generated_key_file=generated)


#: Back-end actors in start order. The web front is not here: it is its own process type (`web`).
ACTORS: dict[str, Callable[[Node], Actor]] = {
    "writer": _writer,
    "publisher": _publisher,
    "archiver": _archiver,
}
