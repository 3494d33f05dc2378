"""Bounds on the long-lived answers of a web node (SSE streams, JSONL exports): so many at once in
all, and so many per client, so that one client cannot take every place.

The client is the address :func:`infra.http.request_client` resolves (forwarding headers only from
trusted proxies), so clients behind one load balancer are not lumped together as its address.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

from aiohttp import web

from infra.http import request_client

#: What a refusal is for: ``"node"`` (every place on the node is taken) or ``"client"`` (this
#: client holds its share). A refusal raises the 503 its kind of answer uses.
Refuse = Callable[[str], NoReturn]


class ClientSlots:
    """At most ``total`` holders at once on this node, and ``per_client`` per client.

    A client over its share is refused at once: waiting could only end when it closes one of its
    own. A client under it waits up to ``wait`` seconds for a place on the node (0: refused at once
    when the node is full); the places taken by waiting requests count towards their client's share.
    """

    def __init__(self, total: int, per_client: int, refuse: Refuse, *, wait: float = 0.0) -> None:
        self.total = total
        self.per_client = per_client
        self.wait = wait
        self._refuse = refuse
        self._free = asyncio.Semaphore(total)
        self._by_client: collections.Counter[str] = collections.Counter()
        #: Requests waiting for a place on the node now.
        self.waiting = 0
        self._held = 0

    @property
    def held(self) -> int:
        """Places held now on this node."""
        return self._held

    @contextlib.asynccontextmanager
    async def hold(self, request: web.Request) -> AsyncIterator[None]:
        """A place for the block, for the request's client, or the refusal."""
        client = request_client(request)
        key = str(client) if client is not None else "unknown"
        if self._by_client[key] >= self.per_client:
            self._refuse("client")
        self._by_client[key] += 1
        try:
            if self._free.locked() and self.wait <= 0:
                self._refuse("node")
            self.waiting += 1
            try:
                async with asyncio.timeout(self.wait if self.wait > 0 else None):
                    await self._free.acquire()
            except TimeoutError:
                self._refuse("node")
            finally:
                self.waiting -= 1
            self._held += 1
            try:
                yield
            finally:
                self._held -= 1
                self._free.release()
        finally:
            self._by_client[key] -= 1
            if not self._by_client[key]:
                del self._by_client[key]
