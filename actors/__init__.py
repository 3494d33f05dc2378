"""The actors: one module per actor, each readable top to bottom (what it consumes, does, emits).

The base classes and the supervisor live in :mod:`infra.runtime`; :mod:`actors.registry` names the
actors that ``toastmachine run ACTOR`` can start.
"""
