"""Embedded PostgreSQL (the ``pgserver`` package) for a node run without DATABASE_URL.

The server's files live in ``<DATA_DIR>/postgres`` and survive restarts. It listens on a unix socket
only (no TCP port to collide with). pgserver's calls block for seconds (initdb, pg_ctl), so they run
in a worker thread.

pgserver keeps one handle per data directory per process and a list of the processes using a
server on disk; the server stops when the last of them lets go. Start at most one
:class:`EmbeddedPostgres` per data directory per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.logs import get_logger
from protocol.errors import DatabaseUnavailable

log = get_logger("toastmachine.db.embedded")


@dataclass(slots=True)
class EmbeddedPostgres:
    """A running embedded server. Connect with :attr:`dsn`; call :meth:`stop` when done."""

    #: PostgreSQL's data directory, ``<DATA_DIR>/postgres``.
    data_dir: Path
    #: Where the server writes its own log; look here when it will not start.
    log_path: Path
    #: Unix-socket DSN of the ``postgres`` database (no password: the socket is trust-only).
    dsn: str
    _server: Any = field(repr=False)
    _stopped: bool = field(default=False, repr=False)

    async def stop(self) -> None:
        """Stop the server (unless another process still uses it); safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        try:
            others = await asyncio.to_thread(_stop, self._server)
        except Exception as e:  # noqa: BLE001 - shutdown goes on; the server log says more
            log.error("db.embedded_stop_failed", data_dir=str(self.data_dir), server_log=str(self.log_path),
                      error=f"{type(e).__name__}: {_first_line(e)}")
            return
        if others:
            # A one-shot command beside a running node: saying "stopped" here would read as if the
            # node had lost its database.
            log.info("db.embedded_left_running", data_dir=str(self.data_dir), used_by=others)
        else:
            log.info("db.embedded_stopped", data_dir=str(self.data_dir))


async def start_embedded(data_dir: Path) -> EmbeddedPostgres:
    """Start (creating it on first use) the embedded PostgreSQL under ``data_dir / "postgres"``.

    Creates ``data_dir`` if missing. A server already running on that directory (another process
    of this node) is shared, not started twice. Raises DatabaseUnavailable, pointing at the
    server's log file, when it cannot start.
    """
    pgdata = (Path(data_dir).expanduser() / "postgres").resolve()
    log_path = pgdata / "log"
    # Said before the (possibly slow, first-time initdb) start, so a hang still shows where to look.
    log.info("db.embedded_starting", data_dir=str(pgdata), server_log=str(log_path))
    try:
        server = await asyncio.to_thread(_start, pgdata)
    except Exception as e:  # pgserver raises anything from AssertionError to CalledProcessError
        hint = f"see the server log at {log_path}" if log_path.exists() else f"check that {pgdata.parent} is a writable directory"
        raise DatabaseUnavailable(
            f"embedded PostgreSQL in {pgdata} did not start ({type(e).__name__}: {_first_line(e)}); {hint}"
        ) from e
    # pgserver writes an empty password ("postgres:@"); without it the DSN reads (and logs) cleanly.
    dsn = server.get_uri().replace("://postgres:@", "://postgres@", 1)
    log.info("db.embedded_started", data_dir=str(pgdata), server_log=str(log_path), pid=server.get_pid())
    return EmbeddedPostgres(data_dir=pgdata, log_path=log_path, dsn=dsn, _server=server)


def _start(pgdata: Path) -> Any:
    # Imported here: pgserver probes the platform (and may warn) at import time, which only
    # embedded mode should pay for.
    import pgserver

    pgdata.parent.mkdir(parents=True, exist_ok=True)
    _ensure_system_user()
    try:
        return pgserver.get_server(pgdata, cleanup_mode="stop")
    except BaseException:
        # pgserver caches the handle before starting the server, so a failed start would be
        # handed back, still broken, to every retry in this process. Forget it.
        getattr(pgserver.PostgresServer, "_instances", {}).pop(pgdata, None)
        raise


#: Run as root, pgserver runs PostgreSQL as this system user, which it creates on first use.
SYSTEM_USER = "pgserver"

#: Machine-wide: every process of every node (and test worker) on this machine takes the same lock.
_USER_LOCK = Path(tempfile.gettempdir()) / "toastmachine-pgserver-user.lock"


def _ensure_system_user() -> None:
    """As root, create pgserver's system user before pgserver looks for it, under a machine-wide lock.

    pgserver checks for the user and runs ``useradd`` without a lock: processes starting embedded
    servers at once on a new machine (a node's processes, the test workers) each ran ``useradd``, and
    one had already chowned its data directory to a uid that the others' accounts then replaced, so
    its ``initdb`` failed ("could not change permissions"). Once the user exists this is one lookup.
    """
    if os.geteuid() != 0:
        return
    import pwd

    from pgserver.utils import ensure_user_exists

    with contextlib.suppress(KeyError):
        pwd.getpwnam(SYSTEM_USER)
        return
    with open(_USER_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        ensure_user_exists(SYSTEM_USER)


def _stop(server: Any) -> list[int]:
    """Let go of the server, stopping it if this process was its last user; return the PIDs of
    the other processes still using it (then it keeps running)."""
    _forget_dead_handles(server)
    try:
        others = sorted(pid for pid in server.global_process_id_list.get() if pid != os.getpid())
    except Exception:  # noqa: BLE001 - pgserver's internals; only the log line depends on it
        others = []
    server.cleanup()
    return others


def _forget_dead_handles(server: Any) -> None:
    """Drop processes that died without letting go from pgserver's on-disk list of users.

    pgserver stops the server only when the calling process is the last one in that list; a node
    killed with SIGKILL stays in it forever, and the server would then outlive every later node.
    Best effort: this reaches into pgserver's internals, so any surprise leaves the list alone.
    """
    try:
        handles = server.global_process_id_list
        with server._lock:
            pids = handles.get()
            alive = [pid for pid in pids if pid == os.getpid() or _pid_alive(pid)]
            if alive != pids:
                handles.put(alive)
                log.info("db.embedded_forgot_dead_processes", pids=sorted(set(pids) - set(alive)))
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.debug("db.embedded_handle_cleanup_skipped", error=type(e).__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "no details"
