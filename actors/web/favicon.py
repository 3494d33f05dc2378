"""``GET /favicon.svg`` and ``GET /favicon.ico``: the node's icon, a slice of toast.

Every HTML page links ``/favicon.svg`` (``<link rel="icon">``, allowed by the pages' ``img-src
'self'``); ``/favicon.ico`` is the same picture as a 32×32 PNG inside an ICO, for the browsers and
tools that ask for that path without reading the page. Both are built once at import from the
drawing below (no binary file in the repository), so their bytes and ETags never change between
releases unless the drawing does.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from aiohttp import web

from infra.http import etag_matches

SVG_PATH = "/favicon.svg"
ICO_PATH = "/favicon.ico"

#: The crust and the crumb: a rectangle under half an ellipse each, in a 32×32 box.
_CRUST = (16.0, 13.0, 10.0, 7.0, 6.0, 26.0, 28.0)  # centre x, centre y, radius x, radius y, left, right, bottom
_CRUMB = (16.0, 14.0, 7.0, 5.0, 9.0, 23.0, 25.0)
_CRUST_RGBA = (0xB8, 0x73, 0x33, 0xFF)
_CRUMB_RGBA = (0xF3, 0xD0, 0x8A, 0xFF)

SVG = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
    b'<path d="M6 13A10 7 0 0 1 26 13V28H6Z" fill="#b87333"/>'
    b'<path d="M9 14A7 5 0 0 1 23 14V25H9Z" fill="#f3d08a"/>'
    b"</svg>")


def _inside(shape: tuple[float, ...], x: float, y: float) -> bool:
    cx, cy, rx, ry, left, right, bottom = shape
    if y >= cy:
        return left <= x <= right and y <= bottom
    return ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1.0


def _png(size: int = 32) -> bytes:
    """The drawing as an RGBA PNG, sampled at each pixel's centre."""
    rows = bytearray()
    for py in range(size):
        rows.append(0)  # filter type "none" for this scanline
        for px in range(size):
            x, y = (px + 0.5) * 32 / size, (py + 0.5) * 32 / size
            if _inside(_CRUMB, x, y):
                rows += bytes(_CRUMB_RGBA)
            elif _inside(_CRUST, x, y):
                rows += bytes(_CRUST_RGBA)
            else:
                rows += b"\0\0\0\0"

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0)  # 8 bits per channel, RGBA
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(rows), 9))
            + chunk(b"IEND", b""))


def _ico(png: bytes, size: int = 32) -> bytes:
    """One PNG image in an ICO container (allowed since Windows Vista; every browser reads it)."""
    directory = struct.pack("<HHH", 0, 1, 1)
    entry = struct.pack("<BBBBHHII", size, size, 0, 0, 1, 32, len(png), 6 + 16)
    return directory + entry + png


ICO = _ico(_png())


def _etag(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


_ICONS = {SVG_PATH: (SVG, "image/svg+xml", _etag(SVG)), ICO_PATH: (ICO, "image/x-icon", _etag(ICO))}


async def favicon(request: web.Request) -> web.Response:
    """The icon of this path; cacheable for a day, revalidated by ETag."""
    body, media, etag = _ICONS[request.path]
    headers = {"ETag": etag, "Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff",
               # An SVG opened on its own is a document: it may run nothing and load nothing.
               "Content-Security-Policy": "default-src 'none'"}
    if etag_matches(request.headers.get("If-None-Match"), etag):
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, headers=headers, content_type=media)


def add_routes(app: web.Application) -> None:
    """Both icon routes."""
    app.router.add_get(SVG_PATH, favicon)
    app.router.add_get(ICO_PATH, favicon)
