"""Embedded PostgreSQL (pgserver): data survives a restart; a failed start says where to look."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import pytest
import structlog

from infra.db import Database, EmbeddedPostgres, start_embedded
from protocol.errors import DatabaseUnavailable
from tests.procs import ROOT, clean_env, communicate


async def _stop_all(servers: list[EmbeddedPostgres]) -> None:
    for server in servers:
        await server.stop()


async def _assert_unreachable(dsn: str) -> None:
    """Nothing answers at ``dsn`` any more, and saying so takes well under the connect timeout."""
    started = time.monotonic()
    try:
        db = await Database.connect(dsn, max_size=1, connect_timeout=5)
    except DatabaseUnavailable:
        assert time.monotonic() - started < 5
        return
    await db.close()
    raise AssertionError(f"a server still answers at {dsn}")


async def test_data_survives_a_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "not-yet" / "data"
    servers: list[EmbeddedPostgres] = []
    try:
        first = await start_embedded(data_dir)
        servers.append(first)
        assert first.data_dir == (data_dir / "postgres").resolve()
        assert first.log_path.is_file()
        db = await Database.connect(first.dsn, max_size=1)
        try:
            await db.pool.execute("create table kept (note text)")
            await db.pool.execute("insert into kept values ('still here')")
        finally:
            await db.close()
        await first.stop()
        await first.stop()  # idempotent

        # Stopped means stopped: nothing answers on its socket any more.
        await _assert_unreachable(first.dsn)

        second = await start_embedded(data_dir)
        servers.append(second)
        assert second.data_dir == first.data_dir
        db = await Database.connect(second.dsn, max_size=1)
        try:
            assert await db.pool.fetchval("select note from kept") == "still here"
        finally:
            await db.close()
    finally:
        await _stop_all(servers)


async def test_a_server_that_cannot_start_points_at_its_log(tmp_path: Path) -> None:
    servers: list[EmbeddedPostgres] = []
    try:
        servers.append(await start_embedded(tmp_path))
        await servers[-1].stop()
        conf = tmp_path / "postgres" / "postgresql.conf"
        original = conf.read_text()
        conf.write_text(original + "\nthis line is not a setting\n")

        with pytest.raises(DatabaseUnavailable) as err:
            await start_embedded(tmp_path)
        message = str(err.value)
        assert "did not start" in message
        assert str(tmp_path / "postgres" / "log") in message

        # Fixing the cause is enough: a retry in the same process starts cleanly.
        conf.write_text(original)
        servers.append(await start_embedded(tmp_path))
        db = await Database.connect(servers[-1].dsn, max_size=1)
        await db.close()
    finally:
        await _stop_all(servers)


async def test_a_data_dir_that_is_a_file_is_refused_clearly(tmp_path: Path) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("not a directory")
    with pytest.raises(DatabaseUnavailable, match="did not start"):
        await start_embedded(blocker)


_HOLDER = """
import asyncio, sys, time
from pathlib import Path
from infra.db import start_embedded

async def main():
    server = await start_embedded(Path(sys.argv[1]))
    print("READY " + server.dsn, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_killed_node_does_not_keep_the_server_alive_forever(tmp_path: Path) -> None:
    # A node killed with SIGKILL never lets go of the server; the next node to stop must stop it.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, str(tmp_path), cwd=ROOT, env=clean_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            # Unconfigured structlog also prints to stdout: skip its lines.
            while not (line := (await proc.stdout.readline()).decode()).startswith("READY "):
                assert line, "the holder process exited before its server was ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()

    server = await start_embedded(tmp_path)  # finds the orphaned server still running
    try:
        db = await Database.connect(server.dsn, max_size=1)
        await db.close()
    finally:
        await server.stop()
    await _assert_unreachable(server.dsn)


#: A node that lets go when told to (a line on stdin), as a stopping node does.
_POLITE_HOLDER = """
import asyncio, sys
from pathlib import Path
from infra.db import start_embedded

async def main():
    server = await start_embedded(Path(sys.argv[1]))
    print("READY " + server.dsn, flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await server.stop()

asyncio.run(main())
"""


async def test_a_command_beside_a_running_node_leaves_the_server_running(tmp_path: Path) -> None:
    """A one-shot command (``archive status``, ``guide set``) shares a running node's server: letting
    go says so (``db.embedded_left_running``), not ``db.embedded_stopped``, and the server stays up
    until the node itself stops."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _POLITE_HOLDER, str(tmp_path), cwd=ROOT, env=clean_env(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        async with asyncio.timeout(60):
            while not (line := (await proc.stdout.readline()).decode()).startswith("READY "):
                assert line, "the holder process exited before its server was ready"
        server = await start_embedded(tmp_path)
        with structlog.testing.capture_logs() as logs:
            await server.stop()
        events = [entry for entry in logs if entry["event"].startswith("db.embedded_")]
        assert [e["event"] for e in events] == ["db.embedded_left_running"], logs
        assert events[0]["used_by"] == [proc.pid]
        db = await Database.connect(server.dsn, max_size=1)  # still up for the node
        await db.close()
    finally:
        # The holder stops as a node does (a SIGKILL would leave its server running).
        assert proc.stdin is not None
        proc.stdin.write(b"stop\n")
        await proc.stdin.drain()
        async with asyncio.timeout(60):
            assert await proc.wait() == 0
    await _assert_unreachable(server.dsn)  # the node was the last user: its stop stopped the server


_START_AND_QUERY = """
import asyncio, sys
from pathlib import Path
from infra.db import Database, start_embedded

async def main() -> None:
    server = await start_embedded(Path(sys.argv[1]))
    try:
        db = await Database.connect(server.dsn, max_size=1)
        try:
            assert await db.pool.fetchval("select 1") == 1
        finally:
            await db.close()
    finally:
        await server.stop()

asyncio.run(main())
"""


async def test_processes_starting_new_servers_at_once_all_start(tmp_path: Path) -> None:
    """Several processes creating embedded servers at the same moment (a node's processes, or the
    suite's workers, on a new machine) each get a working server. Run as root, pgserver creates its
    system user on first use: unserialised, two ``useradd`` runs once left a data directory owned by
    a uid that no longer existed, and that server's initdb failed."""
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", _START_AND_QUERY, str(tmp_path / f"node-{i}"), cwd=ROOT, env=clean_env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        for i in range(3)
    ]
    outputs = await asyncio.gather(*(communicate(proc, 120) for proc in procs))
    for proc, (out, _) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
