"""The public archive on the web front (SPEC §5): ``GET /corpus/archive`` and its segments,
checkpoints and inclusion proofs.

The status comes from the archiver's bookkeeping in the database (``actors.reads.archive``); segment
bytes and the public key come from the archive's object store, the one ``TOASTMACHINE_ARCHIVE_URL``
names (every web node needs read access to it). Only verified segments of the public stream are
served, and only after their bytes hash to what the archiver verified: a tampered object is never
handed out as the archive's. The private stream has no route at all.
"""

from __future__ import annotations

import hashlib
import uuid

from aiohttp import web

from actors.reads import archive as reads
from actors.web.context import NODE
from actors.web.export import identity_headers, node_identity
from actors.web.render import BROWSABLE_TYPES, Document, choose, respond
from infra.archive_store import ArchiveStore, ArchiveStoreError, ObjectNotFound
from infra.http import etag_matches, json_response
from infra.logs import get_logger
from protocol.archive import MANIFEST_PAGES_DIR, manifest_key, manifest_page_name
from protocol.errors import NotFound, ServiceUnavailable
from protocol.manifest import MAX_MANIFEST_BYTES, ManifestError, parse_manifest
from protocol.query import Query, invalid

#: Segments and checkpoints never change once published.
IMMUTABLE = "public, max-age=31536000, immutable"
#: Holds the store once it exists (a directory store appears with the archiver's first object).
ARCHIVE_STORE: web.AppKey[dict[str, ArchiveStore]] = web.AppKey("archive_store", dict)

log = get_logger("toastmachine.web.archive")

_SIZE_HELP = "Send size as the tree size of a published checkpoint (GET /corpus/archive lists the latest)."


def archive_store(app: web.Application) -> ArchiveStore | None:
    """The archive's store, or None while a directory store does not exist yet."""
    holder = app[ARCHIVE_STORE]
    store = holder.get("store")
    if store is None:
        settings = app[NODE].settings
        directory = ArchiveStore.local_directory(settings.archive_url, settings.data_dir)
        if directory is not None and not directory.is_dir():
            return None  # not created here: a web node must not make an empty archive appear
        store = holder["store"] = ArchiveStore.from_settings(settings)
    return store


#: Seconds a client is told to wait (Retry-After) while the archive's store does not answer.
STORE_RETRY_AFTER = 5


def _unavailable() -> ServiceUnavailable:
    return ServiceUnavailable("The archive's object store is unavailable.", code="archive_store_unavailable",
                              headers={"Retry-After": str(STORE_RETRY_AFTER)},
                              how_to_proceed="Retry after the seconds in Retry-After; the change history "
                                             "(GET /corpus/changes.jsonl) is served from the database meanwhile.")


async def archive_info(request: web.Request) -> web.Response:
    """``GET /corpus/archive``: segments, the latest signed checkpoint, the public key, watermarks."""
    media = choose(request, BROWSABLE_TYPES)
    corpus_id, lineage = node_identity(request)
    Query(request.query, ())
    try:
        body = await reads.archive_status(request.app[NODE].db.pool, archive_store(request.app), lineage)
    except ArchiveStoreError:
        raise _unavailable() from None
    identity = identity_headers(corpus_id, lineage)
    return respond(request, Document("archive", body, "Archive", headers=identity,
                                     cache_control=identity["Cache-Control"]), media)


async def segment(request: web.Request) -> web.Response:
    """``GET /corpus/archive/segments/{name}``: a verified public segment's bytes (ETag = its hash)."""
    _corpus_id, lineage = node_identity(request)
    Query(request.query, ())
    name = request.match_info["name"]
    found = await reads.find_segment(request.app[NODE].db.pool, lineage, name)
    store = archive_store(request.app)
    if found is None or store is None:
        raise NotFound("No verified archive segment has this name.",
                       how_to_proceed="Take segment names from GET /corpus/archive or the manifest.")
    etag = f'"{found.hash.hex()}"'
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE}
    if etag_matches(request.headers.get("If-None-Match"), etag):
        return web.Response(status=304, headers=headers)
    try:
        data = await store.get(found.key)
    except (ObjectNotFound, ArchiveStoreError):
        raise _unavailable() from None
    if len(data) != found.size or hashlib.sha256(data[:-32]).digest() != found.hash or data[-32:] != found.hash:
        log.error("archive.segment_tampered", key=found.key,
                  detail="the stored object is not the segment the archiver verified; not served")
        raise _unavailable()
    return web.Response(body=data, headers=headers, content_type="application/octet-stream")


async def manifest(request: web.Request) -> web.Response:
    """``GET /corpus/archive/manifest.json``: the published manifest, as the store holds it.

    It lists every published segment (the status lists only the most recent ones), so a mirror or
    a third party can walk a history of any length through the node's routes alone. It is served
    as stored, not re-derived: whoever reads it checks it against the signed checkpoint of its tree
    size anyway. ``ETag`` is its SHA-256; it changes as segments are published.
    """
    data = await _stored_manifest(request)
    if data is None:
        raise _no_manifest()
    etag = f'"{hashlib.sha256(data).hexdigest()}"'
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if etag_matches(request.headers.get("If-None-Match"), etag):
        return web.Response(status=304, headers=headers)
    return web.Response(body=data, headers=headers, content_type="application/json")


async def manifest_page(request: web.Request) -> web.Response:
    """``GET /corpus/archive/manifest-pages/{name}``: a page the published manifest names, as the
    store holds it, served only when its bytes hash to the manifest's entry (``ETag`` = that
    hash; a page never changes once written)."""
    data = await _stored_manifest(request)
    if data is None:
        raise _no_page()
    try:
        document = parse_manifest(data)
    except ManifestError:
        raise _unavailable() from None
    name = request.match_info["name"]
    entry = next((p for p in document.pages if manifest_page_name(p.first_index, p.last_index) == name), None)
    if entry is None:
        raise _no_page()
    etag = f'"{entry.hash}"'
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE}
    if etag_matches(request.headers.get("If-None-Match"), etag):
        return web.Response(status=304, headers=headers)
    store = archive_store(request.app)
    assert store is not None  # the manifest was just read from it
    try:
        data = await store.get(entry.key(document.lineage), max_bytes=MAX_MANIFEST_BYTES)
    except (ObjectNotFound, ArchiveStoreError):
        raise _unavailable() from None
    if hashlib.sha256(data).hexdigest() != entry.hash:
        log.error("archive.manifest_page_tampered", name=name,
                  detail="the stored object is not the page the manifest names; not served")
        raise _unavailable()
    return web.Response(body=data, headers=headers, content_type="application/json")


async def _stored_manifest(request: web.Request) -> bytes | None:
    """The published ``manifest.json`` as the store holds it (the query checked: it takes no
    parameter), None when none is published yet; 503 while the store does not answer."""
    _corpus_id, lineage = node_identity(request)
    Query(request.query, ())
    store = archive_store(request.app)
    if store is None:
        return None
    try:
        return await store.get(manifest_key(uuid.UUID(lineage)), max_bytes=MAX_MANIFEST_BYTES)
    except ObjectNotFound:
        return None
    except ArchiveStoreError:
        raise _unavailable() from None


def _no_page() -> NotFound:
    return NotFound("The published manifest names no page of this name.",
                    how_to_proceed="Take page names from the pages of GET /corpus/archive/manifest.json.")


def _no_manifest() -> NotFound:
    return NotFound("No archive manifest is published yet.",
                    how_to_proceed="Retry once GET /corpus/archive shows a checkpoint.")


async def checkpoint(request: web.Request) -> web.Response:
    """``GET /corpus/archive/checkpoints/{size}``: the signed checkpoint of that tree size."""
    node_identity(request)
    Query(request.query, ())
    raw = request.match_info["size"]
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19:
        raise invalid("size", "'size' must be a tree size (a positive decimal integer).", _SIZE_HELP)
    note = await reads.checkpoint_note(request.app[NODE].db.pool, int(raw))
    if note is None:
        raise NotFound("No published checkpoint has this tree size.", how_to_proceed=_SIZE_HELP)
    return web.Response(text=note, headers={"Cache-Control": IMMUTABLE}, content_type="text/plain")


async def proof(request: web.Request) -> web.Response:
    """``GET /corpus/archive/proof?sequence=N&size=M``: the inclusion proof of change N in the tree of
    size M (a published checkpoint's; the latest when M is absent)."""
    corpus_id, lineage = node_identity(request)
    q = Query(request.query, ("sequence", "size"))
    sequence = q.integer("sequence", low=1, how_to_proceed="Send sequence as the sequence of an archived change.")
    size = q.integer("size", low=1, how_to_proceed=_SIZE_HELP)
    if sequence is None:
        raise invalid("sequence", "'sequence' is required.", "Send sequence as the sequence of an archived change.")
    try:
        found = await reads.inclusion_proof(request.app[NODE].db.pool, sequence, size)
    except reads.ProofUnavailable as e:
        raise NotFound(f"No inclusion proof: {e}.", extra={"field": e.field},
                       how_to_proceed="Ask for a sequence at or below GET /corpus/archive's published_through, "
                                      "and a size from its checkpoints.") from None
    return json_response(found.to_json(), headers=identity_headers(corpus_id, lineage))


def add_routes(app: web.Application) -> None:
    """The public archive routes."""
    app[ARCHIVE_STORE] = {}
    app.router.add_get(reads.ARCHIVE_PATH, archive_info)
    app.router.add_get(reads.MANIFEST_PATH, manifest)
    app.router.add_get(reads.ARCHIVE_PATH + f"/{MANIFEST_PAGES_DIR}/{{name}}", manifest_page)
    app.router.add_get(reads.SEGMENTS_PATH + "/{name}", segment)
    app.router.add_get(reads.CHECKPOINTS_PATH + "/{size}", checkpoint)
    app.router.add_get(reads.PROOF_PATH, proof)
