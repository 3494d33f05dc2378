"""A deployment of separate OS processes for tests: the Procfile's process types on one database
and RabbitMQ virtual host, each started from its Procfile line, all stopped and checked on exit."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from actors.publisher import active_publisher
from tests import procs

#: Seconds the web front waits for the writer before answering 504 (short: retried writes go quickly).
COMMAND_TIMEOUT = 5.0
#: Seconds a process may take to start.
WAIT = 60.0
STARTED = {"writer": r"ToastMachine running writer", "publisher": r"ToastMachine running publisher",
           "mcp": r"ToastMachine MCP at (http://\S+)",
           "archiver": r"ToastMachine running archiver"}


def procfile() -> dict[str, str]:
    """The Procfile as ``{process type: command line}``."""
    out: dict[str, str] = {}
    for line in (procs.ROOT / "Procfile").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, command = line.partition(":")
            out[name.strip()] = command.strip()
    return out


@dataclass
class Deployment:
    """Processes of the Procfile's types on one database and virtual host, stopped on exit."""

    env: dict[str, str]
    database_url: str
    commands: dict[str, str] = field(default_factory=procfile)
    processes: dict[str, procs.NodeProcess] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    #: The MCP URL (``…/mcp``) of each ``mcp`` process, by name.
    mcp_urls: dict[str, str] = field(default_factory=dict)

    async def start(self, kind: str, name: str, **env: str) -> procs.NodeProcess:
        """Start process type ``kind`` as ``name`` (its node id) and wait for its start line."""
        extra = {"TOASTMACHINE_NODE_ID": name, **env}
        if kind in ("web", "mcp"):  # their Procfile lines take the port from PORT
            extra.setdefault("PORT", str(procs.free_port()))
        proc = await procs.start(env={**self.env, **extra}, program=("/bin/sh", "-c", self.commands[kind]))
        self.processes[name] = proc
        if kind == "web":
            url = await proc.wait_listening(timeout=WAIT)
            assert url.endswith(":" + extra["PORT"]), url
            self.urls[name] = url
        else:
            match = await proc.wait_for_line(STARTED[kind], timeout=WAIT)
            if kind == "mcp":
                self.mcp_urls[name] = match.group(1)
        return proc

    async def holder(self) -> str | None:
        """``application_name`` of the session holding the publisher lock."""
        conn = await asyncpg.connect(self.database_url)
        try:
            return await active_publisher(conn)
        finally:
            await conn.close()


@contextlib.asynccontextmanager
async def deployment(tmp_path: Path, amqp_url: str, database_url: str) -> AsyncIterator[Deployment]:
    """A deployment the test starts processes in; on exit every live process gets SIGTERM and must
    exit 0 without a traceback (a SIGKILLed one excepted)."""
    env = procs.clean_env(
        PATH=f"{Path(sys.executable).parent}:{procs.os.environ.get('PATH', '')}",
        TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_AMQP_URL=amqp_url,
        TOASTMACHINE_DATABASE_URL=database_url,
        TOASTMACHINE_WRITES_PER_SECOND="1000000", TOASTMACHINE_REGISTER_PER_MINUTE="100000",
        TOASTMACHINE_COMMAND_TIMEOUT=str(COMMAND_TIMEOUT), TOASTMACHINE_STREAM_HEARTBEAT="1")
    dep = Deployment(env=env, database_url=database_url)
    try:
        yield dep
    finally:
        live = [p for p in reversed(dep.processes.values()) if p.proc.returncode is None]
        await asyncio.gather(*(p.stop() for p in live), return_exceptions=True)
        for name, proc in dep.processes.items():  # kept in the test's temp dir for post-mortems
            (tmp_path / f"{name}.log").write_text("\n".join(proc.output) + "\n")
    for name, proc in dep.processes.items():
        if proc.proc.returncode == -signal.SIGKILL:
            continue
        tail = f"{name} (rc={proc.proc.returncode}):\n" + "\n".join(proc.output[-80:])
        assert proc.proc.returncode == 0, tail
        tracebacks = procs.unexpected_tracebacks(proc.output)
        assert not tracebacks, f"{name}: traceback:\n" + "\n".join(proc.output[tracebacks[0] - 3:tracebacks[0] + 30])
