"""Typed bus messages and the one codec that turns them into wire bytes and back.

Every message that crosses the bus is a frozen, slotted dataclass registered here under a stable
``TYPE`` name. The AMQP ``type`` property carries that name; the body is the dataclass encoded as a
JSON object with orjson. :func:`decode_message` is the single place where wire bytes become typed
objects; anything it cannot decode raises :class:`ProtocolDecodeError` and is dead-lettered.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

import orjson

from protocol.errors import ProtocolDecodeError

CONTENT_TYPE = "application/json"
WIRE_SCHEMA_VERSION = 1

_REGISTRY: dict[str, type[BusMessage]] = {}

M = TypeVar("M", bound="BusMessage")


@dataclasses.dataclass(frozen=True, slots=True)
class BusMessage:
    """Base class of everything published on the bus. Subclasses set ``TYPE`` and register."""

    TYPE: ClassVar[str] = ""


def register(cls: type[M]) -> type[M]:
    """Class decorator: make ``cls`` decodable by its ``TYPE`` name."""
    if not cls.TYPE:
        raise TypeError(f"{cls.__name__} has no TYPE")
    existing = _REGISTRY.get(cls.TYPE)
    if existing is not None and existing is not cls:
        raise TypeError(f"message type {cls.TYPE!r} registered twice ({existing.__name__}, {cls.__name__})")
    _REGISTRY[cls.TYPE] = cls
    return cls


def message_type(name: str) -> type[BusMessage] | None:
    """The registered class for a type name, if any."""
    return _REGISTRY.get(name)


def encode_message(message: BusMessage) -> tuple[str, bytes]:
    """Return ``(type_name, body)`` for a registered message."""
    cls = type(message)
    if _REGISTRY.get(cls.TYPE) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered bus message")
    return cls.TYPE, orjson.dumps(message)


def decode_message(type_name: str | None, body: bytes) -> BusMessage:
    """Turn a wire ``type`` and body into the registered dataclass, or raise ProtocolDecodeError."""
    if not type_name:
        raise ProtocolDecodeError("message has no type property")
    cls = _REGISTRY.get(type_name)
    if cls is None:
        raise ProtocolDecodeError(f"unknown message type {type_name!r}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ProtocolDecodeError(f"body of {type_name!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ProtocolDecodeError(f"body of {type_name!r} is not a JSON object")
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    unknown = sorted(set(data) - fields)
    if missing or unknown:
        raise ProtocolDecodeError(
            f"body of {type_name!r} does not match its schema (missing={missing}, unknown={unknown})")
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise ProtocolDecodeError(f"body of {type_name!r} is invalid: {e}") from e


# --- messages of the foundation ------------------------------------------------------------------


@register
@dataclasses.dataclass(frozen=True, slots=True)
class Ping(BusMessage):
    """A no-op command: a writer answers it with :class:`Pong`, proving the whole command path works."""

    TYPE: ClassVar[str] = "system.ping"
    nonce: str


@register
@dataclasses.dataclass(frozen=True, slots=True)
class Pong(BusMessage):
    """The reply to :class:`Ping`, naming the process that answered."""

    TYPE: ClassVar[str] = "system.pong"
    nonce: str
    responder: str


@register
@dataclasses.dataclass(frozen=True, slots=True)
class ErrorReply(BusMessage):
    """A reply that carries a public error instead of a result (code, message, how_to_proceed, status)."""

    TYPE: ClassVar[str] = "system.error"
    status: int
    code: str
    message: str
    how_to_proceed: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@register
@dataclasses.dataclass(frozen=True, slots=True)
class Probe(BusMessage):
    """A numbered test/benchmark message: the behaviour suite and bench/bus.py stream these."""

    TYPE: ClassVar[str] = "system.probe"
    n: int
    data: str = ""


@register
@dataclasses.dataclass(frozen=True, slots=True)
class RequestBatch(BusMessage):
    """Several requests sent as one message (the batch form of :meth:`~infra.bus.base.Bus.request`).

    Each member is an object ``{"correlation_id", "routing_key", "type", "body", "headers"}``: the
    member's own correlation id (its answer is matched by it), routing key, wire type, encoded body
    (JSON text) and headers (its own ``x-deadline`` and trace id). The consuming bus splits it
    before any handler sees it; a member it cannot decode is answered and dead-lettered alone.
    """

    TYPE: ClassVar[str] = "system.batch"
    members: list[dict[str, Any]]

    def __post_init__(self) -> None:
        # Anything but a list would fail only when the consuming bus splits it, past the codec,
        # leaving the message unsettled: refused here, it is answered and dead-lettered like any
        # undecodable message. (A member that is not an object is the bus's to refuse, alone.)
        if not isinstance(self.members, list):
            raise TypeError("'members' must be a list")


@register
@dataclasses.dataclass(frozen=True, slots=True)
class BatchReply(BusMessage):
    """The one reply to a :class:`RequestBatch`: each answer is ``{"correlation_id", "type", "body",
    "headers"}`` for one member, sent once every member is decided."""

    TYPE: ClassVar[str] = "system.batch-reply"
    answers: list[dict[str, Any]]

    def __post_init__(self) -> None:
        if not isinstance(self.answers, list):
            raise TypeError("'answers' must be a list")
