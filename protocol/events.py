"""The change event as it travels on ``tm.events`` (SPEC §1, §4).

The body is exactly the event envelope of the change history, ``{"schema_version", "sequence",
"type", "partition", "corpus_id", "lineage", "occurred_at", "data"}``, so an integration that binds
its own queue reads the same JSON as a line of ``GET /corpus/changes.jsonl``. The routing key is
``<type>.<partition>`` (e.g. ``message.appended.7``), the AMQP ``message_id`` is
``<lineage>:<sequence>``, and the headers repeat corpus_id, lineage, sequence and schema_version
next to the trace id (:func:`event_headers`).

The notification hubs take the same changes in another form, one :class:`ChangeBatch` per publisher
window on an internal exchange (:mod:`protocol.routing`), so that a node consumes one message per
window rather than one per change; integrations never see it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from protocol.messages import BusMessage, register

#: Headers every published event carries (besides x-trace-id).
HEADER_CORPUS_ID = "x-corpus-id"
HEADER_LINEAGE = "x-corpus-lineage"
HEADER_SEQUENCE = "x-corpus-sequence"
HEADER_SCHEMA_VERSION = "x-schema-version"


@register
@dataclasses.dataclass(frozen=True, slots=True)
class ChangeEvent(BusMessage):
    """One committed change: the event envelope, field for field."""

    TYPE: ClassVar[str] = "corpus.event"
    schema_version: int
    sequence: int
    type: str
    partition: int
    corpus_id: str
    lineage: str
    occurred_at: str
    data: dict[str, Any]

    @property
    def routing_key(self) -> str:
        """``<type>.<partition>``, e.g. ``message.appended.7``."""
        return f"{self.type}.{self.partition}"

    @property
    def message_id(self) -> str:
        """``<lineage>:<sequence>``: unique per change across restored histories."""
        return f"{self.lineage}:{self.sequence}"


def event_headers(event: ChangeEvent) -> dict[str, str | int]:
    """The AMQP headers of a published event (the trace id is added by the bus)."""
    return {HEADER_CORPUS_ID: event.corpus_id, HEADER_LINEAGE: event.lineage,
            HEADER_SEQUENCE: event.sequence, HEADER_SCHEMA_VERSION: event.schema_version}


#: Most bytes of envelope text one :class:`ChangeBatch` carries; a window holding more is split.
MAX_CHANGE_BATCH_BYTES = 1024 * 1024


@register
@dataclasses.dataclass(frozen=True, slots=True)
class ChangeBatch(BusMessage):
    """The changes of one publisher window, in one message, for the notification hubs only
    (published on the internal exchange ``tm.hub.<corpus_id>``, never on ``tm.events``).

    ``changes`` holds ``[sequence, type, partition, envelope]`` per change, ascending, the envelope
    being the stored text of the change history verbatim. ``after`` is the publisher's cursor before
    them (or the last sequence of the previous part of a split window): the history holds no change
    between it and the first of them, so every change with a sequence in ``(after, last]`` is in
    this message. A consumer that passed on ``after`` or more has no hole however sparse the
    sequences are, and one that passed on less knows exactly which hole to read from the history.
    """

    TYPE: ClassVar[str] = "corpus.change-batch"
    corpus_id: str
    lineage: str
    after: int
    changes: list[list[Any]]


def split_change_batches(corpus_id: str, lineage: str, after: int, changes: list[list[Any]], *,
                         max_bytes: int = MAX_CHANGE_BATCH_BYTES) -> list[ChangeBatch]:
    """``changes`` (ascending, ``after`` below the first) as batches of at most ``max_bytes`` of
    envelope text each (always at least one change: an envelope is at most 100 KiB), each
    ``after`` the last sequence of the one before."""
    batches: list[ChangeBatch] = []
    current: list[list[Any]] = []
    size = 0
    for change in changes:
        length = len(change[3].encode())  # bytes, not characters: the bound is on the wire
        if current and size + length > max_bytes:
            batches.append(ChangeBatch(corpus_id, lineage, after, current))
            after, current, size = current[-1][0], [], 0
        current.append(change)
        size += length
    if current:
        batches.append(ChangeBatch(corpus_id, lineage, after, current))
    return batches
