"""Client ID Metadata Documents: an OAuth client whose ``client_id`` is an https URL.

An MCP client may skip registration and use, as its ``client_id``, the URL of a JSON document it
publishes (its RFC 7591 metadata). The authorization server fetches that document and uses it as
the client's registration. The document is attacker-chosen input fetched from an attacker-chosen
URL, so :class:`DocumentFetcher` is deliberately narrow:

- the URL is https, has a path, no credentials, no fragment, at most 200 characters (the
  ``oauth_clients.client_id`` limit);
- every address the host resolves to must be public: loopback, private, link-local, shared,
  multicast and reserved ranges are refused, and the connection goes to the address that was
  checked (the resolver below *is* the connector's resolver, so a second DNS answer cannot slip in
  a private address). ``TOASTMACHINE_MCP_CIMD_ALLOW_PRIVATE`` lifts this for tests only;
- no redirects are followed, the whole exchange has a timeout, the body is capped at
  :data:`MAX_DOCUMENT_BYTES`, and at most :data:`MAX_CONCURRENT_FETCHES` run at once per process;
- the document must be a JSON object naming itself (``client_id`` equal to the URL), a public
  client (``token_endpoint_auth_method`` ``none``, no secret) with 1-10 redirect URIs that pass the
  same policy as dynamic registration (https, or http on loopback).

The caller (:meth:`actors.mcp.oauth.OAuthStore.get_client`) keeps the accepted document in
``oauth_clients`` with its expiry (:func:`cache_seconds`), so every MCP node shares one copy and
the origin is asked again only once it expired.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from infra.http_client import read_capped
from infra.logs import get_logger

log = get_logger("toastmachine.mcp.client_documents")

#: Largest document accepted (the CIMD draft recommends servers cap it at 5 kB).
MAX_DOCUMENT_BYTES = 5 * 1024
#: Seconds for the whole fetch: connect, TLS, headers and body.
FETCH_SECONDS = 5.0
#: Fetches one process runs at once; more wait (within the timeout) for a slot.
MAX_CONCURRENT_FETCHES = 8
#: Longest URL accepted as a client id (the column's limit).
MAX_URL_CHARS = 200
#: How long a document that says ``no-store`` or ``no-cache`` is kept: just long enough for the
#: steps of one authorization (authorize, consent, token) not to fetch it again each.
NO_STORE_SECONDS = 10
#: Cache bounds: any other document is kept at least this long...
MIN_CACHE_SECONDS = 60
#: ...and at most this long, whatever its ``Cache-Control`` says.
MAX_CACHE_SECONDS = 24 * 3600
#: How long a document without a usable ``max-age`` is kept.
DEFAULT_CACHE_SECONDS = 300


class DocumentRefused(Exception):
    """The client ID URL or its document is not acceptable; ``reason`` is fixed text, safe to log."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def is_document_client_id(client_id: str) -> bool:
    """True when ``client_id`` is meant as a metadata document URL (it starts with ``https://``)."""
    return client_id.startswith("https://")


def check_document_url(url: str) -> None:
    """Raise :class:`DocumentRefused` unless ``url`` may be fetched as a client ID document."""
    if len(url) > MAX_URL_CHARS:
        raise DocumentRefused("client_id URL is longer than 200 characters")
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise DocumentRefused("client_id URL must be https with a host")
    if parts.path in ("", "/"):
        raise DocumentRefused("client_id URL must have a path")
    if parts.username is not None or parts.password is not None or parts.fragment or "#" in url:
        raise DocumentRefused("client_id URL must not carry credentials or a fragment")
    if any(segment in (".", "..") for segment in parts.path.split("/")):
        raise DocumentRefused("client_id URL must not have dot segments")
    try:
        parts.port  # noqa: B018 - raises for a malformed port
    except ValueError:
        raise DocumentRefused("client_id URL has a malformed port") from None


def is_public_address(address: IPv4Address | IPv6Address) -> bool:
    """True for a globally routable unicast address (what a document may be fetched from)."""
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


class _CheckedResolver(AbstractResolver):
    """Resolves like aiohttp's default, then refuses the lot if any address is not public.

    The connector connects to exactly the addresses returned here, so the check and the connection
    cannot see two different DNS answers.
    """

    def __init__(self, allow_private: bool) -> None:
        self._inner = DefaultResolver()
        self._allow_private = allow_private

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if not self._allow_private:
            for result in results:
                if not is_public_address(ip_address(result["host"].split("%")[0])):
                    raise DocumentRefused("client_id host resolves to a non-public address")
        return results

    async def close(self) -> None:
        await self._inner.close()


def cache_seconds(cache_control: str | None) -> int:
    """How long to keep a document served with ``cache_control`` (bounded; see the constants)."""
    if not cache_control:
        return DEFAULT_CACHE_SECONDS
    directives = [d.strip().lower() for d in cache_control.split(",")]
    if "no-store" in directives or "no-cache" in directives:
        return NO_STORE_SECONDS
    for directive in directives:
        name, _, value = directive.partition("=")
        if name.strip() == "max-age":
            try:
                age = int(value.strip().strip('"'))
            except ValueError:
                return DEFAULT_CACHE_SECONDS
            return max(MIN_CACHE_SECONDS, min(MAX_CACHE_SECONDS, age))
    return DEFAULT_CACHE_SECONDS


@dataclass(frozen=True, slots=True)
class FetchedDocument:
    """A document that named itself, as a JSON object, and how long it may be kept."""

    metadata: dict[str, Any]
    max_age: int


class DocumentFetcher:
    """Fetches client ID metadata documents under the rules of the module doc.

    ``allow_private`` (``TOASTMACHINE_MCP_CIMD_ALLOW_PRIVATE``) lets a test serve documents from
    loopback; ``ca_file`` (``TOASTMACHINE_MCP_CIMD_CA_FILE``) adds trusted certificate authorities
    (a test's own, or an organisation's private PKI) to the system ones.
    """

    def __init__(self, *, allow_private: bool = False, ca_file: Path | None = None,
                 timeout: float = FETCH_SECONDS) -> None:
        self.allow_private = allow_private
        self.timeout = timeout
        self._ssl = ssl.create_default_context()
        if ca_file is not None:
            self._ssl.load_verify_locations(cafile=str(ca_file))
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_FETCHES)

    async def fetch(self, url: str) -> FetchedDocument:
        """The document at ``url`` if it is acceptable; :class:`DocumentRefused` otherwise."""
        check_document_url(url)
        host = urlsplit(url).hostname or ""
        try:
            literal: IPv4Address | IPv6Address | None = ip_address(host.strip("[]"))
        except ValueError:
            literal = None
        # aiohttp does not consult the resolver for an address literal: check it here.
        if literal is not None and not self.allow_private and not is_public_address(literal):
            raise DocumentRefused("client_id host is a non-public address")
        try:
            async with asyncio.timeout(self.timeout):
                async with self._slots:
                    body, cache_control = await self._get(url)
        except TimeoutError:
            raise DocumentRefused("client_id document fetch timed out") from None
        except DocumentRefused:
            raise
        except (aiohttp.ClientError, OSError, ssl.SSLError):
            raise DocumentRefused("client_id document could not be fetched") from None
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise DocumentRefused("client_id document is not JSON") from None
        if not isinstance(document, dict):
            raise DocumentRefused("client_id document is not a JSON object")
        if document.get("client_id") != url:
            raise DocumentRefused("client_id document does not name its own URL as client_id")
        return FetchedDocument(metadata=document, max_age=cache_seconds(cache_control))

    async def _get(self, url: str) -> tuple[bytes, str | None]:
        connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self.allow_private), ssl=self._ssl,
                                         force_close=True, limit=1)
        # trust_env off: no proxy from the environment may carry the request somewhere unchecked.
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session, session.get(
                url, allow_redirects=False, headers={"Accept": "application/json"},
                max_line_size=8190, max_field_size=8190) as response:
            if 300 <= response.status < 400:
                raise DocumentRefused("client_id document answered with a redirect")
            if response.status != 200:
                raise DocumentRefused("client_id document answered with an error status")
            body = await read_capped(response, MAX_DOCUMENT_BYTES)
            if body is None:
                raise DocumentRefused("client_id document is larger than 5 KiB")
            return body, response.headers.get("Cache-Control")
