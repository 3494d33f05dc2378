"""The node as users run it: real OS processes started through the CLI, stopped with real signals."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

import pytest

from infra.exclusive import hold_data_dir
from tests import procs, services

pytestmark = pytest.mark.timeout(180)

CORPUS_RE = re.compile(r"corpus: (\S+) lineage (\S+)")


async def test_up_on_embedded_defaults_serves_and_stops_cleanly(tmp_path: Path) -> None:
    """The README's run command: embedded PostgreSQL, in-process bus, /healthz within 15 s, clean SIGTERM."""
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "data"), TOASTMACHINE_PORT="0")
    node = await procs.start("up", env=env)
    try:
        url = await node.wait_listening(timeout=15)
        status, body = await procs.get_json(url + "/healthz")
        assert (status, body) == (200, {"status": "ok"})
        status, body = await procs.get_json(url + "/readyz")
        assert status == 200, body
        assert body["checks"]["database"] == "ok" and body["checks"]["bus"] == "ok"
        assert body["checks"]["actors"]["writer"]["state"] == "running"
        first = (await node.wait_for_line(CORPUS_RE, 1)).groups()
    finally:
        code = await node.stop()
    assert code == 0, "\n".join(node.output)
    assert "Traceback" not in "\n".join(node.output)

    # Data survives a restart: the same corpus identity comes back from the embedded database.
    node = await procs.start("up", env=env)
    try:
        await node.wait_listening(timeout=30)
        again = (await node.wait_for_line(CORPUS_RE, 1)).groups()
    finally:
        assert await node.stop() == 0
    assert again == first


async def test_sigint_also_stops_cleanly(tmp_path: Path) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "data"), TOASTMACHINE_PORT="0")
    node = await procs.start("up", env=env)
    await node.wait_listening(timeout=30)
    node.signal(signal.SIGINT)
    assert await node.wait() == 0


async def test_up_on_rabbitmq_and_postgres(tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """The same node on the machine's RabbitMQ and PostgreSQL."""
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_PORT="0",
                          TOASTMACHINE_AMQP_URL=rabbitmq_url, TOASTMACHINE_DATABASE_URL=database_url)
    node = await procs.start("up", env=env)
    try:
        url = await node.wait_listening(timeout=30)
        status, body = await procs.get_json(url + "/readyz")
        assert status == 200, body
        doctor = await procs.start("doctor", env=env)
        assert await doctor.wait() == 0, "\n".join(doctor.output)
        text = "\n".join(doctor.output)
        for name in ("config", "database", "migrations", "corpus", "bus", "writer"):
            assert re.search(rf"^{name}\s+ok\b", text, re.MULTILINE), text
    finally:
        assert await node.stop() == 0
    assert not (tmp_path / "postgres").exists(), "DATABASE_URL was set: no embedded server may start"


async def test_split_processes_need_amqp_url(tmp_path: Path) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path))
    for args in (("run", "writer"), ("web",)):
        proc = await procs.start(*args, env=env)
        assert await proc.wait() == 2
        text = "\n".join(proc.output)
        assert "TOASTMACHINE_AMQP_URL" in text and "toastmachine up" in text
        assert "Traceback" not in text
        assert not (tmp_path / "postgres").exists(), "refused before touching any service"


async def test_a_missing_amqp_url_is_said_before_a_held_data_directory(tmp_path: Path) -> None:
    """The usage error is what is wrong with the command line, even beside a running node (the
    README's `toastmachine web` next to `toastmachine up` on the same DATA_DIR)."""
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path))
    with hold_data_dir(tmp_path):  # as a running node holds it
        for args in (("web",), ("mcp",), ("run", "writer")):
            proc = await procs.start(*args, env=env)
            assert await proc.wait() == 2, proc.output
            text = "\n".join(proc.output)
            assert "TOASTMACHINE_AMQP_URL is not set" in text and "already using" not in text, text
            assert "Traceback" not in text


async def test_unknown_actor_is_a_usage_error(tmp_path: Path) -> None:
    proc = await procs.start("run", "nonesuch", env=procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path)))
    assert await proc.wait() == 2
    assert "invalid choice" in "\n".join(proc.output)


async def test_unreachable_services_fail_fast_with_clear_messages(tmp_path: Path) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path),
                          TOASTMACHINE_DATABASE_URL="postgresql://postgres:topsecret@127.0.0.1:1/tm")
    proc = await procs.start("migrate", env=env)
    assert await proc.wait(timeout=60) == 1
    text = "\n".join(proc.output)
    assert "toastmachine: PostgreSQL at" in text and "is unavailable" in text and "127.0.0.1:1" in text
    assert "topsecret" not in text and "Traceback" not in text


async def test_bus_unreachable_at_start(tmp_path: Path, database_url: str) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_DATABASE_URL=database_url,
                          TOASTMACHINE_AMQP_URL="amqp://guest:hush@127.0.0.1:1/")
    proc = await procs.start("run", "writer", env=env)
    assert await proc.wait(timeout=60) == 1
    text = "\n".join(proc.output)
    assert "toastmachine: cannot connect to RabbitMQ at" in text and "127.0.0.1:1" in text
    assert "hush" not in text and "Traceback" not in text


async def test_migrate_then_doctor(tmp_path: Path, database_url: str) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_DATABASE_URL=database_url)
    proc = await procs.start("migrate", env=env)
    assert await proc.wait() == 0, "\n".join(proc.output)
    proc = await procs.start("doctor", env=env)
    code = await proc.wait()
    text = "\n".join(proc.output)
    assert code == 0, text
    assert re.search(r"^migrations\s+ok\s+schema up to date", text, re.MULTILINE), text
    assert re.search(r"^bus\s+skip\b", text, re.MULTILINE), text


async def test_doctor_reports_each_failure(tmp_path: Path, database_url: str) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_DATABASE_URL=database_url,
                          TOASTMACHINE_AMQP_URL="amqp://guest:guest@127.0.0.1:1/")
    proc = await procs.start("doctor", env=env)
    assert await proc.wait() == 1
    text = "\n".join(proc.output)
    assert re.search(r"^database\s+ok\b", text, re.MULTILINE), text
    assert re.search(r"^bus\s+FAIL\b.*127\.0\.0\.1:1", text, re.MULTILINE), text
    # A fresh database's migrations are not a failure: every process applies them as it starts.
    assert re.search(r"^migrations\s+ok\s+\d+ pending \(0001", text, re.MULTILINE), text


async def test_procfile_under_honcho(tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """`honcho start` runs one process per Procfile line against RabbitMQ and PostgreSQL."""
    honcho = Path(sys.executable).with_name("honcho")
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_AMQP_URL=rabbitmq_url,
                          TOASTMACHINE_DATABASE_URL=database_url,
                          PATH=f"{honcho.parent}:{procs.os.environ.get('PATH', '')}")
    port = procs.free_port(300)  # honcho gives mcp, the Procfile's fourth line, port + 300
    group = await procs.start("start", "-p", str(port), env=env, program=(str(honcho),))
    try:
        await group.wait_for_line(r"writer\.1\s+\|.*ToastMachine running writer", timeout=60)
        url = await group.wait_listening(timeout=60)
        assert url.endswith(f":{port}")
        status, body = await procs.get_json(url + "/readyz")
        assert status == 200, body
        doctor = await procs.start("doctor", env=env)
        assert await doctor.wait() == 0, "\n".join(doctor.output)
        assert re.search(r"^writer\s+ok\s+answered a ping", "\n".join(doctor.output), re.MULTILINE)
    finally:
        code = await group.stop()
    text = "\n".join(group.output)
    # honcho reports the signal it was stopped by (143 for SIGTERM), whatever its children did;
    # what matters is that each process shut down cleanly on the SIGTERM honcho passed on.
    assert code == 143, text
    for name in ("web.1", "writer.1"):
        assert re.search(rf"{re.escape(name)} stopped \(rc=0\)", text), text
    assert "Traceback" not in text


async def _until_ready(url: str, timeout: float) -> dict:
    """Poll /readyz until it answers 200 (the only signal a separate process gives), or fail."""
    last: object = None
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    status, body = await procs.get_json(url + "/readyz", timeout=3)
                    if status == 200:
                        return body
                    last = body
                except (OSError, TimeoutError) as e:
                    last = e
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"not ready within {timeout}s; last answer: {last}") from None


async def _until_reconnected(url: str, timeout: float) -> None:
    """Poll /metrics until the bus reports a reconnect and is connected again."""
    import aiohttp

    rx = re.compile(r"^toastmachine_bus_reconnects_total\{[^}]*\} (\d+)", re.MULTILINE)
    async with asyncio.timeout(timeout), aiohttp.ClientSession() as session:
        while True:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            m = rx.search(text)
            if m and int(m.group(1)) >= 1 and 'toastmachine_bus_connected{backend="rabbitmq"} 1.0' in text:
                return
            await asyncio.sleep(0.2)


@pytest.mark.fault
async def test_node_recovers_when_the_broker_drops_every_connection(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_PORT="0",
                          TOASTMACHINE_AMQP_URL=rabbitmq_url, TOASTMACHINE_DATABASE_URL=database_url)
    node = await procs.start("up", env=env)
    try:
        url = await node.wait_listening(timeout=30)
        await _until_ready(url, 10)
        await services.drop_broker_connections(rabbitmq_url, "fault test: node recovery")
        await _until_reconnected(url, 30)
        body = await _until_ready(url, 30)
        assert body["checks"]["actors"]["writer"]["state"] == "running"
        doctor = await procs.start("doctor", env=env)
        assert await doctor.wait() == 0, "\n".join(doctor.output)
    finally:
        assert await node.stop() == 0


async def test_json_logs_cover_every_logger(tmp_path: Path, database_url: str) -> None:
    """LOG_FORMAT=json applies to loggers created at import time too: every log line is one JSON object."""
    import json

    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_DATABASE_URL=database_url,
                          TOASTMACHINE_LOG_FORMAT="json")
    proc = await procs.start("migrate", env=env)
    assert await proc.wait() == 0, "\n".join(proc.output)
    records = [json.loads(line) for line in proc.output if line.startswith("{")]
    others = [line for line in proc.output if line.strip() and not line.startswith("{")]
    assert others == [], others  # even the command's own report is a record in JSON mode
    assert {r["event"] for r in records} >= {"db.connected", "db.migration_applied", "db.closed", "migrate.applied"}
    assert all(r["logger"].startswith("toastmachine.") and r["level"] and r["timestamp"] for r in records)


async def test_a_malformed_store_or_node_url_is_a_usage_error(tmp_path: Path) -> None:
    """A URL that does not parse (an unclosed IPv6 bracket) is named on one line with exit 2, like
    any other bad argument, not a traceback from deep inside the command."""
    for args in (("mirror", "--from", "http://[::1/", "--public-key", "K", "--once"),
                 ("archive", "verify", "--from-store", "http://[::1/"),
                 ("archive", "restore", "--from", "s3://[bucket/x"),
                 ("mirror", "--from", "http://127.0.0.1:1/", "--archive", "http://host:port/", "--public-key", "K")):
        proc = await procs.start(*args, env=procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path)))
        assert await proc.wait() == 2, (args, proc.output)
        text = "\n".join(proc.output)
        assert "is not a URL or a path" in text and "Traceback" not in text, text


async def test_an_archive_directory_that_cannot_be_one_is_named_at_once(tmp_path: Path, database_url: str,
                                                                        rabbitmq_url: str) -> None:
    """TOASTMACHINE_ARCHIVE_URL naming a regular file: ``run archiver`` exits 2 with one line naming
    the directory (it hung, printing nothing, its supervising task ended by the factory's
    FileExistsError), and ``archive status`` and ``verify`` say the same without a traceback."""
    occupied = tmp_path / "not-a-directory"
    occupied.write_text("x")
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "data"), TOASTMACHINE_DATABASE_URL=database_url,
                          TOASTMACHINE_AMQP_URL=rabbitmq_url, TOASTMACHINE_ARCHIVE_URL=str(occupied))
    for args in (("run", "archiver"), ("archive", "status"), ("archive", "verify")):
        proc = await procs.start(*args, env=env)
        async with asyncio.timeout(60):
            assert await proc.wait() == 2, (args, proc.output)
        text = "\n".join(proc.output)
        assert f"the archive directory {occupied} cannot be used" in text and "Traceback" not in text, (args, text)
