"""The message bus: one contract (:mod:`infra.bus.base`), two backends (memory, RabbitMQ)."""
