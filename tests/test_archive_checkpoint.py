"""Manifest encoding and validation; signed checkpoints against a note built here from the C2SP
signed-note rules alone (key id, signature line, verifier key text), and refused on any change."""

from __future__ import annotations

import base64
import hashlib
import uuid

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import checkpoint as cp
from protocol.archive import GENESIS_HASH, ArchivedEvent, Stream, decode_segment, encode_segment
from protocol.manifest import (
    Manifest,
    ManifestError,
    ManifestSegment,
    decode_manifest,
    encode_manifest,
    encode_page,
    encode_paged,
    manifest_of,
    parse_manifest,
)

LINEAGE = uuid.UUID("0b8f3a52-7c1d-4e6f-9a2b-3c4d5e6f7a8b")
PARENT = uuid.UUID("1c9a4b63-8d2e-4f70-ab3c-4d5e6f7a8b9c")
ORIGIN = "archive.example.test/toastmachine/0b8f3a52-7c1d-4e6f-9a2b-3c4d5e6f7a8b"


# --- manifest ----------------------------------------------------------------------------------------


def _decoded_chain(count: int) -> list:
    out, previous = [], GENESIS_HASH
    for index in range(count):
        events = [ArchivedEvent(index * 10 + i, b"ev%d" % i) for i in range(1, 4)]
        seg = decode_segment(encode_segment(Stream.PUBLIC, LINEAGE, index, previous, events))
        out.append(seg)
        previous = seg.hash
    return out


def test_a_paged_manifest_reads_whole_and_every_page_is_checked_against_its_entry() -> None:
    listed = manifest_of(LINEAGE, PARENT, _decoded_chain(7)).segments
    pages = [encode_page(LINEAGE, listed[0:3]), encode_page(LINEAGE, listed[3:6])]
    data = encode_paged(LINEAGE, PARENT, [p for p, _ in pages], listed[6:])
    document = parse_manifest(data)
    assert document.page_keys() == [f"{LINEAGE}/manifest-pages/0000000000-0000000002",
                                    f"{LINEAGE}/manifest-pages/0000000003-0000000005"]
    whole = document.assemble([b for _, b in pages])
    assert whole == manifest_of(LINEAGE, PARENT, _decoded_chain(7))  # the same as listing every segment
    assert encode_paged(LINEAGE, PARENT, document.pages, document.tail) == data  # deterministic
    entry = orjson.loads(data)["pages"][0]
    assert entry == {"first_index": 0, "last_index": 2, "first_sequence": 1, "last_sequence": 23, "event_count": 9,
                     "size": len(pages[0][1]), "hash": hashlib.sha256(pages[0][1]).hexdigest()}
    with pytest.raises(ManifestError, match="fetch them"):
        decode_manifest(data)  # a reader that would not fetch the pages
    # A page that is not the one named: other bytes, another page in its place, one missing.
    with pytest.raises(ManifestError, match="size or SHA-256"):
        document.assemble([pages[0][1].replace(b'"event_count": 3', b'"event_count": 2', 1), pages[1][1]])
    with pytest.raises(ManifestError, match="size or SHA-256"):
        document.assemble([pages[1][1], pages[0][1]])
    with pytest.raises(ManifestError, match="listed"):
        document.assemble([pages[0][1]])
    # Entries that do not run on from each other, or a tail that does not follow the last page.
    with pytest.raises(ManifestError, match="expected a run"):
        parse_manifest(encode_paged(LINEAGE, PARENT, [pages[1][0]], listed[6:]))
    with pytest.raises(ManifestError, match="after the last page"):
        parse_manifest(encode_paged(LINEAGE, PARENT, [p for p, _ in pages], listed[5:]))
    raw = orjson.loads(data)
    raw["pages"][0]["extra"] = 1
    with pytest.raises(ManifestError, match="unknown keys"):
        parse_manifest(orjson.dumps(raw))
    # A manifest written before pages existed (no "pages" key) reads as it did.
    legacy = encode_manifest(manifest_of(LINEAGE, PARENT, _decoded_chain(7)))
    assert b'"pages"' not in legacy and parse_manifest(legacy).assemble([]) == whole


def test_manifest_round_trip_and_determinism() -> None:
    chain = _decoded_chain(3)
    manifest = manifest_of(LINEAGE, PARENT, chain)
    data = encode_manifest(manifest)
    assert decode_manifest(data) == manifest
    assert encode_manifest(decode_manifest(data)) == data
    raw = orjson.loads(data)
    assert raw["format_version"] == 2 and raw["lineage"] == str(LINEAGE) and raw["parent_lineage"] == str(PARENT)
    assert raw["segments"][1] == {"index": 1, "first_sequence": 11, "last_sequence": 13, "event_count": 3,
                                  "size": chain[1].size, "hash": chain[1].hash.hex()}
    assert manifest.tree_size == 9 and manifest.archived_through == 23 and manifest.last_hash == chain[2].hash.hex()
    empty = Manifest(LINEAGE, None)
    assert decode_manifest(encode_manifest(empty)) == empty


def test_manifest_append_checks_continuity() -> None:
    chain = _decoded_chain(3)
    manifest = manifest_of(LINEAGE, None, chain[:2])
    assert manifest.appended(ManifestSegment.of(chain[2])).segments[-1].index == 2
    with pytest.raises(ManifestError):
        manifest.appended(ManifestSegment.of(chain[1]))  # index 1 again


def _tampered(mutate) -> bytes:  # type: ignore[no-untyped-def]
    raw = orjson.loads(encode_manifest(manifest_of(LINEAGE, None, _decoded_chain(3))))
    mutate(raw)
    return orjson.dumps(raw)


@pytest.mark.parametrize("name,mutate", [
    ("missing segment", lambda m: m["segments"].pop(1)),
    ("reordered", lambda m: m["segments"].reverse()),
    ("overlap", lambda m: m["segments"][1].update(first_sequence=13)),
    ("count too big", lambda m: m["segments"][0].update(event_count=99)),
    ("bad hash", lambda m: m["segments"][0].update(hash="ABC")),
    ("bool as int", lambda m: m["segments"][0].update(size=True)),
    ("unknown key", lambda m: m.update(extra=1)),
    ("missing key", lambda m: m.pop("parent_lineage")),
    ("version", lambda m: m.update(format_version=3)),
    ("lineage", lambda m: m.update(lineage="not-a-uuid")),
    ("self parent", lambda m: m.update(parent_lineage=m["lineage"])),
    ("tiny size", lambda m: m["segments"][0].update(size=10)),
])
def test_manifest_refuses_inconsistency(name: str, mutate) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ManifestError):
        decode_manifest(_tampered(mutate))


@pytest.mark.parametrize("data", [b"", b"[]", b"{", b"null", b'"x"'])
def test_manifest_refuses_non_manifests(data: bytes) -> None:
    with pytest.raises(ManifestError):
        decode_manifest(data)


# --- signed notes, from the spec's rules -------------------------------------------------------------


def _spec_key_id(name: str, public: bytes) -> bytes:
    # signed-note: key ID = SHA-256(key name || 0x0A || signature type || public key)[:4]; Ed25519 is 0x01.
    return hashlib.sha256(name.encode() + b"\x0a" + b"\x01" + public).digest()[:4]


def _spec_note(text: str, name: str, private: Ed25519PrivateKey) -> str:
    """A signed note assembled by hand: text, blank line, em dash + space + name + space + base64(id || sig)."""
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    signature = private.sign(text.encode())
    return text + "\n" + "\u2014 " + name + " " + base64.b64encode(_spec_key_id(name, public) + signature).decode() + "\n"


def _spec_vkey(name: str, private: Ed25519PrivateKey) -> str:
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    encoded = base64.b64encode(b"\x01" + public).decode()
    return f"{name}+{_spec_key_id(name, public).hex()}+{encoded}"


ROOT = hashlib.sha256(b"some root").digest()


def test_verifier_accepts_a_note_built_by_the_spec() -> None:
    private = Ed25519PrivateKey.generate()
    body = f"{ORIGIN}\n12345\n{base64.b64encode(ROOT).decode()}\n"
    note = _spec_note(body, ORIGIN, private)
    verifier = cp.parse_verifier_key(_spec_vkey(ORIGIN, private))
    checkpoint = cp.verify_checkpoint(note, verifier)
    assert checkpoint == cp.Checkpoint(ORIGIN, 12345, ROOT)


def test_signer_produces_exactly_the_spec_form() -> None:
    key = cp.generate_signer_key(ORIGIN)
    note = cp.sign_checkpoint(cp.Checkpoint(ORIGIN, 7, ROOT), key)
    private = Ed25519PrivateKey.from_private_bytes(key.seed)
    # Ed25519 signatures are deterministic: the hand-built note is byte-identical.
    assert note == _spec_note(f"{ORIGIN}\n7\n{base64.b64encode(ROOT).decode()}\n", ORIGIN, private)
    assert key.verifier().text() == _spec_vkey(ORIGIN, private)
    assert cp.parse_signer_key(key.text()) == key
    assert cp.parse_verifier_key(key.verifier().text()) == key.verifier()
    assert "seed" in repr(key) and key.seed.hex() not in repr(key)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_change_to_a_signed_checkpoint_is_refused(draw: st.DataObject) -> None:
    key = cp.generate_signer_key(ORIGIN)
    note = cp.sign_checkpoint(cp.Checkpoint(ORIGIN, 99, ROOT), key).encode()
    i = draw.draw(st.integers(0, len(note) - 1))
    bit = draw.draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]))
    broken = bytearray(note)
    broken[i] ^= bit
    with pytest.raises(cp.CheckpointError):
        cp.verify_checkpoint(bytes(broken), key.verifier())


def test_a_signature_with_a_flipped_padding_bit_is_refused() -> None:
    """68 bytes of key id and signature end in a padded base64 group whose last character carries
    two bits the decoder ignores: flipping one must still be refused (the example Hypothesis found)."""
    key = cp.generate_signer_key(ORIGIN)
    note = cp.sign_checkpoint(cp.Checkpoint(ORIGIN, 99, ROOT), key)
    line = note.rstrip("\n").rpartition("\n")[2]
    encoded = line.rsplit(" ", 1)[1]
    assert encoded.endswith("=") and not encoded.endswith("==")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = alphabet.index(encoded[-2])
    twin = encoded[:-2] + alphabet[last ^ 1] + "="
    assert base64.b64decode(twin) == base64.b64decode(encoded)  # the decoder alone cannot tell them apart
    with pytest.raises(cp.CheckpointError):
        cp.verify_checkpoint(note.replace(encoded, twin), key.verifier())


def test_refusals_say_why() -> None:
    key, other = cp.generate_signer_key(ORIGIN), cp.generate_signer_key(ORIGIN)
    good = cp.sign_checkpoint(cp.Checkpoint(ORIGIN, 5, ROOT), key)
    # Another key of the same name: no signature by *our* key (ids differ).
    with pytest.raises(cp.UnsignedNote):
        cp.verify_checkpoint(good, other.verifier())
    # A body changed after signing (tree size 5 -> 6), the signature line kept.
    forged = good.replace("\n5\n", "\n6\n", 1)
    with pytest.raises(cp.BadSignature):
        cp.verify_checkpoint(forged, key.verifier())
    # A cosignature by an unknown key is ignored, as the spec requires.
    witness = cp.generate_signer_key("witness.example.test")
    cosigned = good + cp.sign_note(good.split("\n\n")[0] + "\n", witness).split("\n\n")[1]
    assert cp.verify_checkpoint(cosigned, key.verifier()).size == 5
    assert cp.verify_checkpoint(cosigned, witness.verifier(), origin=ORIGIN).size == 5
    # The origin must be the expected one.
    elsewhere = cp.generate_signer_key("elsewhere.example.test")
    with pytest.raises(cp.OriginMismatch):
        cp.verify_checkpoint(cp.sign_checkpoint(cp.Checkpoint(ORIGIN, 5, ROOT), elsewhere), elsewhere.verifier())
    with pytest.raises(cp.MalformedNote):
        cp.verify_checkpoint(good.replace("\u2014", "--"), key.verifier())
    with pytest.raises(cp.MalformedNote):
        cp.verify_checkpoint(good.rstrip("\n"), key.verifier())


@pytest.mark.parametrize("body", [
    f"{ORIGIN}\n05\n{base64.b64encode(ROOT).decode()}\n",          # leading zero
    f"{ORIGIN}\n-1\n{base64.b64encode(ROOT).decode()}\n",          # negative
    f"{ORIGIN}\n5\n{base64.b64encode(ROOT[:31]).decode()}\n",      # 31-byte root
    f"{ORIGIN}\n5\n",                                              # no root line
    f"{ORIGIN}\n5\n" + base64.urlsafe_b64encode(b"\xfb" * 32).decode() + "\n",  # not standard base64
])
def test_malformed_checkpoint_bodies(body: str) -> None:
    key = cp.generate_signer_key(ORIGIN)
    with pytest.raises(cp.MalformedCheckpoint):
        cp.verify_checkpoint(cp.sign_note(body, key), key.verifier())


@pytest.mark.parametrize("text", ["", "a+b+c", "PRIVATE+KEY+x+00000000+AAAA", "name+zz+AQ==", "has space+00+AQ=="])
def test_malformed_keys(text: str) -> None:
    with pytest.raises(cp.MalformedKey):
        cp.parse_verifier_key(text)
    with pytest.raises(cp.MalformedKey):
        cp.parse_signer_key(text)


def test_key_names_follow_the_spec() -> None:
    for bad in ["", "a b", "a+b", "tab\tname"]:
        with pytest.raises(cp.MalformedKey):
            cp.generate_signer_key(bad)


def test_a_newer_checkpoint_must_extend_the_older_one() -> None:
    from protocol.merkle import consistency_proof, leaf_hash, tree_root

    leaves = [leaf_hash(b"event %d" % i) for i in range(23)]
    key = cp.generate_signer_key(ORIGIN)
    older = cp.verify_checkpoint(cp.sign_checkpoint(cp.Checkpoint(ORIGIN, 9, tree_root(leaves[:9])), key),
                                 key.verifier())
    newer = cp.Checkpoint(ORIGIN, 23, tree_root(leaves))
    cp.check_extends(older, newer, consistency_proof(leaves, 9))
    # A history rewritten below the old size, signed by the same key: its proof cannot tie it to the old root.
    rewritten = leaves[:4] + [leaf_hash(b"edited")] + leaves[5:]
    forged = cp.Checkpoint(ORIGIN, 23, tree_root(rewritten))
    with pytest.raises(cp.NotAnExtension):
        cp.check_extends(older, forged, consistency_proof(rewritten, 9))
    with pytest.raises(cp.NotAnExtension):
        cp.check_extends(newer, older, [])
    with pytest.raises(cp.NotAnExtension):
        cp.check_extends(older, cp.Checkpoint("other.example.test", 23, newer.root), consistency_proof(leaves, 9))


json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(st.one_of(json_values, st.fixed_dictionaries({
    "format_version": json_values, "lineage": json_values, "parent_lineage": json_values,
    "segments": st.lists(json_values, max_size=3)})))
def test_arbitrary_json_is_refused_only_with_manifest_error(value: object) -> None:
    try:
        decode_manifest(orjson.dumps(value))
    except ManifestError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_is_refused_only_with_checkpoint_error(text: str) -> None:
    key = cp.generate_signer_key(ORIGIN)
    with pytest.raises(cp.CheckpointError):
        cp.verify_checkpoint(text, key.verifier())
    with pytest.raises(cp.CheckpointError):
        cp.verify_checkpoint(text.encode("utf-8", "surrogatepass"), key.verifier())
