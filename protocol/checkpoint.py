"""Signed checkpoints: the archive's tree size and root in the C2SP signed-note form, Ed25519-signed.

A checkpoint body (C2SP tlog-checkpoint) is three lines, each ending in a newline::

    <origin>
    <tree size, decimal, no leading zeros>
    <root hash, standard base64>

optionally followed by non-empty extension lines. The signed note (C2SP signed-note) is that body,
a blank line, then one line per signature: U+2014 EM DASH, space, key name, space, base64 of the
4-byte key id followed by the 64-byte Ed25519 signature of the body. The key id is the first four
bytes of SHA-256(key name || 0x0A || 0x01 || public key), 0x01 naming Ed25519.

Keys travel as text: the public *verifier key* ``<name>+<key id hex>+<base64(0x01 || public key)>``
(what the node publishes and a mirror pins) and the private *signer key*
``PRIVATE+KEY+<name>+<key id hex>+<base64(0x01 || 32-byte seed)>`` (what the operator stores).

Verification follows the spec: signatures by other keys are ignored; a note with no signature by the
trusted key, or a failing one, is refused with a :class:`CheckpointError` whose ``kind`` says which.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from protocol.errors import ToastMachineError
from protocol.merkle import verify_consistency

#: Signature type byte of Ed25519 in key ids and key encodings.
ALG_ED25519 = 0x01
SIGNATURE_PREFIX = "\u2014 "
#: Notes larger than this, or with more signature lines, are refused before any work.
MAX_NOTE_BYTES = 1 << 20
MAX_SIGNATURES = 100
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")


class CheckpointError(ToastMachineError):
    """A key, note or checkpoint is malformed, or a signature does not verify. See ``kind``."""

    kind: ClassVar[str] = "invalid"


class MalformedKey(CheckpointError):
    kind = "malformed_key"


class MalformedNote(CheckpointError):
    kind = "malformed_note"


class MalformedCheckpoint(CheckpointError):
    kind = "malformed_checkpoint"


class UnsignedNote(CheckpointError):
    """No signature line by the trusted key (name and key id)."""

    kind = "not_signed_by_key"


class BadSignature(CheckpointError):
    """A signature line by the trusted key that does not verify: the note was altered."""

    kind = "bad_signature"


class OriginMismatch(CheckpointError):
    kind = "origin_mismatch"


# --- keys ------------------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    # signed-note: non-empty, no Unicode spaces, no '+'; control characters are never allowed in a note.
    if not name or "+" in name or any(c.isspace() or ord(c) < 0x20 for c in name):
        raise MalformedKey("a key name is non-empty and has no spaces, '+' or control characters")


def key_id(name: str, public_key: bytes) -> bytes:
    """The 4-byte id of an Ed25519 key: SHA-256(name || 0x0A || 0x01 || public key)[:4]."""
    return hashlib.sha256(name.encode() + b"\n" + bytes([ALG_ED25519]) + public_key).digest()[:4]


def _b64decode(text: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedKey(f"{what} is not standard base64") from None
    if base64.b64encode(raw).decode() != text:
        raise MalformedKey(f"{what} is not canonical standard base64")
    return raw


@dataclass(frozen=True, slots=True)
class VerifierKey:
    """A public key that checks notes: its name (the checkpoint origin), id and Ed25519 bytes."""

    name: str
    id: bytes
    public_key: bytes

    def text(self) -> str:
        """``<name>+<id hex>+<base64(0x01 || public key)>``: what a mirror pins."""
        return f"{self.name}+{self.id.hex()}+{base64.b64encode(bytes([ALG_ED25519]) + self.public_key).decode()}"


@dataclass(frozen=True, slots=True)
class SignerKey:
    """A private key that signs notes. Never logged: its ``repr`` hides the seed."""

    name: str
    seed: bytes

    def __repr__(self) -> str:
        return f"SignerKey(name={self.name!r}, seed=<hidden>)"

    @property
    def _private(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self.seed)

    def verifier(self) -> VerifierKey:
        """The matching public key."""
        public = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return VerifierKey(self.name, key_id(self.name, public), public)

    def text(self) -> str:
        """``PRIVATE+KEY+<name>+<id hex>+<base64(0x01 || seed)>``: what the operator stores."""
        v = self.verifier()
        return f"PRIVATE+KEY+{self.name}+{v.id.hex()}+{base64.b64encode(bytes([ALG_ED25519]) + self.seed).decode()}"

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)


def generate_signer_key(name: str) -> SignerKey:
    """A fresh Ed25519 key named ``name`` (use the checkpoint origin)."""
    _check_name(name)
    seed = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return SignerKey(name, seed)


def parse_signer_key(text: str) -> SignerKey:
    """Read a signer key from its text; MalformedKey (without echoing the text) when it is not one."""
    # The base64 part may itself contain '+'; the name may not, so split only four times.
    parts = text.strip().split("+", 4)
    if len(parts) != 5 or parts[0] != "PRIVATE" or parts[1] != "KEY":
        raise MalformedKey("a signer key reads PRIVATE+KEY+<name>+<key id>+<key>")
    name, id_hex, encoded = parts[2], parts[3], parts[4]
    _check_name(name)
    raw = _b64decode(encoded, "the signer key")
    if len(raw) != 33 or raw[0] != ALG_ED25519:
        raise MalformedKey("the signer key is not an Ed25519 key")
    key = SignerKey(name, raw[1:])
    if key.verifier().id.hex() != id_hex:
        raise MalformedKey("the signer key's id does not match its key")
    return key


def parse_verifier_key(text: str) -> VerifierKey:
    """Read a verifier key ``<name>+<id hex>+<base64>``; MalformedKey when it is not one."""
    parts = text.strip().split("+", 2)
    if len(parts) != 3:
        raise MalformedKey("a verifier key reads <name>+<key id>+<key>")
    name, id_hex, encoded = parts
    _check_name(name)
    raw = _b64decode(encoded, "the verifier key")
    if len(raw) != 33 or raw[0] != ALG_ED25519:
        raise MalformedKey("the verifier key is not an Ed25519 key")
    public = raw[1:]
    if key_id(name, public).hex() != id_hex:
        raise MalformedKey("the verifier key's id does not match its key")
    return VerifierKey(name, bytes.fromhex(id_hex), public)


# --- signed notes ----------------------------------------------------------------------------------


def _check_text(text: str) -> None:
    if not text.endswith("\n"):
        raise MalformedNote("a note's text ends with a newline")
    if "\n\n" in text or text.startswith("\n"):
        raise MalformedNote("a note's text has no blank lines (the blank line ends the text)")
    if any(ord(c) < 0x20 and c != "\n" for c in text):
        raise MalformedNote("a note has no control characters other than newline")


def sign_note(text: str, key: SignerKey) -> str:
    """``text`` followed by a blank line and ``key``'s signature line."""
    _check_text(text)
    v = key.verifier()
    signature = base64.b64encode(v.id + key.sign(text.encode())).decode()
    return f"{text}\n{SIGNATURE_PREFIX}{key.name} {signature}\n"


def open_note(note: str | bytes, verifier: VerifierKey) -> str:
    """The text of ``note`` once ``verifier``'s signature on it checks; CheckpointError otherwise.

    Lines signed by other keys are ignored (a witness may have cosigned), as the spec requires.
    """
    if isinstance(note, bytes):
        if len(note) > MAX_NOTE_BYTES:
            raise MalformedNote("the note is too large")
        try:
            note = note.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedNote("a note is UTF-8") from None
    if len(note.encode()) > MAX_NOTE_BYTES:
        raise MalformedNote("the note is too large")
    if any(ord(c) < 0x20 and c != "\n" for c in note):
        raise MalformedNote("a note has no control characters other than newline")
    split = note.rfind("\n\n")
    if split < 0 or not note.endswith("\n"):
        raise MalformedNote("a note is its text, a blank line, then signature lines")
    text, block = note[:split + 1], note[split + 2:]
    _check_text(text)
    lines = block[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise MalformedNote(f"a note has at most {MAX_SIGNATURES} signatures")
    found = False
    for line in lines:
        if not line.startswith(SIGNATURE_PREFIX):
            raise MalformedNote("a signature line starts with an em dash and a space")
        name, sep, encoded = line[len(SIGNATURE_PREFIX):].partition(" ")
        if not sep or not name or " " in encoded:
            raise MalformedNote("a signature line is '\u2014 <key name> <base64 signature>'")
        try:
            raw = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise MalformedNote("a signature is standard base64") from None
        if base64.b64encode(raw).decode() != encoded:
            # The last character of a padded group has bits the decoder ignores: without this, a note
            # with one of them flipped would verify although its bytes are not the signed note's.
            raise MalformedNote("a signature is canonical standard base64")
        if len(raw) < 5:
            raise MalformedNote("a signature holds a key id and the signature")
        if name != verifier.name or raw[:4] != verifier.id:
            continue  # another key's signature: not ours to judge
        found = True
        try:
            Ed25519PublicKey.from_public_bytes(verifier.public_key).verify(raw[4:], text.encode())
        except InvalidSignature:
            raise BadSignature(f"the signature by {verifier.name} does not verify") from None
    if not found:
        raise UnsignedNote(f"the note carries no signature by {verifier.name}+{verifier.id.hex()}")
    return text


# --- checkpoints -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A commitment to the history's Merkle tree: origin, tree size and root hash."""

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def body(self) -> str:
        """The checkpoint's note text."""
        if len(self.root) != 32 or self.size < 0:
            raise MalformedCheckpoint("a checkpoint has a 32-byte root and a non-negative size")
        _check_name(self.origin)
        lines = [self.origin, str(self.size), base64.b64encode(self.root).decode(), *self.extensions]
        if any(not line for line in lines):
            raise MalformedCheckpoint("checkpoint lines are non-empty")
        return "".join(f"{line}\n" for line in lines)


def parse_checkpoint(text: str) -> Checkpoint:
    """A checkpoint from a note's (already verified) text; MalformedCheckpoint when not one."""
    lines = text.split("\n")
    if len(lines) < 4 or lines[-1] != "":
        raise MalformedCheckpoint("a checkpoint is origin, size and root hash lines")
    origin, size_text, root_text, *extensions = lines[:-1]
    if not origin:
        raise MalformedCheckpoint("the origin line is empty")
    if not _DECIMAL.fullmatch(size_text):
        raise MalformedCheckpoint("the tree size is a decimal number without leading zeros")
    try:
        root = base64.b64decode(root_text, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedCheckpoint("the root hash is standard base64") from None
    if len(root) != 32 or base64.b64encode(root).decode() != root_text:
        raise MalformedCheckpoint("the root hash is 32 bytes in canonical base64")
    if any(not e for e in extensions):
        raise MalformedCheckpoint("extension lines are non-empty")
    return Checkpoint(origin, int(size_text), root, tuple(extensions))


def sign_checkpoint(checkpoint: Checkpoint, key: SignerKey) -> str:
    """The signed note of ``checkpoint``; the key's name should be the checkpoint's origin."""
    return sign_note(checkpoint.body(), key)


def verify_checkpoint(note: str | bytes, verifier: VerifierKey, *, origin: str | None = None) -> Checkpoint:
    """The checkpoint in ``note`` once its signature checks and its origin is the expected one
    (``origin``, else the key's name)."""
    checkpoint = parse_checkpoint(open_note(note, verifier))
    expected = verifier.name if origin is None else origin
    if checkpoint.origin != expected:
        raise OriginMismatch(f"the checkpoint's origin is {checkpoint.origin!r}, expected {expected!r}")
    return checkpoint


class NotAnExtension(CheckpointError):
    """A newer checkpoint does not extend an older one: the history was rewritten (or forked)."""

    kind = "does_not_extend"


def check_extends(older: Checkpoint, newer: Checkpoint, proof: Sequence[bytes]) -> None:
    """Raise NotAnExtension unless ``newer``'s tree has ``older``'s as its prefix, as shown by the
    RFC 9162 consistency ``proof`` from older.size to newer.size (how a mirror accepts a new one)."""
    if older.origin != newer.origin:
        raise NotAnExtension(f"checkpoints of different logs ({older.origin!r}, {newer.origin!r})")
    if newer.size < older.size:
        raise NotAnExtension(f"tree size went down from {older.size} to {newer.size}")
    if not verify_consistency(older.size, newer.size, older.root, newer.root, proof):
        raise NotAnExtension(f"the tree of size {newer.size} does not extend the tree of size {older.size}")
