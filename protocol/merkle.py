"""The RFC 6962 Merkle tree over the whole change history, its proofs and a compact incremental form.

Pure functions over 32-byte SHA-256 hashes, no I/O. Every archived event is one leaf, in sequence
order, of a single tree (SPEC §5); a signed checkpoint commits to its root.

- :func:`leaf_hash` / :func:`node_hash`: the domain-separated hashes of RFC 6962 §2.1 (prefix 0x00
  for a leaf, 0x01 for an interior node), so a leaf can never be passed off as a node.
- :func:`tree_root`: MTH(D[n]) over a list of leaf hashes.
- :func:`inclusion_proof` / :func:`verify_inclusion`: the audit path of one leaf (RFC 6962 §2.1.1
  to build, RFC 9162 §2.1.3.2 to check).
- :func:`consistency_proof` / :func:`verify_consistency`: that a tree of size m is a prefix of a tree
  of size n (RFC 6962 §2.1.2 to build, RFC 9162 §2.1.4.2 to check), which is how a mirror checks that
  a new checkpoint extends the last one it trusted.
- :class:`CompactTree`: the right-edge frontier (one hash per set bit of the size), so the archiver
  appends leaves and reads the root without holding every leaf.

Not here yet: proofs built from stored subtree hashes (these builders take every leaf hash of the
tree, O(n) per proof); the archiver's proof route will need a hash-range source instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from protocol.errors import ToastMachineError

HASH_SIZE = 32
LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
#: MTH of the empty tree: SHA-256 of the empty string (RFC 6962 §2.1).
EMPTY_ROOT = hashlib.sha256(b"").digest()

try:
    # Built from protocol/_hashes.c by `pip install` (setup.py); where it could not be built, the
    # pure-Python lines below compute the same hashes, several times more slowly.
    from protocol import _hashes as _native
except ImportError:  # pragma: no cover - exercised only where the extension is not built
    _native = None  # type: ignore[assignment]  # (the module or nothing)
#: True when the batched hashes (and the segment frames loops) run in the C extension ``protocol._hashes``.
NATIVE_HASHES = _native is not None


class MerkleError(ToastMachineError):
    """A proof or tree state is malformed (wrong sizes, indexes out of range, bad hash lengths)."""


def leaf_hash(data: bytes) -> bytes:
    """MTH of a one-leaf tree: SHA-256(0x00 || data)."""
    return hashlib.sha256(LEAF_PREFIX + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """Hash of an interior node: SHA-256(0x01 || left || right)."""
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def hash_leaves(bodies: Sequence[bytes]) -> list[bytes]:
    """``[leaf_hash(b) for b in bodies]``, in one call to the C extension when it is built (hashlib
    costs more per digest than hashing a 1 KiB event does; see ``protocol/_hashes.c``)."""
    if _native is not None:
        return _native.leaf_hashes(bodies)
    sha256 = hashlib.sha256
    return [sha256(LEAF_PREFIX + body).digest() for body in bodies]


def hash_pairs(level: Sequence[bytes]) -> list[bytes]:
    """The interior nodes over neighbouring pairs of ``level`` (an unpaired last hash is left out):
    ``node_hash(level[0], level[1])``, ``node_hash(level[2], level[3])``, ..."""
    if _native is not None:
        return _native.node_hashes(level)
    sha256 = hashlib.sha256
    return [sha256(NODE_PREFIX + left + right).digest() for left, right in zip(level[::2], level[1::2])]


def split_point(n: int) -> int:
    """The largest power of two strictly smaller than n (n >= 2): where RFC 6962 splits D[n]."""
    return 1 << ((n - 1).bit_length() - 1)


def tree_root(leaves: Sequence[bytes]) -> bytes:
    """MTH(D[n]) of the given leaf hashes (not leaf data), computed bottom-up without recursion.

    Level by level: pair neighbours, and carry an unpaired last node up unchanged. That is RFC
    6962's split at the largest power of two below n, read from the bottom (the left part is always
    a perfect subtree, so the pairs never straddle the split), and one list comprehension per level
    is several times faster in Python than appending leaf by leaf.
    """
    if not leaves:
        return EMPTY_ROOT
    level = list(leaves)
    while len(level) > 1:
        odd = level[-1] if len(level) & 1 else None
        level = hash_pairs(level)
        if odd is not None:
            level.append(odd)
    return level[0]


@dataclass(frozen=True, slots=True)
class Subtree:
    """The perfect subtrees of a run of leaves, height by height, and the run's own root.

    ``levels[h]`` holds the roots of the ``size >> h`` perfect subtrees of height ``h`` over the
    leaves, left to right (``levels[0]`` is the leaves). A segment needs the root of its leaves as a
    tree of their own (its trailer) and also appends them to the history's tree: where the history
    so far ends on a multiple of ``2**h``, the history's new nodes of height ``h`` are exactly these,
    so :meth:`CompactTree.extend` reuses them instead of hashing them again (for 500-event segments,
    at least three quarters of the history's new nodes). Build one with :func:`subtree`.
    """

    levels: tuple[list[bytes], ...]
    root: bytes

    @property
    def leaves(self) -> list[bytes]:
        """The leaf hashes, in order."""
        return self.levels[0] if self.levels else []

    @property
    def size(self) -> int:
        return len(self.levels[0]) if self.levels else 0


def subtree(leaves: Sequence[bytes]) -> Subtree:
    """The :class:`Subtree` of ``leaves`` (leaf hashes); its ``root`` is :func:`tree_root` of them.

    The same number of node hashes as :func:`tree_root`: the perfect subtrees level by level, then
    the root folded from the one perfect subtree per set bit of the size, largest (leftmost) first,
    which is RFC 6962's split read from the bottom.
    """
    level = list(leaves)
    if any(len(h) != HASH_SIZE for h in level):
        raise MerkleError("leaf hashes must be 32 bytes")
    if not level:
        return Subtree((), EMPTY_ROOT)
    sha256 = hashlib.sha256
    levels = [level]
    while len(level) > 1:
        level = hash_pairs(level)
        levels.append(level)
    n = len(levels[0])
    # The perfect subtree of height h in the decomposition is the last of its level when bit h is set.
    peaks = [levels[h][(n >> h) - 1] for h in range(n.bit_length()) if n >> h & 1]
    root = peaks[0]
    for left in peaks[1:]:
        root = sha256(NODE_PREFIX + left + root).digest()
    return Subtree(tuple(levels), root)


def _range_root(leaves: Sequence[bytes], lo: int, hi: int) -> bytes:
    """MTH of leaves[lo:hi] (hi > lo), without copying the slice."""
    tree = CompactTree()
    for i in range(lo, hi):
        tree.append_hash(leaves[i])
    return tree.root()


def inclusion_proof(leaves: Sequence[bytes], index: int) -> list[bytes]:
    """The audit path PATH(index, D[n]) of RFC 6962 §2.1.1, leaf end first."""
    n = len(leaves)
    if not 0 <= index < n:
        raise MerkleError(f"leaf index {index} is outside a tree of size {n}")
    path: list[bytes] = []
    lo, hi = 0, n
    # Walk from the root towards the leaf, collecting the sibling subtree at each split; the path is
    # ordered from the leaf upwards, so build it reversed.
    while hi - lo > 1:
        k = split_point(hi - lo)
        if index < lo + k:
            path.append(_range_root(leaves, lo + k, hi))
            hi = lo + k
        else:
            path.append(_range_root(leaves, lo, lo + k))
            lo = lo + k
    path.reverse()
    return path


def inclusion_ranges(index: int, size: int) -> list[tuple[int, int]]:
    """The leaf ranges ``[lo, hi)`` whose tree hashes make up PATH(index, D[size]), leaf end first.

    They are disjoint and, with the leaf itself, cover the tree: a caller that streams the leaves
    once (e.g. from a database) can compute the audit path with one :class:`CompactTree` per range,
    without holding the leaves (what :func:`inclusion_proof` needs).
    """
    if not 0 <= index < size:
        raise MerkleError(f"leaf index {index} is outside a tree of size {size}")
    ranges: list[tuple[int, int]] = []
    lo, hi = 0, size
    while hi - lo > 1:
        k = split_point(hi - lo)
        if index < lo + k:
            ranges.append((lo + k, hi))
            hi = lo + k
        else:
            ranges.append((lo, lo + k))
            lo = lo + k
    ranges.reverse()
    return ranges


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> bool:
    """True when ``proof`` shows leaf hash ``leaf`` at ``index`` in the tree of ``size`` with ``root``.

    RFC 9162 §2.1.3.2. Any malformed input (index out of range, wrong hash length, path of the wrong
    length) gives False rather than an exception: a verifier answers yes or no.
    """
    if not 0 <= index < size or len(leaf) != HASH_SIZE or len(root) != HASH_SIZE:
        return False
    if any(len(p) != HASH_SIZE for p in proof):
        return False
    fn, sn = index, size - 1
    r = leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            # A right-edge node with no right sibling at this level: climb until it has one.
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root


def consistency_proof(leaves: Sequence[bytes], old_size: int) -> list[bytes]:
    """PROOF(m, D[n]) of RFC 6962 §2.1.2: the tree of ``old_size`` leaves is a prefix of ``leaves``.

    Empty when old_size is 0 or equals the new size (nothing to prove).
    """
    n = len(leaves)
    if not 0 <= old_size <= n:
        raise MerkleError(f"old size {old_size} is outside 0..{n}")
    if old_size in (0, n):
        return []
    proof: list[bytes] = []
    m, lo, hi, whole = old_size, 0, n, True
    # SUBPROOF(m, D[lo:hi], whole), unrolled: each step appends one sibling subtree root, and the
    # recursion's tail order is the path's order, so collect and reverse at the end.
    while True:
        size = hi - lo
        if m == size:
            if not whole:
                proof.append(_range_root(leaves, lo, hi))
            break
        k = split_point(size)
        if m <= k:
            proof.append(_range_root(leaves, lo + k, hi))
            hi = lo + k
        else:
            proof.append(_range_root(leaves, lo, lo + k))
            lo, m, whole = lo + k, m - k, False
    proof.reverse()
    return proof


def verify_consistency(old_size: int, new_size: int, old_root: bytes, new_root: bytes,
                       proof: Sequence[bytes]) -> bool:
    """True when ``proof`` shows the tree (old_size, old_root) is a prefix of (new_size, new_root).

    RFC 9162 §2.1.4.2. An empty old tree is consistent with everything (empty proof); equal sizes
    need equal roots and an empty proof. Malformed input gives False.
    """
    if not 0 <= old_size <= new_size:
        return False
    if len(old_root) != HASH_SIZE or len(new_root) != HASH_SIZE or any(len(p) != HASH_SIZE for p in proof):
        return False
    if old_size == 0:
        return len(proof) == 0 and (new_size > 0 or new_root == old_root == EMPTY_ROOT)
    if old_size == new_size:
        return len(proof) == 0 and old_root == new_root
    path = list(proof)
    if old_size & (old_size - 1) == 0:
        # The old tree is a complete subtree: its root is the first node of the path, implicitly.
        path.insert(0, old_root)
    if not path:
        return False
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root


@dataclass(slots=True)
class CompactTree:
    """An append-only Merkle tree kept as its right-edge frontier.

    ``frontier`` holds the roots of the perfect subtrees that make up the tree, largest (leftmost)
    first: one per set bit of ``size``, so at most 64 hashes whatever the history's length. That is
    all that appending and the root need; it is also what the archiver persists between runs
    (:meth:`from_state`).
    """

    size: int = 0
    frontier: list[bytes] | None = None

    def __post_init__(self) -> None:
        if self.frontier is None:
            self.frontier = []
        if self.size < 0 or len(self.frontier) != self.size.bit_count():
            raise MerkleError(f"a tree of size {self.size} has {self.size.bit_count()} frontier hashes, "
                              f"got {len(self.frontier)}")
        if any(len(h) != HASH_SIZE for h in self.frontier):
            raise MerkleError("frontier hashes must be 32 bytes")

    @classmethod
    def from_state(cls, size: int, frontier: Iterable[bytes]) -> CompactTree:
        """Rebuild a tree saved as ``(tree.size, tree.frontier)``; MerkleError if inconsistent."""
        return cls(size, list(frontier))

    def append(self, data: bytes) -> None:
        """Append one leaf given its data (hashed with the 0x00 prefix)."""
        self.append_hash(leaf_hash(data))

    def append_hash(self, h: bytes) -> None:
        """Append one leaf given its leaf hash."""
        assert self.frontier is not None
        if len(h) != HASH_SIZE:
            raise MerkleError("leaf hashes must be 32 bytes")
        self.frontier.append(h)
        # Each trailing 1 bit of the old size is a perfect subtree of the same height as the one just
        # completed: merge them, exactly as binary addition carries.
        carry = self.size
        while carry & 1:
            right = self.frontier.pop()
            left = self.frontier.pop()
            self.frontier.append(node_hash(left, right))
            carry >>= 1
        self.size += 1

    def extend(self, hashes: Iterable[bytes] | Subtree) -> None:
        """Append many leaves given their leaf hashes (what :meth:`append_hash` does for each), or a
        :class:`Subtree` of them, whose perfect subtrees are reused where the tree so far is aligned.

        Level by level rather than leaf by leaf: at each height the new nodes are paired in one
        list comprehension, a frontier node of that height first when the tree so far ends in the
        middle of a pair, and an unpaired last node becomes the new frontier node of that height.
        While no frontier node has joined (the old size is a multiple of ``2**(h+1)``), the pairs
        at height ``h`` are exactly the subtree's nodes of height ``h + 1``: no hashing needed.
        """
        frontier = self.frontier
        assert frontier is not None
        if isinstance(hashes, Subtree):
            levels: tuple[list[bytes], ...] = hashes.levels
            level = list(hashes.leaves)  # checked by subtree()
        else:
            levels = ()
            level = list(hashes)
            if level and (min(map(len, level)) != HASH_SIZE or max(map(len, level)) != HASH_SIZE):
                raise MerkleError("leaf hashes must be 32 bytes")
        if not level:
            return
        old, new_size = self.size, self.size + len(level)
        # Frontier nodes by height: the set bits of the old size, smallest (rightmost) last.
        heights = [h for h in range(old.bit_length()) if old >> h & 1]
        kept: dict[int, bytes] = dict(zip(heights, reversed(frontier), strict=True))
        position, height = old, 0
        aligned = bool(levels)
        while level:
            if position & 1:
                # The tree so far ends with a lone node at this height: it is the left of a pair.
                level.insert(0, kept.pop(height))
                position -= 1
                aligned = False
            if len(level) & 1:
                kept[height] = level.pop()
            if aligned and height + 1 < len(levels):
                level = list(levels[height + 1])
            else:
                level = hash_pairs(level)
            position >>= 1
            height += 1
        # What remains: the old frontier above the heights reached, and the new lone nodes.
        self.frontier = [kept[h] for h in sorted(kept, reverse=True)]
        self.size = new_size
        assert len(self.frontier) == new_size.bit_count()

    def root(self) -> bytes:
        """MTH of the leaves appended so far (EMPTY_ROOT for none)."""
        assert self.frontier is not None
        if not self.frontier:
            return EMPTY_ROOT
        r = self.frontier[-1]
        for left in reversed(self.frontier[:-1]):
            r = node_hash(left, r)
        return r

    def copy(self) -> CompactTree:
        """An independent copy (to compute a prospective root without committing to it)."""
        assert self.frontier is not None
        return CompactTree(self.size, list(self.frontier))
