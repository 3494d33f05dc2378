"""What one serving process must own alone: its embedded database's data directory, and its port.

Both checks run before anything starts, so a second node started by mistake exits at once with a
sentence saying why, instead of crash-looping on the port or, worse, attaching a second writer to
the same embedded database.

- The data directory is claimed with an exclusive ``fcntl.flock`` on ``DATA_DIR/toastmachine.lock``
  held for the life of the process. The kernel drops the lock when the process dies, however it
  dies (SIGKILL included), so a stale lock file never blocks the next start; the PID written into
  it is only there to make the message useful.
- The port is probed by binding it (with the same ``SO_REUSEADDR`` the server uses) and letting it
  go again: a port another process listens on fails that bind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from protocol.errors import ConfigError, ToastMachineError

LOCK_FILE = "toastmachine.lock"


class AlreadyInUse(ToastMachineError):
    """Another process holds what this one needs alone (the data directory or the port)."""


@contextlib.contextmanager
def hold_data_dir(data_dir: Path) -> Iterator[Path]:
    """Hold the exclusive lock on ``data_dir`` (created if missing) for the duration of the block.

    Raises AlreadyInUse naming the holder's PID when another process holds it.
    """
    data_dir = Path(data_dir).expanduser()
    path = data_dir.resolve() / LOCK_FILE
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        # O_CLOEXEC: the embedded PostgreSQL we start must not inherit (and so prolong) the lock.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ConfigError(f"TOASTMACHINE_DATA_DIR={str(data_dir)!r} cannot hold the lock file {LOCK_FILE} "
                          f"({e.strerror}); it must be a writable directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise AlreadyInUse(
                f"another toastmachine process (pid {holder}) is already using the data directory "
                f"{data_dir.resolve()}; stop it first, or give this one its own TOASTMACHINE_DATA_DIR") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def check_can_listen(host: str, port: int, *, host_var: str = "TOASTMACHINE_HOST",
                     port_var: str = "TOASTMACHINE_PORT") -> None:
    """Fail now, with one sentence, if the web front (or, with its variables named, the MCP front)
    could not listen on ``host:port``.

    Raises AlreadyInUse when another process listens there, ConfigError (naming the variable) when
    the address cannot be used on this machine at all (unknown host, not a local address, a
    privileged port). Otherwise the server would crash-loop on the bind until its start deadline.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"{host_var}={host!r} does not resolve ({e.strerror})") from None
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise AlreadyInUse(
                        f"port {port} on {host} is already in use by another process; stop it, or set "
                        f"{port_var} to a free port (0 picks one)") from None
                variable = port_var if e.errno == errno.EACCES else host_var
                raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); check {variable}") from None


def free_port(host: str) -> int:
    """A port that is free on ``host`` now (the OS's pick for port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
