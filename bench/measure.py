"""Measuring helpers shared by the benchmarks: closed-loop load and per-process CPU accounting.

:func:`drive` runs a closed loop of writes (any awaitable that answers None when accepted) and
collects their latencies; :class:`CpuMeter` reads the CPU time of process groups from ``/proc``
over an interval (Linux), so a benchmark can print CPU-milliseconds per operation per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg


@dataclass(slots=True)
class Round:
    """One measured run of ``count`` writes by one side."""

    elapsed: float
    latencies: list[float]  # seconds, accepted writes only
    failures: Counter[str]
    cpu: dict[str, float] = field(default_factory=dict)  # CPUs busy on average, per process group
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed

    def cpu_ms(self, group: str) -> float:
        """CPU-milliseconds of process ``group`` per accepted write."""
        return 1000 * self.cpu.get(group, 0.0) / self.rate if self.latencies else math.nan

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return 1000 * ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


async def drive(count: int, concurrency: int, write: Callable[[int, int], Awaitable[str | None]]) -> Round:
    """Run ``count`` writes, ``concurrency`` at a time, each worker ``i`` writing as its own agent.

    ``write(i, n)`` returns None when the write was accepted, else why not (a status or an error name).
    """
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    counter = iter(range(count))

    async def worker(i: int) -> None:
        for n in counter:
            started = time.perf_counter()
            try:
                failure = await write(i, n)
            except (aiohttp.ClientError, asyncpg.PostgresError, OSError, TimeoutError) as e:
                failure = type(e).__name__
            if failure is None:
                latencies.append(time.perf_counter() - started)
            else:
                failures[failure] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return Round(time.perf_counter() - started, latencies, failures)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _pids_named(name: str) -> list[int]:
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if (entry / "comm").read_text().strip() == name:
                pids.append(int(entry.name))
    return pids


def _machine_busy_seconds() -> float:
    """CPU seconds all CPUs spent not idle since boot (kernel network work included, which per-process
    times miss)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / _TICK  # minus idle and iowait


class CpuMeter:
    """CPU time of process groups over an interval, from /proc (Linux); empty elsewhere.

    The postgres and rabbitmq groups are every such process on the machine, other users' included;
    ``machine`` is every CPU's busy time.
    """

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.before = {pid: _cpu_seconds(pid) for pids in groups.values() for pid in pids}
        self.machine = _machine_busy_seconds() if groups else 0.0
        self.started = time.perf_counter()

    @classmethod
    def start(cls, own: dict[str, int]) -> CpuMeter:
        if not Path("/proc/self/stat").exists():
            return cls({})
        groups = {name: [pid] for name, pid in own.items()}
        groups["postgres"] = _pids_named("postgres")
        groups["rabbitmq"] = _pids_named("beam.smp")
        return cls(groups)

    def busy(self) -> dict[str, float]:
        """CPUs busy on average since :meth:`start`, per group."""
        wall = time.perf_counter() - self.started
        out = {}
        for name, pids in self.groups.items():
            used = 0.0
            for pid in pids:
                before, after = self.before.get(pid), _cpu_seconds(pid)
                if before is not None and after is not None:
                    used += after - before
            out[name] = used / wall
        if self.groups:
            out["machine"] = (_machine_busy_seconds() - self.machine) / wall
        return out
