"""The public archive on the web front: status (JSON and HTML), segment bytes with immutable caching
and the hash as ETag, checkpoints, inclusion proofs that verify against the signed checkpoint, the
boundaries in GET /corpus and /readyz, and nothing of the private stream ever served."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import obstore
import pytest

from actors.archiver import SealPolicy
from actors.reads.archive import inclusion_proof
from actors.recovery.walk import StoreSource, read_manifest
from actors.web.archive import ARCHIVE_STORE
from protocol.archive import Stream, change_body, decode_segment, manifest_page_name
from protocol.checkpoint import SignerKey, parse_verifier_key, verify_checkpoint
from protocol.manifest import decode_manifest, parse_manifest
from protocol.merkle import inclusion_proof as merkle_inclusion_proof
from protocol.merkle import leaf_hash, tree_root, verify_inclusion
from tests.archive_fixtures import raw_store
from tests.corpus_fixtures import Stack
from tests.test_archiver import archiving, local, published, segments, signer_for, until, write_messages


async def archived(stack: Stack, tmp_path: Path, messages: int = 5, signer: SignerKey | None = None) -> list[int]:
    """Write ``messages`` changes and archive them in segments of 2 (the odd last one stays out)."""
    store = local(tmp_path)
    stack.client.app[ARCHIVE_STORE]["store"] = store  # the web node reads the archiver's store
    sequences = await write_messages(stack, messages)
    async with archiving(stack, store, SealPolicy(events=2, seconds=3600), signer=signer or signer_for(stack)):
        await published(stack, messages // 2)
    return sequences


async def test_archive_status_lists_segments_checkpoint_key_and_boundaries(stack: Stack, tmp_path: Path) -> None:
    sequences = await archived(stack, tmp_path)
    resp = await stack.client.get("/corpus/archive")
    assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
    body = await resp.json()
    assert [(s["index"], s["first_sequence"], s["last_sequence"], s["state"]) for s in body["segments"]] == [
        (0, sequences[0], sequences[1], "published"), (1, sequences[2], sequences[3], "published")]
    assert body["archived_through"] == body["verified_through"] == sequences[3]
    assert body["lag_events"] == 1 and body["tree_size"] == 4
    checkpoint = verify_checkpoint(body["checkpoint"], parse_verifier_key(body["public_key"]))
    assert checkpoint.size == 4
    html = await stack.client.get("/corpus/archive", headers={"Accept": "text/html"})
    page = await html.text()
    assert html.status == 200 and body["segments"][0]["name"] in page and "Latest checkpoint" in page
    md = await stack.client.get("/corpus/archive", headers={"Accept": "text/markdown"})
    assert md.status == 200 and body["segments"][1]["hash"] in await md.text()

    corpus = await (await stack.client.get("/corpus")).json()
    assert corpus["archive"] == {"archived_through": sequences[3], "verified_through": sequences[3]}
    assert corpus["links"]["archive"] == "/corpus/archive"
    ready = await (await stack.client.get("/readyz")).json()
    assert ready["checks"]["archive"]["verified_through"] == sequences[3]
    # And as gauges on the web node's /metrics, from the database (this node runs no archiver: in
    # a Procfile deployment the archiver process serves no HTTP).
    scraped = {line.split()[0]: float(line.split()[1]) for line in (await (await stack.client.get("/metrics")).text())
               .splitlines() if line.startswith("toastmachine_corpus_archive_")}
    assert scraped == {"toastmachine_corpus_archive_verified_through": sequences[3],
                       "toastmachine_corpus_archive_lag_events": 1.0, "toastmachine_corpus_archive_store_up": 1.0}


async def test_segments_are_served_immutable_with_their_hash_as_etag(stack: Stack, tmp_path: Path) -> None:
    await archived(stack, tmp_path)
    status = await (await stack.client.get("/corpus/archive")).json()
    seg = status["segments"][1]
    resp = await stack.client.get(f"/corpus/archive/segments/{seg['name']}")
    data = await resp.read()
    assert resp.status == 200 and resp.headers["Content-Type"] == "application/octet-stream"
    assert resp.headers["ETag"] == f'"{seg["hash"]}"' and "immutable" in resp.headers["Cache-Control"]
    assert hashlib.sha256(data[:-32]).hexdigest() == seg["hash"]
    assert decode_segment(data).index == 1
    again = await stack.client.get(f"/corpus/archive/segments/{seg['name']}",
                                   headers={"If-None-Match": resp.headers["ETag"]})
    assert again.status == 304
    note = await stack.client.get(f"/corpus/archive/checkpoints/{status['tree_size']}")
    assert note.status == 200 and await note.text() == status["checkpoint"]


async def test_a_tampered_segment_is_not_served(stack: Stack, tmp_path: Path) -> None:
    await archived(stack, tmp_path)
    status = await (await stack.client.get("/corpus/archive")).json()
    seg = status["segments"][0]
    path = tmp_path / "archive" / status["lineage"] / "segments" / seg["name"]
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x01
    path.write_bytes(bytes(raw))
    resp = await stack.client.get(f"/corpus/archive/segments/{seg['name']}")
    assert resp.status == 503 and (await resp.json())["error"]["code"]


async def test_inclusion_proofs_verify_against_the_signed_root(stack: Stack, tmp_path: Path) -> None:
    # Two catch-ups, so that two checkpoints exist (4 and 8): a batch publishes one checkpoint.
    signer = signer_for(stack)
    sequences = await archived(stack, tmp_path, messages=5, signer=signer)
    sequences += await write_messages(stack, 4)
    async with archiving(stack, local(tmp_path), SealPolicy(events=2, seconds=3600), signer=signer):
        await published(stack, 4)
    status = await (await stack.client.get("/corpus/archive")).json()
    checkpoint = verify_checkpoint(status["checkpoint"], parse_verifier_key(status["public_key"]))
    for position, sequence in enumerate(sequences[:8]):
        for size in (None, 4) if position < 4 else (None,):
            query = f"?sequence={sequence}" + (f"&size={size}" if size else "")
            resp = await stack.client.get(f"/corpus/archive/proof{query}")
            body = await resp.json()
            assert resp.status == 200, body
            assert body["leaf_index"] == position
            note = body["checkpoint"]
            root = base64.b64decode(note.split("\n")[2])
            assert verify_inclusion(bytes.fromhex(body["leaf_hash"]), position, body["tree_size"],
                                    [bytes.fromhex(p) for p in body["proof"]], root)
            if size is None:
                assert root == checkpoint.root


async def test_proofs_from_cached_chunks_equal_the_full_trees_path(stack: Stack, tmp_path: Path) -> None:
    """Every leaf of every published tree, with chunks of 4 leaves cached: the path equals the one
    computed from all the leaves, and the cache is what the proof reads (a corrupted root shows)."""
    store = local(tmp_path)
    sequences = await write_messages(stack, 23)
    async with archiving(stack, store, SealPolicy(events=5, seconds=3600), signer=signer_for(stack)):
        await published(stack, 4)
    rows = await stack.db.pool.fetch("select event from changes order by sequence")
    leaves = [leaf_hash(change_body(r["event"])) for r in rows]
    sizes = [r["tree_size"] for r in await stack.db.pool.fetch(
        "select tree_size from archive_checkpoints where stream = 0 order by tree_size")]
    assert sizes and sizes[-1] == 20
    for size in sizes:
        for position in range(size):
            proof = await inclusion_proof(stack.db.pool, sequences[position], size, chunk_height=2)
            assert (proof.leaf_index, proof.tree_size, proof.leaf_hash) == (position, size, leaves[position])
            assert proof.path == merkle_inclusion_proof(leaves[:size], position), (size, position)
            assert verify_inclusion(proof.leaf_hash, position, size, proof.path, tree_root(leaves[:size]))
    cached = await stack.db.pool.fetch("select chunk, root from archive_proof_chunks where height = 2 order by chunk")
    assert [r["chunk"] for r in cached] == list(range(5))
    assert [bytes(r["root"]) for r in cached] == [tree_root(leaves[i * 4:i * 4 + 4]) for i in range(5)]
    # Leaf 0's path in the tree of 20 holds chunk 1's root as it is: corrupt it and the path changes.
    await stack.db.pool.execute("update archive_proof_chunks set root = $1 where height = 2 and chunk = 1",
                                bytes(32))
    corrupted = await inclusion_proof(stack.db.pool, sequences[0], 20, chunk_height=2)
    assert bytes(32) in corrupted.path
    assert not verify_inclusion(corrupted.leaf_hash, 0, 20, corrupted.path, tree_root(leaves[:20]))


async def test_proof_leaves_follow_each_segments_format_version(stack: Stack, tmp_path: Path) -> None:
    """A lineage begun under format version 1 keeps its version-1 leaves (the canonical re-encoding):
    the proof of a change in such a segment hashes it by that rule, the others verbatim."""
    sequences = await archived(stack, tmp_path, messages=5)
    await stack.db.pool.execute("update archive_segments set format_version = 1 where stream = 0 and segment_index = 0")
    rows = await stack.db.pool.fetch("select sequence, event from changes order by sequence limit 4")
    for position, row in enumerate(rows):
        proof = await inclusion_proof(stack.db.pool, sequences[position], 4, chunk_height=1)
        version = 1 if position < 2 else 2
        assert proof.leaf_hash == leaf_hash(change_body(row["event"], version))
    assert change_body(rows[0]["event"], 1) != change_body(rows[0]["event"], 2)


async def test_the_manifest_route_serves_the_published_manifest(stack: Stack, tmp_path: Path) -> None:
    store = local(tmp_path)
    stack.client.app[ARCHIVE_STORE]["store"] = store
    resp = await stack.client.get("/corpus/archive/manifest.json")
    assert resp.status == 404 and (await resp.json())["error"]["code"]
    await write_messages(stack, 5)
    async with archiving(stack, store, SealPolicy(events=2, seconds=3600), signer=signer_for(stack)):
        await published(stack, 2)
    resp = await stack.client.get("/corpus/archive/manifest.json")
    assert resp.status == 200 and resp.content_type == "application/json"
    body = await resp.read()
    assert body == await store.get(f"{stack.identity.lineage}/manifest.json")
    manifest = decode_manifest(body)
    assert [s.index for s in manifest.segments] == [0, 1]
    assert resp.headers["ETag"] == f'"{hashlib.sha256(body).hexdigest()}"'
    bad = await stack.client.get("/corpus/archive/manifest.json?full=1")
    assert bad.status == 400 and (await bad.json())["error"]["code"]


async def test_the_manifest_is_paged_and_its_pages_are_served_as_written(stack: Stack, tmp_path: Path) -> None:
    """Full runs of ``manifest_page`` segments go to write-once pages that manifest.json names (it
    lists only the segments after the last page, so it stays small); a later activation finds its
    pages identical; each page is served with its hash as ETag, only while it hashes to its entry."""
    store = local(tmp_path)
    stack.client.app[ARCHIVE_STORE]["store"] = store
    await write_messages(stack, 10)
    signer = signer_for(stack)
    async with archiving(stack, store, SealPolicy(events=2, seconds=3600), signer=signer,
                         manifest_page=2) as first:
        await published(stack, 5)
    lineage = stack.identity.lineage
    document = parse_manifest(await store.get(f"{lineage}/manifest.json"))
    assert [(p.first_index, p.last_index) for p in document.pages] == [(0, 1), (2, 3)]
    assert [s.index for s in document.tail] == [4]
    assert first.puts.get("created", 0) >= 2
    # A new activation builds its pages from the database and finds the stored ones identical.
    await write_messages(stack, 4)
    async with archiving(stack, store, SealPolicy(events=2, seconds=3600), signer=signer,
                         manifest_page=2, node_id="arch-b") as second:
        await published(stack, 7)
    assert second.puts.get("already_present", 0) >= 2, second.puts
    document = parse_manifest(await store.get(f"{lineage}/manifest.json"))
    assert [(p.first_index, p.last_index) for p in document.pages] == [(0, 1), (2, 3), (4, 5)]
    assert [s.index for s in document.tail] == [6]
    manifest, keys = await read_manifest(StoreSource(store), await store.get(f"{lineage}/manifest.json"))
    assert [s.index for s in manifest.segments] == list(range(7)) and len(keys) == 3
    # Served as stored, immutable, ETag its hash; 304 on a match; unknown names 404.
    page = document.pages[1]
    resp = await stack.client.get(f"/corpus/archive/manifest-pages/{manifest_page_name(2, 3)}")
    assert resp.status == 200 and await resp.read() == await store.get(page.key(document.lineage))
    assert resp.headers["ETag"] == f'"{page.hash}"' and "immutable" in resp.headers["Cache-Control"]
    again = await stack.client.get(f"/corpus/archive/manifest-pages/{manifest_page_name(2, 3)}",
                                   headers={"If-None-Match": resp.headers["ETag"]})
    assert again.status == 304
    for name in (manifest_page_name(6, 7), "0000000000-0000000001x", "..%2Fmanifest.json"):
        resp = await stack.client.get(f"/corpus/archive/manifest-pages/{name}")
        assert resp.status == 404 and (await resp.json())["error"]["code"], name
    # A page changed in the store is not handed out as the archive's.
    await obstore.put_async(raw_store(store), page.key(document.lineage), b'{"tampered": true}\n')
    resp = await stack.client.get(f"/corpus/archive/manifest-pages/{manifest_page_name(2, 3)}")
    assert resp.status == 503 and (await resp.json())["error"]["code"]


@pytest.mark.parametrize("path, status", [
    ("/corpus/archive/proof", 400),
    ("/corpus/archive/proof?sequence=abc", 400),
    ("/corpus/archive/proof?sequence=999999", 404),
    ("/corpus/archive/proof?sequence=1&size=3", 404),
    ("/corpus/archive/checkpoints/3", 404),
    ("/corpus/archive/checkpoints/x", 400),
    ("/corpus/archive/segments/0000000000-0000000000000000001-0000000000000000002x", 404),
    ("/corpus/archive?x=1", 400),
])
async def test_bad_archive_requests_get_the_error_envelope(stack: Stack, tmp_path: Path, path: str,
                                                           status: int) -> None:
    await archived(stack, tmp_path)
    resp = await stack.client.get(path)
    body = await resp.json()
    assert resp.status == status and set(body["error"]) >= {"code", "message", "how_to_proceed"}


async def test_the_private_stream_is_never_served(stack: Stack, tmp_path: Path) -> None:
    await archived(stack, tmp_path)

    async def private_published() -> bool:
        return any(s["state"] == "published" for s in await segments(stack, Stream.PRIVATE))
    await until(private_published, what="a private segment")
    private = (await segments(stack, Stream.PRIVATE))[0]
    name = f"{private['segment_index']:010d}-{private['first_sequence']:019d}-{private['last_sequence']:019d}"
    status = await (await stack.client.get("/corpus/archive")).json()
    public_names = {s.get("name") for s in status["segments"]}
    for path in (f"/corpus/archive/segments/{name}", f"/corpus/archive/segments/private%2Fsegments%2F{name}",
                 f"/corpus/archive/private/segments/{name}"):
        resp = await stack.client.get(path)
        if name in public_names and path.endswith(f"segments/{name}") and "private" not in path:
            # Same name as a public segment: what is served is the public one, never the private bytes.
            data = await resp.read()
            assert decode_segment(data).stream is Stream.PUBLIC
        else:
            assert resp.status == 404
