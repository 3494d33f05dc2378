"""The change event as it travels on ``tm.events`` (SPEC §1, §4).

The body is exactly the event envelope of the change history, ``{"schema_version", "sequence",
"type", "partition", "corpus_id", "lineage", "occurred_at", "data"}``, so an integration that binds
its own queue reads the same JSON as a line of ``GET /corpus/changes.jsonl``. The routing key is
``<type>.<partition>`` (e.g. ``message.appended.7``), the AMQP ``message_id`` is
``<lineage>:<sequence>``, and the headers repeat corpus_id, lineage, sequence and schema_version
next to the trace id (:func:`event_headers`).
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
