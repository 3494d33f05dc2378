"""What the web front's handlers can reach: the node they serve (typed app key)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from toastmachine.node import Node

NODE: web.AppKey[Node] = web.AppKey("node")
