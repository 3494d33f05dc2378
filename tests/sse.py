"""A small Server-Sent-Events client for tests: reads frames off a real HTTP response."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass(slots=True)
class Frame:
    """One SSE frame: event name (``message`` when absent), id, data, and comment lines."""

    event: str = "message"
    id: str | None = None
    data: str = ""
    comments: list[str] = field(default_factory=list)

    def json(self) -> dict:
        return orjson.loads(self.data)  # type: ignore[no-any-return]


async def frames(response: aiohttp.ClientResponse):  # type: ignore[no-untyped-def]
    """Yield frames as they arrive until the server ends the stream."""
    frame = Frame()
    data: list[str] = []
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if line == "":
            if data or frame.id is not None or frame.event != "message" or frame.comments:
                frame.data = "\n".join(data)
                yield frame
            frame, data = Frame(), []
            continue
        if line.startswith(":"):
            frame.comments.append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            frame.event = value
        elif name == "id":
            frame.id = value
        elif name == "retry":
            frame.comments.append(f"retry {value}")
