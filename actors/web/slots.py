"""Bounds on the long-lived answers of a web node (SSE streams, JSONL exports): so many at once in
all, and so many per client, so that one client cannot take every place.

The client is the address :func:`infra.http.request_client` resolves (forwarding headers only from
trusted proxies), so clients behind one load balancer are not lumped together as its address.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NoReturn

from aiohttp import web

from infra.http import request_client

#: What a refusal is for: ``"node"`` (every place on the node is taken) or ``"client"`` (this
#: client holds its share). A refusal raises the 503 its kind of answer uses.
Refuse = Callable[[str], NoReturn]


@dataclass(slots=True)
class _Client:
    """One client's share: its places, and the requests holding or waiting for one (the entry
    goes when none is left)."""

    places: asyncio.Semaphore
    users: int = 0


@dataclass(slots=True)
class ClientSlots:
    """At most ``total`` holders at once on this node, and ``per_client`` per client.

    A request waits up to ``wait`` seconds in all for a place of its client's share and one on the
    node (a client that dropped an answer and asks again at once gets its place as soon as the node
    has seen the first one go); 0: refused at once when either is taken. Waiting takes no database
    connection, only the request's own coroutine.
    """

    total: int
    per_client: int
    refuse: Refuse
    wait: float = 0.0
    #: Requests waiting for a place now.
    waiting: int = 0
    _free: asyncio.Semaphore = field(init=False)
    _clients: dict[str, _Client] = field(init=False, default_factory=dict)
    _held: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._free = asyncio.Semaphore(self.total)

    @property
    def held(self) -> int:
        """Places held now on this node."""
        return self._held

    @contextlib.asynccontextmanager
    async def hold(self, request: web.Request) -> AsyncIterator[None]:
        """A place for the block, for the request's client, or the refusal."""
        client_address = request_client(request)
        key = str(client_address) if client_address is not None else "unknown"
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = _Client(asyncio.Semaphore(self.per_client))
        client.users += 1
        try:
            deadline = asyncio.get_running_loop().time() + self.wait
            await self._take(client.places, "client", deadline)
            try:
                await self._take(self._free, "node", deadline)
                self._held += 1
                try:
                    yield
                finally:
                    self._held -= 1
                    self._free.release()
            finally:
                client.places.release()
        finally:
            client.users -= 1
            if not client.users:
                del self._clients[key]

    async def _take(self, places: asyncio.Semaphore, cap: str, deadline: float) -> None:
        if self.wait <= 0:
            if places.locked():
                self.refuse(cap)
            await places.acquire()  # free: taken without waiting
            return
        self.waiting += 1
        try:
            async with asyncio.timeout_at(deadline):
                await places.acquire()
        except TimeoutError:
            self.refuse(cap)
        finally:
            self.waiting -= 1
