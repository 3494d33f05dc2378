"""The message bus: one contract (:mod:`infra.bus.base`), two backends (memory, RabbitMQ)."""

from __future__ import annotations

from infra.bus.base import (
    COMMANDS_EXCHANGE,
    DEAD_EXCHANGE,
    DEAD_LETTER_QUEUE,
    DEAD_REASON_HEADER,
    DEADLINE_HEADER,
    DEFAULT_DELIVERY_LIMIT,
    DEFAULT_NODE_QUEUE_MAX_LENGTH,
    DELIVERY_COUNT_HEADER,
    EVENTS_EXCHANGE,
    Bus,
    BusStats,
    Consumer,
    Delivery,
    Handler,
    Headers,
    HeaderValue,
    QueueKind,
    QueueSpec,
    deadline_header,
)
from infra.bus.memory import MemoryBus
from infra.bus.rabbitmq import RabbitBus


def make_bus(amqp_url: str | None) -> Bus:
    """The bus for a configuration: RabbitMQ at ``amqp_url``, or the in-process bus when it is None.

    Only builds the object; call :meth:`Bus.connect` (or use it as an async context manager).
    """
    if amqp_url is None:
        return MemoryBus()
    return RabbitBus(amqp_url)


__all__ = [
    "COMMANDS_EXCHANGE",
    "DEADLINE_HEADER",
    "DEAD_EXCHANGE",
    "DEAD_LETTER_QUEUE",
    "DEAD_REASON_HEADER",
    "DEFAULT_DELIVERY_LIMIT",
    "DEFAULT_NODE_QUEUE_MAX_LENGTH",
    "DELIVERY_COUNT_HEADER",
    "EVENTS_EXCHANGE",
    "Bus",
    "BusStats",
    "Consumer",
    "Delivery",
    "Handler",
    "HeaderValue",
    "Headers",
    "MemoryBus",
    "QueueKind",
    "QueueSpec",
    "RabbitBus",
    "deadline_header",
    "make_bus",
]
