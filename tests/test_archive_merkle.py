"""protocol/merkle against RFC 6962's definitions, written naively (recursive, slicing) in this file,
and against the known root of the RFC 6962 test leaves; proofs verify and fail when tampered."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.merkle import (
    EMPTY_ROOT,
    CompactTree,
    MerkleError,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    tree_root,
    verify_consistency,
    verify_inclusion,
)


def _h(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def naive_mth(data: list[bytes]) -> bytes:
    """RFC 6962 §2.1 MTH over leaf *data*, literally."""
    n = len(data)
    if n == 0:
        return _h(b"")
    if n == 1:
        return _h(b"\x00" + data[0])
    k = 1
    while k * 2 < n:
        k *= 2
    return _h(b"\x01" + naive_mth(data[:k]) + naive_mth(data[k:]))


def naive_path(m: int, data: list[bytes]) -> list[bytes]:
    n = len(data)
    if n == 1:
        return []
    k = 1
    while k * 2 < n:
        k *= 2
    if m < k:
        return naive_path(m, data[:k]) + [naive_mth(data[k:])]
    return naive_path(m - k, data[k:]) + [naive_mth(data[:k])]


def naive_subproof(m: int, data: list[bytes], b: bool) -> list[bytes]:
    n = len(data)
    if m == n:
        return [] if b else [naive_mth(data)]
    k = 1
    while k * 2 < n:
        k *= 2
    if m <= k:
        return naive_subproof(m, data[:k], b) + [naive_mth(data[k:])]
    return naive_subproof(m - k, data[k:], False) + [naive_mth(data[:k])]


# The eight leaves of the RFC 6962 reference test data, and their known tree root.
RFC_LEAVES = [bytes.fromhex(x) for x in ["", "00", "10", "2021", "3031", "40414243", "5051525354555657",
                                         "606162636465666768696a6b6c6d6e6f"]]
RFC_ROOT_8 = "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"

leaf_lists = st.lists(st.binary(max_size=12), min_size=1, max_size=70)


def test_known_vectors() -> None:
    assert tree_root([]) == EMPTY_ROOT == _h(b"")
    assert tree_root([leaf_hash(b"")]).hex() == "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
    assert tree_root([leaf_hash(x) for x in RFC_LEAVES]).hex() == RFC_ROOT_8


@settings(max_examples=200, deadline=None)
@given(leaf_lists)
def test_root_and_compact_tree_match_the_definition(data: list[bytes]) -> None:
    leaves = [leaf_hash(d) for d in data]
    expected = naive_mth(data)
    assert tree_root(leaves) == expected
    tree = CompactTree()
    for i, d in enumerate(data):
        tree.append(d)
        assert tree.root() == naive_mth(data[:i + 1])
        # The frontier is what gets persisted: one hash per set bit of the size, and it restores.
        assert len(tree.frontier or []) == tree.size.bit_count()
        assert CompactTree.from_state(tree.size, list(tree.frontier or [])).root() == tree.root()
    assert tree.root() == expected


@settings(max_examples=200, deadline=None)
@given(leaf_lists, st.data())
def test_extending_in_runs_is_appending_leaf_by_leaf(data: list[bytes], draw: st.DataObject) -> None:
    """CompactTree.extend (level by level) reaches the same size, frontier and root as append_hash,
    from any starting size, in runs of any lengths."""
    leaves = [leaf_hash(d) for d in data]
    one_by_one = CompactTree()
    for h in leaves:
        one_by_one.append_hash(h)
    runs = CompactTree()
    position = 0
    while position < len(leaves):
        run = draw.draw(st.integers(0, len(leaves) - position))
        runs.extend(leaves[position:position + run])
        position += run
        if run == 0:
            runs.extend(leaves[position:])
            position = len(leaves)
    assert (runs.size, runs.frontier, runs.root()) == (one_by_one.size, one_by_one.frontier, one_by_one.root())
    assert tree_root(leaves) == one_by_one.root()


@settings(max_examples=150, deadline=None)
@given(leaf_lists, st.data())
def test_inclusion_proofs(data: list[bytes], draw: st.DataObject) -> None:
    leaves = [leaf_hash(d) for d in data]
    n = len(leaves)
    root = tree_root(leaves)
    i = draw.draw(st.integers(0, n - 1))
    proof = inclusion_proof(leaves, i)
    assert proof == naive_path(i, data)
    assert verify_inclusion(leaves[i], i, n, proof, root)
    # Tampering: another leaf, another index, a flipped path byte, a dropped or
    # extra node, another root: each fails.
    other = leaf_hash(data[i] + b"x")
    assert not verify_inclusion(other, i, n, proof, root)
    if n > 1:
        j = (i + 1) % n
        assert not verify_inclusion(leaves[i], j, n, proof, root) or leaves[i] == leaves[j]
        k = draw.draw(st.integers(0, len(proof) - 1))
        flipped = list(proof)
        flipped[k] = bytes([flipped[k][0] ^ 1]) + flipped[k][1:]
        assert not verify_inclusion(leaves[i], i, n, flipped, root)
        assert not verify_inclusion(leaves[i], i, n, proof[:-1], root)
    assert not verify_inclusion(leaves[i], i, n, proof + [root], root)
    assert not verify_inclusion(leaves[i], i, n, proof, _h(root))
    assert not verify_inclusion(leaves[i], n, n, proof, root)


@settings(max_examples=150, deadline=None)
@given(leaf_lists, st.data())
def test_consistency_proofs(data: list[bytes], draw: st.DataObject) -> None:
    leaves = [leaf_hash(d) for d in data]
    n = len(leaves)
    m = draw.draw(st.integers(0, n))
    old_root, new_root = tree_root(leaves[:m]), tree_root(leaves)
    proof = consistency_proof(leaves, m)
    if 0 < m < n:
        assert proof == naive_subproof(m, data, True)
    assert verify_consistency(m, n, old_root, new_root, proof)
    if 0 < m < n:
        # A different old tree (history rewritten), a flipped proof byte, a short proof: each fails.
        rewritten = tree_root([leaf_hash(b"forged")] + leaves[1:m])
        assert not verify_consistency(m, n, rewritten, new_root, proof)
        assert not verify_consistency(m, n, old_root, _h(new_root), proof)
        k = draw.draw(st.integers(0, len(proof) - 1))
        flipped = list(proof)
        flipped[k] = bytes([flipped[k][0] ^ 1]) + flipped[k][1:]
        assert not verify_consistency(m, n, old_root, new_root, flipped)
        assert not verify_consistency(m, n, old_root, new_root, proof[:-1])
    if m == n:
        assert not verify_consistency(m, n, old_root, _h(new_root), proof)


def test_a_new_tree_that_does_not_extend_the_old_one_has_no_proof() -> None:
    old = [leaf_hash(bytes([i])) for i in range(5)]
    new = [leaf_hash(b"other")] + old[1:] + [leaf_hash(b"more")]
    proof = consistency_proof(new, 5)
    assert not verify_consistency(5, 6, tree_root(old), tree_root(new), proof)


def test_bad_inputs() -> None:
    with pytest.raises(MerkleError):
        inclusion_proof([leaf_hash(b"a")], 1)
    with pytest.raises(MerkleError):
        consistency_proof([leaf_hash(b"a")], 2)
    with pytest.raises(MerkleError):
        CompactTree.from_state(3, [EMPTY_ROOT])  # size 3 needs two frontier hashes
    assert not verify_inclusion(b"short", 0, 1, [], EMPTY_ROOT)


def test_inclusion_ranges_give_the_audit_path_from_streamed_leaves() -> None:
    """Streaming the leaves once into one tree per range (what GET /corpus/archive/proof does) gives
    exactly the RFC 6962 audit path, for every leaf of every tree size up to 40."""
    from protocol.merkle import CompactTree, inclusion_proof, inclusion_ranges, leaf_hash

    for size in range(1, 41):
        leaves = [leaf_hash(f"event {i}".encode()) for i in range(size)]
        for index in range(size):
            ranges = inclusion_ranges(index, size)
            trees = [CompactTree() for _ in ranges]
            for position, leaf in enumerate(leaves):
                for (lo, hi), tree in zip(ranges, trees, strict=True):
                    if lo <= position < hi:
                        tree.append_hash(leaf)
            assert [t.root() for t in trees] == inclusion_proof(leaves, index)
