"""Running ``toastmachine`` as real OS processes in tests: start, wait for its start line, signal, reap."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
LISTEN_RE = re.compile(r"listening on (http://\S+)")


def clean_env(**extra: str) -> dict[str, str]:
    """The parent's environment minus every TOASTMACHINE_* variable, plus ``extra``.

    The MCP front listens on a free port unless ``extra`` says otherwise (``toastmachine up`` starts it
    too, and a fixed default port would make concurrent test processes collide).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOASTMACHINE_")}
    env["TOASTMACHINE_MCP_PORT"] = "0"
    env.update(extra)
    return env


@dataclass
class NodeProcess:
    """A running ``toastmachine`` process and everything it printed so far."""

    proc: asyncio.subprocess.Process
    output: list[str] = field(default_factory=list)
    url: str | None = None
    _reader: asyncio.Task[None] | None = None
    _lines: asyncio.Queue[str] = field(default_factory=lambda: asyncio.Queue())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.output.append(line)
            await self._lines.put(line)

    async def wait_for_line(self, pattern: str | re.Pattern[str], timeout: float) -> re.Match[str]:
        """Wait for a printed line matching ``pattern``; fail with the output so far on timeout."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        for line in self.output:
            if m := rx.search(line):
                return m
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = await self._lines.get()
                    if m := rx.search(line):
                        return m
        except TimeoutError:
            raise AssertionError(f"no line matching {rx.pattern!r} within {timeout}s; output:\n"
                                 + "\n".join(self.output[-60:])) from None

    async def wait_listening(self, timeout: float = 60) -> str:
        self.url = (await self.wait_for_line(LISTEN_RE, timeout)).group(1)
        return self.url

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def wait(self, timeout: float = 60) -> int:
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
        if self._reader is not None:
            await self._reader
        return code

    async def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time (and fail the wait)."""
        self.signal(signal.SIGTERM)
        try:
            return await self.wait(timeout)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.proc.wait()
            raise


async def communicate(proc: asyncio.subprocess.Process, timeout: float) -> tuple[bytes, bytes]:
    """``proc.communicate()`` within ``timeout`` seconds: its stdout and stderr (``b""`` for one not
    piped). On a timeout the process is killed and reaped, then TimeoutError is raised."""
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return out or b"", err or b""


async def start(*args: str, env: Mapping[str, str], cwd: Path | None = None,
                program: tuple[str, ...] = (sys.executable, "-m", "toastmachine.cli")) -> NodeProcess:
    """Start ``toastmachine ARGS`` (stdout and stderr merged) and begin collecting its output."""
    proc = await asyncio.create_subprocess_exec(
        *program, *args, env=dict(env), cwd=str(cwd or ROOT),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=True)
    node = NodeProcess(proc)
    node._reader = asyncio.create_task(node._read())
    return node


async def get_json(url: str, timeout: float = 10) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, \
            session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        return resp.status, await resp.json()


#: Ports :func:`free_port` hands out: below the kernel's ephemeral range (32768-60999 on Linux), so an
#: outgoing connection's local port never takes one between the check and the server's bind.
PORT_RANGE = (10000, 32768)


def _worker_ports() -> range:
    """This test process's share of PORT_RANGE: one slice per pytest-xdist worker (``gw0``, ``gw1``…),
    so two workers never hand out the same port; the whole range without xdist."""
    low, high = PORT_RANGE
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return range(low, high)
    width = (high - low) // count
    start = low + int(worker[2:]) % count * width
    return range(start, start + width)


_PORTS = _worker_ports()
#: Where the next search starts: a random point of this process's slice (two runs of the suite on one
#: machine rarely start at the same place), then onwards, so a port just given away (to a server that
#: may not have bound it yet, or that stopped and may be started again on it) is not handed out again soon.
_next_port = random.randrange(len(_PORTS))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*offsets: int) -> int:
    """A TCP port that was free a moment ago (for processes that cannot report their own), with
    ``port + offset`` free too for each of ``offsets`` (honcho gives its process types port+100…)."""
    global _next_port
    for _ in range(len(_PORTS)):
        port = _PORTS[_next_port % len(_PORTS)]
        _next_port += 1
        if all(0 < port + o < 65536 and _bindable(port + o) for o in (0, *offsets)):
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def unexpected_tracebacks(output: list[str]) -> list[int]:
    """Lines starting a traceback. None is expected: the libraries' reports of a connection lost
    or refused are one line each (infra/logs.py), and our own expected faults are logged without one."""
    return [i for i, line in enumerate(output) if line.lstrip().startswith(("Traceback", "╭"))]
