"""How a message on the bus is bound to its corpus (SPEC §1: several corpora may share one broker).

Every command, reply and event carries the corpus it belongs to in two headers, ``x-corpus-id``
and ``x-corpus-lineage`` (the names the event headers already use), and travels under names
derived from the corpus id:

* commands: routing key ``<corpus_id>.<operation>`` on ``tm.commands`` (:func:`command_key`), taken
  by the corpus's own writer queue ``tm.commands.writer.<corpus_id>`` bound ``<corpus_id>.#``;
* events: published on the corpus's own topic exchange ``tm.events.<corpus_id>``
  (:func:`events_exchange`), which is bound exchange-to-exchange into ``tm.events`` with ``#``, so
  ``tm.events`` still carries every event of every corpus with routing key ``<type>.<partition>``;
* the hubs' feed: one :class:`~protocol.events.ChangeBatch` per publisher window on the corpus's
  internal exchange ``tm.hub.<corpus_id>`` (:func:`hub_exchange`), bound nowhere else, so
  integrations binding ``tm.events`` see one message per change and nothing of it.

Names keep foreign traffic out of a consumer's queue; :meth:`CorpusScope.refusal` is the check every
consumer still applies to what it takes (a misbinding, a hand-published message or a node whose
configuration disagrees with its database), so that a foreign message is refused with a reason
instead of being applied to the wrong corpus.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from protocol.events import HEADER_CORPUS_ID, HEADER_LINEAGE

#: The writer queue of the single-corpus topology (before corpus-bound names): bound ``#`` on
#: ``tm.commands``, it would collect a copy of every command of every corpus. Writers unbind it.
LEGACY_WRITER_QUEUE = "tm.commands.writer"
#: Prefix of every corpus's writer queue; the corpus id follows.
WRITER_QUEUE_PREFIX = "tm.commands.writer."
#: Prefix of every corpus's event exchange; the corpus id follows.
EVENTS_EXCHANGE_PREFIX = "tm.events."

#: Prefix of every corpus's internal hub-feed exchange; the corpus id follows.
HUB_EXCHANGE_PREFIX = "tm.hub."
#: The routing key of every :class:`~protocol.events.ChangeBatch` on it (hubs bind ``#``).
HUB_ROUTING_KEY = "batch"

#: Most characters of a foreign identity quoted back in a reason (headers are the sender's text).
_QUOTE_LIMIT = 64


@dataclass(frozen=True, slots=True)
class CorpusScope:
    """The corpus and history lineage that a process's bus traffic belongs to.

    Args:
        corpus_id: the corpus witness's corpus id (canonical UUID text).
        lineage: the corpus witness's history lineage (canonical UUID text).
    """

    corpus_id: str
    lineage: str

    @property
    def writer_queue(self) -> str:
        """The durable queue of this corpus's writers: ``tm.commands.writer.<corpus_id>``."""
        return WRITER_QUEUE_PREFIX + self.corpus_id

    @property
    def command_pattern(self) -> str:
        """The binding of :attr:`writer_queue` on ``tm.commands``: every key of this corpus."""
        return f"{self.corpus_id}.#"

    @property
    def events_exchange(self) -> str:
        """This corpus's event exchange: ``tm.events.<corpus_id>``."""
        return events_exchange(self.corpus_id)

    @property
    def hub_exchange(self) -> str:
        """This corpus's internal exchange feeding the notification hubs: ``tm.hub.<corpus_id>``."""
        return hub_exchange(self.corpus_id)

    def command_key(self, operation: str) -> str:
        """The routing key of a command of this corpus: ``<corpus_id>.<operation>``."""
        return command_key(self.corpus_id, operation)

    def headers(self) -> dict[str, str]:
        """The headers that bind a message to this corpus."""
        return {HEADER_CORPUS_ID: self.corpus_id, HEADER_LINEAGE: self.lineage}

    def refusal(self, headers: Mapping[str, object], *, corpus_id: str | None = None,
                lineage: str | None = None) -> str | None:
        """Why a message with ``headers`` (and, for events, the body's own ``corpus_id`` and
        ``lineage``) does not belong to this scope, or None when it does.

        A message without the headers is refused too: every sender of this version sets them, so a
        message lacking them comes from an older or foreign sender that cannot be trusted to mean
        this corpus.
        """
        for name, want, body in ((HEADER_CORPUS_ID, self.corpus_id, corpus_id),
                                 (HEADER_LINEAGE, self.lineage, lineage)):
            have = headers.get(name)
            if have is None:
                return f"foreign message: header {name} is missing (this consumer serves {name} {want})"
            if str(have) != want:
                return f"foreign message: {name} is {_quote(have)}, this consumer serves {want}"
            if body is not None and body != want:
                return f"foreign message: its body names {name} {_quote(body)}, this consumer serves {want}"
        return None


def command_key(corpus_id: str, operation: str) -> str:
    """``<corpus_id>.<operation>``, e.g. ``5b0c….message.append``."""
    return f"{corpus_id}.{operation}"


def events_exchange(corpus_id: str) -> str:
    """``tm.events.<corpus_id>``: where the corpus's publisher publishes its events."""
    return EVENTS_EXCHANGE_PREFIX + corpus_id


def hub_exchange(corpus_id: str) -> str:
    """``tm.hub.<corpus_id>``: where the corpus's publisher publishes one change batch per window."""
    return HUB_EXCHANGE_PREFIX + corpus_id


def _quote(value: object) -> str:
    text = str(value)
    return repr(text if len(text) <= _QUOTE_LIMIT else text[:_QUOTE_LIMIT] + "…")
