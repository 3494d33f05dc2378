"""The checkpoint signing key: configured, or generated once under DATA_DIR and reused, even when
several processes start at the same moment; never printed."""

from __future__ import annotations

import asyncio
import stat
import sys
import uuid
from pathlib import Path

import pytest

from infra.archive_keys import KEY_FILE, archive_origin, load_signing_key
from infra.config import Settings
from protocol.checkpoint import Checkpoint, generate_signer_key, sign_checkpoint, verify_checkpoint
from protocol.errors import ConfigError
from tests.procs import ROOT, clean_env

CORPUS = uuid.UUID("5d0c1b2a-3948-4756-a5b4-c3d2e1f0a9b8")
ORIGIN = archive_origin(CORPUS)


def test_generated_once_private_and_reused(tmp_path: Path) -> None:
    settings = Settings.from_env({"TOASTMACHINE_DATA_DIR": str(tmp_path)})
    key = load_signing_key(settings, ORIGIN)
    path = tmp_path / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_signing_key(settings, ORIGIN) == key
    # What it signs verifies with the public key it publishes.
    note = sign_checkpoint(Checkpoint(ORIGIN, 1, bytes(32)), key)
    assert verify_checkpoint(note, key.verifier()).size == 1
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_a_generated_key_file_is_noted_and_can_be_discarded(tmp_path: Path) -> None:
    """The call that creates the key file says so (a refused archiver removes what it made); a
    later call, or a configured key, notes none; a file holding another key is never removed."""
    from infra.archive_keys import discard_generated, load_signing_key_noting

    settings = Settings.from_env({"TOASTMACHINE_DATA_DIR": str(tmp_path)})
    key, made = load_signing_key_noting(settings, ORIGIN)
    assert made == tmp_path / KEY_FILE
    assert load_signing_key_noting(settings, ORIGIN) == (key, None)
    discard_generated(made, generate_signer_key(ORIGIN))  # not its key: kept
    assert made.exists()
    discard_generated(made, key)
    assert not made.exists()
    configured = Settings.from_env({"TOASTMACHINE_DATA_DIR": str(tmp_path),
                                    "TOASTMACHINE_ARCHIVE_SIGNING_KEY": key.text()})
    assert load_signing_key_noting(configured, ORIGIN) == (key, None) and not made.exists()


def test_a_key_of_another_corpus_is_refused(tmp_path: Path) -> None:
    settings = Settings.from_env({"TOASTMACHINE_DATA_DIR": str(tmp_path)})
    load_signing_key(settings, ORIGIN)
    with pytest.raises(ConfigError, match="another corpus"):
        load_signing_key(settings, archive_origin(uuid.uuid4()))


def test_configured_key_wins_and_is_never_printed(tmp_path: Path) -> None:
    configured = generate_signer_key(ORIGIN)
    settings = Settings.from_env({"TOASTMACHINE_DATA_DIR": str(tmp_path),
                                  "TOASTMACHINE_ARCHIVE_SIGNING_KEY": configured.text()})
    assert load_signing_key(settings, ORIGIN) == configured
    assert not (tmp_path / KEY_FILE).exists()
    assert settings.redacted()["archive_signing_key"] == "***"
    assert configured.text() not in repr(settings.redacted())
    with pytest.raises(ConfigError):
        load_signing_key(settings, archive_origin(uuid.uuid4()))


def test_a_bad_configured_key_stops_start_up_without_echoing_it() -> None:
    bad = "PRIVATE+KEY+name+00000000+c2VjcmV0LXNlZWQtdGhhdC1pcy1ub3QtYS1rZXk="
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({"TOASTMACHINE_ARCHIVE_SIGNING_KEY": bad})
    assert "TOASTMACHINE_ARCHIVE_SIGNING_KEY" in str(caught.value)
    assert "c2VjcmV0" not in str(caught.value)


def test_a_corrupt_key_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE).write_text("not a key\n")
    with pytest.raises(ConfigError, match="not a signer key"):
        load_signing_key(Settings.from_env({"TOASTMACHINE_DATA_DIR": str(tmp_path)}), ORIGIN)


async def test_processes_starting_together_agree_on_one_key(tmp_path: Path) -> None:
    script = ("import sys; from pathlib import Path; from infra.config import Settings; "
              "from infra.archive_keys import load_signing_key; "
              "s = Settings.from_env({'TOASTMACHINE_DATA_DIR': sys.argv[1]}); "
              "print(load_signing_key(s, sys.argv[2]).verifier().text())")
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", script, str(tmp_path), ORIGIN,
                                                  cwd=ROOT, env=clean_env(), stdout=asyncio.subprocess.PIPE)
             for _ in range(6)]
    outputs = [(await asyncio.wait_for(p.communicate(), 60))[0].decode().strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outputs)) == 1
    assert load_signing_key(Settings.from_env({"TOASTMACHINE_DATA_DIR": str(tmp_path)}),
                            ORIGIN).verifier().text() == outputs[0]
