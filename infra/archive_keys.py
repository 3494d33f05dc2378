"""The checkpoint signing key: configured, or generated once per corpus and kept under DATA_DIR.

``TOASTMACHINE_ARCHIVE_SIGNING_KEY`` (a ``PRIVATE+KEY+...`` signer key, see protocol/checkpoint.py)
wins. Without it the key lives in ``DATA_DIR/archive-signing-key`` (mode 0600): read when present,
otherwise generated and linked into place atomically, so two processes starting together end up
with the same key (the loser of the race reads the winner's file). The operator must back this file up:
checkpoints signed by a lost key can still be checked with the published public key, but new ones
would need a new key that mirrors do not trust.

The key is named after the archive's origin; a stored key with another name belongs to another
corpus and is refused rather than silently reused.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from infra.config import Settings
from protocol.checkpoint import CheckpointError, SignerKey, generate_signer_key, parse_signer_key
from protocol.errors import ConfigError

KEY_FILE = "archive-signing-key"


def archive_origin(corpus_id: uuid.UUID) -> str:
    """The checkpoint origin (and key name) of a corpus: stable across restores (a restored history
    keeps its corpus and its key; its checkpoints live under the new lineage)."""
    return f"toastmachine.archive/{corpus_id}"


def load_signing_key(settings: Settings, name: str) -> SignerKey:
    """The signer key for origin ``name``: from configuration, else the key file (created if absent)."""
    return load_signing_key_noting(settings, name)[0]


def load_signing_key_noting(settings: Settings, name: str) -> tuple[SignerKey, Path | None]:
    """:func:`load_signing_key`, and the key file when this call created it (None otherwise): a
    process refused for that key (not the corpus's) removes it again, so that no unused key is
    left for an operator to back up as the corpus's (:func:`discard_generated`)."""
    if settings.archive_signing_key is not None:
        key = parse_signer_key(settings.archive_signing_key)  # already checked by Settings
        if key.name != name:
            raise ConfigError(f"TOASTMACHINE_ARCHIVE_SIGNING_KEY is named {key.name!r}, this archive's origin "
                              f"is {name!r}")
        return key, None
    return _from_file(settings.data_dir / KEY_FILE, name)


def discard_generated(path: Path, key: SignerKey) -> None:
    """Remove the key file ``path`` this process created for ``key``, if it still holds that key."""
    try:
        if path.read_text().strip() == key.text():
            path.unlink()
    except OSError:
        pass  # gone already, or not ours to remove: nothing to undo


def _from_file(path: Path, name: str) -> tuple[SignerKey, Path | None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return _read(path, name), None
    candidate = generate_signer_key(name)
    # Write a complete private file (0600: the seed is for its owner only), then hard-link it into
    # place: link() fails if the name exists, so the key file appears whole, once, and a process
    # that loses the race reads the winner's key.
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(candidate.text() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            return _read(path, name), None
        return candidate, path
    finally:
        temp.unlink(missing_ok=True)


def _read(path: Path, name: str) -> SignerKey:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the archive signing key {path}: {e.strerror}") from None
    try:
        key = parse_signer_key(text)
    except CheckpointError as e:
        raise ConfigError(f"the archive signing key {path} is not a signer key: {e}") from None
    if key.name != name:
        raise ConfigError(f"the archive signing key {path} is named {key.name!r}, this archive's origin is "
                          f"{name!r}: it belongs to another corpus (give each corpus its own TOASTMACHINE_DATA_DIR, "
                          "or set TOASTMACHINE_ARCHIVE_SIGNING_KEY to this corpus's key)")
    return key
