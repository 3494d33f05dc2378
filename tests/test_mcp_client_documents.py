"""Client ID Metadata Documents against a real HTTPS server on loopback.

A local aiohttp server with a certificate from a test CA serves the documents; the MCP front is
configured to trust that CA and (test only) to fetch from loopback. The SDK's own OAuth client
uses a document URL as its client id end to end; the refusals talk to ``/authorize`` directly and
check that nothing was stored.
"""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from ipaddress import ip_address
from pathlib import Path

import httpx
import httpx2
import orjson
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from actors.mcp.client_documents import MAX_DOCUMENT_BYTES, DocumentFetcher, DocumentRefused
from infra.db.pool import Database
from tests.test_mcp_oauth import (
    REDIRECT,
    Front,
    _authorize,
    _consent,
    _free_port,
    _pkce,
    sdk_oauth_client,
    serve,
)


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate it signed for 127.0.0.1 and localhost: (ca, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ToastMachine test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@dataclass
class DocumentServer:
    """The HTTPS origin publishing client documents: ``url(name)`` is where document ``name`` lives."""

    origin: str
    ca_file: Path
    hits: dict[str, int] = field(default_factory=dict)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, name: str, host: str = "127.0.0.1") -> str:
        return self.origin.replace("127.0.0.1", host) + "/clients/" + name


def _document(url: str, **overrides: object) -> dict[str, object]:
    return {"client_id": url, "client_name": "Document app", "redirect_uris": [REDIRECT],
            "token_endpoint_auth_method": "none", **overrides}


@pytest.fixture
async def documents(tmp_path: Path) -> AsyncIterator[DocumentServer]:
    ca_file, cert, key = _certificates(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    port = _free_port()
    server = DocumentServer(origin=f"https://127.0.0.1:{port}", ca_file=ca_file)

    def json(body: object, **headers: str) -> web.Response:
        return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)

    # Each document is built from the URL it was fetched at, so it names itself on either host name.
    handlers: dict[str, Callable[[str], web.StreamResponse]] = {
        "good.json": lambda url: json(_document(url), **{"Cache-Control": "max-age=600"}),
        "no-store.json": lambda url: json(_document(url), **{"Cache-Control": "no-store"}),
        "other-name.json": lambda url: json(_document(url.replace("other-name", "good"))),
        "too-large.json": lambda url: json(_document(url, client_name="x" * 150,
                                                     contacts=["a" * 100] * (MAX_DOCUMENT_BYTES // 100))),
        "bad-redirect.json": lambda url: json(_document(url, redirect_uris=["http://app.example/callback"])),
        "with-secret.json": lambda url: json(_document(url, client_secret="s3cret",
                                                       token_endpoint_auth_method="client_secret_post")),
        "moved.json": lambda url: web.HTTPFound(url.replace("moved", "good")),
        "not-json.json": lambda url: web.Response(text="<html>hello</html>", content_type="text/html"),
    }

    async def handle(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        server.hits[name] = server.hits.get(name, 0) + 1
        url = f"https://{request.host}/clients/{name}"
        if name == "slow.json":
            await server.release.wait()  # never answers until the test ends
            return json(_document(url))
        if name == "too-large-chunked.json":  # no Content-Length: the cap must hold while reading
            stream = web.StreamResponse(headers={"Content-Type": "application/json"})
            stream.enable_chunked_encoding()
            await stream.prepare(request)
            for _ in range(4):
                await stream.write(b" " * 2048)
            await stream.write(orjson.dumps(_document(url)))
            await stream.write_eof()
            return stream
        made = handlers[name](url)
        if isinstance(made, web.HTTPException):
            raise made
        return made

    app = web.Application()
    app.router.add_get("/clients/{name}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, ssl_context=context)
    await site.start()
    try:
        yield server
    finally:
        server.release.set()
        await runner.cleanup()


@pytest.fixture
async def front(db: Database, documents: DocumentServer) -> AsyncIterator[Front]:
    async with serve(db, _free_port(), mcp_cimd_allow_private=True, mcp_cimd_ca_file=documents.ca_file) as f:  # type: ignore[arg-type]
        yield f


async def _stored(db: Database, client_id: str) -> int:
    return int(await db.pool.fetchval("select count(*) from oauth_clients where client_id = $1", client_id))


async def test_metadata_advertises_client_id_metadata_documents(front: Front) -> None:
    async with httpx.AsyncClient() as http:
        asm = (await http.get(front.base + "/.well-known/oauth-authorization-server")).json()
    assert asm["client_id_metadata_document_supported"] is True


async def test_sdk_client_uses_its_document_url_as_client_id(front: Front, documents: DocumentServer) -> None:
    url = documents.url("good.json")
    auth, storage = sdk_oauth_client(front.base + "/mcp", agent_name="cimd-agent", client_metadata_url=url)
    async with httpx2.AsyncClient(auth=auth, timeout=30) as http, \
            streamable_http_client(front.base + "/mcp", http_client=http) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        result = await session.call_tool("whoami", {})
    assert not result.is_error, result
    assert result.structured_content["agent"]["name"] == "cimd-agent"  # type: ignore[index]
    assert storage.client is not None and storage.client.client_id == url
    grant = await front.db.pool.fetchrow("select client_id from oauth_grants where client_id = $1", url)
    assert grant is not None
    # Authorize, consent (show and decide) and token all read the one fetched copy (max-age=600).
    assert documents.hits["good.json"] == 1


async def test_cache_lifetime_follows_cache_control_within_bounds(front: Front, documents: DocumentServer) -> None:
    _, challenge = _pkce()
    lifetimes = {}
    async with httpx.AsyncClient() as http:
        for name in ("good.json", "no-store.json"):
            url = documents.url(name)
            r = await _authorize(http, front.base, url, challenge)
            assert r.status_code == 302 and "/consent?request=" in r.headers["location"], r.text
            assert documents.hits[name] == 1  # one fetch for the whole request
            lifetimes[name] = await front.db.pool.fetchval(
                "select (metadata->'tm_document'->>'expires_at')::float8 - extract(epoch from now())"
                " from oauth_clients where client_id = $1", url)
    assert 590 < lifetimes["good.json"] <= 600  # max-age=600
    assert 0 < lifetimes["no-store.json"] <= 10  # no-store: only for the steps of one authorization


async def test_consent_page_names_the_documents_host(front: Front, documents: DocumentServer) -> None:
    url = documents.url("good.json", host="localhost")
    _, challenge = _pkce()
    async with httpx.AsyncClient() as http:
        r = await _authorize(http, front.base, url, challenge)
        assert r.status_code == 302, r.text
        page = await http.get(r.headers["location"])
    assert 'id="client-id-host">localhost<' in page.text
    assert "Document app" in page.text


@pytest.mark.parametrize(("name", "reason"), [
    ("other-name.json", "does not name its own URL"), ("too-large.json", "larger than 5 KiB"),
    ("too-large-chunked.json", "larger than 5 KiB"), ("bad-redirect.json", "redirect URIs must be https"),
    ("with-secret.json", "must not carry a client secret"), ("moved.json", "answered with a redirect"),
    ("not-json.json", "is not JSON"), ("missing.json", "answered with an error status")])
async def test_unacceptable_documents_are_refused_and_nothing_is_stored(
        front: Front, documents: DocumentServer, name: str, reason: str) -> None:
    """Refused at the authorization request, which says why (the app's developer reads it there,
    not in the node's log)."""
    url = documents.url(name)
    _, challenge = _pkce()
    async with httpx.AsyncClient() as http:
        r = await _authorize(http, front.base, url, challenge)
    assert r.status_code == 400 and r.json()["error"] == "invalid_request", r.text
    assert reason in r.json()["error_description"], r.text
    assert "consent" not in r.headers.get("location", "")
    assert await _stored(front.db, url) == 0
    if name == "moved.json":
        assert "good.json" not in documents.hits  # the redirect was not followed


async def test_bad_redirect_uri_is_refused_even_for_a_good_document(front: Front, documents: DocumentServer) -> None:
    url = documents.url("good.json")
    _, challenge = _pkce()
    async with httpx.AsyncClient() as http:
        for other in ("http://127.0.0.1:53682/callback/", "https://app.example/callback"):
            r = await _authorize(http, front.base, url, challenge, redirect_uri=other)
            assert r.status_code == 400 and r.json()["error"] == "invalid_request", r.text
        # The exact URI from the document is fine.
        ok = await _authorize(http, front.base, url, challenge)
        assert ok.status_code == 302 and "/consent?request=" in ok.headers["location"]


async def test_fetch_times_out(documents: DocumentServer) -> None:
    fetcher = DocumentFetcher(allow_private=True, ca_file=documents.ca_file, timeout=0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DocumentRefused, match="timed out"):
        await fetcher.fetch(documents.url("slow.json"))
    assert loop.time() - started < 5
    assert documents.hits["slow.json"] == 1


async def test_private_and_loopback_addresses_are_refused_unless_allowed(db: Database,
                                                                          documents: DocumentServer) -> None:
    strict = DocumentFetcher(ca_file=documents.ca_file)
    for url in (documents.url("good.json"), documents.url("good.json", host="localhost"),
                "https://10.0.0.1/clients/good.json", "https://[::1]/clients/good.json",
                "https://169.254.169.254/latest/meta-data"):
        with pytest.raises(DocumentRefused, match="non-public"):
            await strict.fetch(url)
    assert documents.hits == {}
    # And through the front configured without the test setting: unknown client, nothing stored.
    url = documents.url("good.json")
    async with serve(db, _free_port(), mcp_cimd_ca_file=documents.ca_file) as strict_front:  # type: ignore[arg-type]
        _, challenge = _pkce()
        async with httpx.AsyncClient() as http:
            r = await _authorize(http, strict_front.base, url, challenge)
    assert r.status_code == 400 and documents.hits == {}
    assert await _stored(db, url) == 0


async def test_untrusted_certificate_is_refused(documents: DocumentServer) -> None:
    # Without the test CA the server's certificate does not verify: no fetch succeeds.
    with pytest.raises(DocumentRefused, match="could not be fetched"):
        await DocumentFetcher(allow_private=True).fetch(documents.url("good.json"))


async def test_url_rules(documents: DocumentServer) -> None:
    fetcher = DocumentFetcher(allow_private=True, ca_file=documents.ca_file)
    for url in ("http://127.0.0.1/clients/good.json", "https://127.0.0.1/", "https://u:p@example.org/c.json",
                "https://example.org/c.json#x", "https://example.org/a/../c.json",
                "https://example.org/" + "c" * 200):
        with pytest.raises(DocumentRefused):
            await fetcher.fetch(url)
    assert documents.hits == {}


async def test_a_stale_copy_is_fetched_again(front: Front, documents: DocumentServer) -> None:
    url = documents.url("good.json")
    _, challenge = _pkce()
    async with httpx.AsyncClient() as http:
        assert (await _authorize(http, front.base, url, challenge)).status_code == 302
        await front.db.pool.execute(
            "update oauth_clients set metadata = jsonb_set(metadata, '{tm_document,expires_at}', '0')"
            " where client_id = $1", url)
        documents.hits.clear()
        assert (await _authorize(http, front.base, url, challenge)).status_code == 302
        assert documents.hits["good.json"] == 1  # fetched again once stale


async def test_cleanup_drops_long_stale_document_copies_without_grants(front: Front, documents: DocumentServer,
                                                                      ) -> None:
    from actors.mcp.cleanup import delete_expired

    unused, granted = documents.url("good.json"), documents.url("good.json", host="localhost")
    _, challenge = _pkce()
    async with httpx.AsyncClient() as http:
        assert (await _authorize(http, front.base, unused, challenge)).status_code == 302
        r = await _authorize(http, front.base, granted, challenge)
        assert (await _consent(http, r.headers["location"])).status_code == 303
    stale = "jsonb_set(metadata, '{tm_document,expires_at}', to_jsonb(extract(epoch from now()) - $2))"
    await front.db.pool.execute(f"update oauth_clients set metadata = {stale} where client_id = any($1)",
                                [unused, granted], 2 * 86400.0)
    await delete_expired(front.db)
    assert await _stored(front.db, unused) == 0
    assert await _stored(front.db, granted) == 1  # a grant refers to it


async def test_two_mcp_nodes_share_one_fetched_copy(front: Front, documents: DocumentServer) -> None:
    url = documents.url("good.json")
    _, challenge = _pkce()
    async with serve(front.db, _free_port(), mcp_cimd_allow_private=True,  # type: ignore[arg-type]
                     mcp_cimd_ca_file=documents.ca_file) as second, httpx.AsyncClient() as http:
        r = await _authorize(http, front.base, url, challenge)
        assert r.status_code == 302, r.text
        # The consent page on the other node: the pending request and the client are in PostgreSQL.
        consent = r.headers["location"].replace(front.base, second.base)
        back = await _consent(http, consent)
        assert back.status_code == 303, back.text
        assert (await _authorize(http, second.base, url, challenge)).status_code == 302
    assert documents.hits["good.json"] == 1


async def test_a_cached_document_with_a_field_removed_is_refused(front: Front, documents: DocumentServer) -> None:
    url = documents.url("good.json")
    _, challenge = _pkce()
    async with httpx.AsyncClient() as http:
        assert (await _authorize(http, front.base, url, challenge)).status_code == 302
        await front.db.pool.execute("update oauth_clients set metadata = metadata - 'redirect_uris'"
                                    " where client_id = $1", url)
        r = await _authorize(http, front.base, url, challenge)
    assert r.status_code == 400, r.text  # fail closed: never read as valid, never silently refetched
    assert documents.hits["good.json"] == 1


async def test_only_an_authorization_request_fetches_a_new_document(front: Front,
                                                                    documents: DocumentServer) -> None:
    url = documents.url("good.json")
    async with httpx.AsyncClient() as http:
        r = await http.post(front.base + "/token", data={"grant_type": "authorization_code", "code": "tmc_x",
                                                         "redirect_uri": REDIRECT, "client_id": url,
                                                         "code_verifier": "v" * 43})
        assert r.status_code == 401 and r.json()["error"] == "invalid_client", r.text
        r = await http.post(front.base + "/revoke", data={"token": "tma_x", "client_id": url})
        assert r.status_code == 401, r.text
        assert documents.hits == {}  # unauthenticated endpoints make the node fetch nothing new
        _, challenge = _pkce()
        assert (await _authorize(http, front.base, url, challenge)).status_code == 302
    assert documents.hits == {"good.json": 1}
