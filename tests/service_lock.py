"""The machine's service lock: tests that act on RabbitMQ or PostgreSQL for everyone do not overlap others.

The suite runs in parallel (pytest-xdist workers, and possibly other runs of it on the same machine),
and almost every test keeps to its own virtual host, database, ports and directories. A few act on the
services machine-wide (``rabbitmqctl stop_app`` takes the broker away from every connection); those are
marked ``@pytest.mark.exclusive`` and must run alone.

A readers-writer lock on files under :data:`LOCK_DIR` (``flock``, so a killed process lets go at
once): every test holds ``services.lock`` shared for its setup, call and teardown; an exclusive test
holds it exclusively. ``flock`` alone would starve the exclusive test (some worker always holds the lock
shared), so a second file, ``services.gate``, gives the writer priority: anyone acquiring the lock
passes the gate first (taking it exclusively, only while acquiring), and the exclusive test keeps the
gate closed while it waits for the running tests to finish, so no new test starts meanwhile.

The files are machine-wide (the system's temporary directory, not the run's), because what an exclusive
test does reaches every run on the machine, not just this one's workers.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: Where the lock files live; shared by every run of the suite on this machine.
LOCK_DIR = Path(tempfile.gettempdir()) / "toastmachine-test-locks"


class ServiceLock:
    """A writer-priority readers-writer lock between processes, on two files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._gate: int | None = None
        self._lock: int | None = None

    def _open(self) -> tuple[int, int]:
        # Opened on first use, not at import: collection alone (or --help) creates no files.
        if self._gate is None or self._lock is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._gate = self._open_shared(self.directory / "services.gate")
            self._lock = self._open_shared(self.directory / "services.lock")
        return self._gate, self._lock

    def _open_shared(self, path: Path) -> int:
        """``path`` opened read-write (created if missing), then made readable and writable by
        every user, whatever the umask, so that runs by other users of a shared machine can lock
        it too (best effort: only its owner can change its mode, and the directory is sticky)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, 0o666)
            os.chmod(self.directory, 0o1777)
        return fd

    @contextlib.contextmanager
    def held(self, *, exclusive: bool) -> Iterator[None]:
        """Hold the lock for the block: shared, or alone when ``exclusive``."""
        gate, lock = self._open()
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
