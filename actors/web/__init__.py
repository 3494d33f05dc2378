"""The web front: aiohttp app factory, its routes, and the actor that serves it.

Ingress (HTTP writes → commands) and the SSE stream (fed by :mod:`actors.hub`) live in this front.
"""
