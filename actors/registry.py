"""The actors a process can run, by name: ``toastmachine run NAME`` and the Procfile use these names."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from actors.writer import CorpusWriter
from infra.runtime import Actor

if TYPE_CHECKING:
    from toastmachine.node import Node


def _writer(node: Node) -> Actor:
    return CorpusWriter(node.bus, node_id=node.settings.node_id, db=node.db, identity=node.identity,
                        identity_error=node.identity_error, prefetch=node.settings.prefetch,
                        max_batch=node.settings.writer_max_batch, linger=node.settings.writer_linger_ms / 1000)


#: Back-end actors in start order. The web front is not here: it is its own process type (`web`).
ACTORS: dict[str, Callable[[Node], Actor]] = {
    "writer": _writer,
}
