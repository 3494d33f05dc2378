"""The web front: aiohttp app factory, its routes, and the actor that serves it.

Ingress (HTTP writes → commands) and the notification hub (events → SSE) live in this front.
"""
