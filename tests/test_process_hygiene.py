"""Process hygiene (issue 9, item 6), through real ``toastmachine`` processes on the embedded database.

A second node on the same data directory or port exits non-zero at once with one clear sentence;
in JSON log mode every line a node writes is one JSON object; ``migrate`` says when there was
nothing to do; the ``Server`` header names the product, not the framework and its version.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests import procs

pytestmark = pytest.mark.timeout(180)


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = procs.clean_env(**{"TOASTMACHINE_DATA_DIR": str(data_dir), "TOASTMACHINE_PORT": "0", **extra})
    # Without XDG_RUNTIME_DIR, platformdirs (used by pgserver) warns on every embedded start: the
    # situation of a container or a systemd service, and the one the JSON-log test must cover.
    env.pop("XDG_RUNTIME_DIR", None)
    return env


async def test_second_up_on_the_same_data_dir_exits_at_once(tmp_path: Path) -> None:
    env = _env(tmp_path / "data")
    first = await procs.start("up", env=env)
    try:
        url = await first.wait_listening(timeout=60)
        second = await procs.start("up", env=env)
        code = await second.wait(timeout=15)
        text = "\n".join(second.output)
        assert code == 1, text
        assert "already using the data directory" in text and str((tmp_path / "data").resolve()) in text, text
        assert "Traceback" not in text and "listening on" not in text, text
        # Refused before it touched the database: it never started (or attached to) the embedded server.
        assert "db.embedded_starting" not in text and "db.connected" not in text, text
        status, _ = await procs.get_json(url + "/readyz")
        assert status == 200
    finally:
        assert await first.stop() == 0
    # The lock goes with the process that held it: the next node starts on the same directory.
    again = await procs.start("up", env=env)
    try:
        await again.wait_listening(timeout=60)
    finally:
        assert await again.stop() == 0


async def test_second_node_on_a_busy_port_exits_at_once_without_a_traceback(tmp_path: Path) -> None:
    first = await procs.start("up", env=_env(tmp_path / "one"))
    try:
        port = str(urlsplit(await first.wait_listening(timeout=60)).port)
        second = await procs.start("up", env=_env(tmp_path / "two", TOASTMACHINE_PORT=port))
        code = await second.wait(timeout=15)
        text = "\n".join(second.output)
        assert code == 1, text
        expected = (f"toastmachine: port {port} on 127.0.0.1 is already in use by another process; stop it, "
                    "or set TOASTMACHINE_PORT to a free port (0 picks one)")
        assert [line for line in second.output if line.strip()] == [expected], text
    finally:
        assert await first.stop() == 0


async def test_a_signing_key_of_another_corpus_stops_up_at_once_with_exit_2(tmp_path: Path) -> None:
    """A data directory that holds another corpus's archive signing key (a scale-out pointed at the
    ``./data`` of an earlier ``up``): a configuration error, said once and not retried, exit 2."""
    from infra.archive_keys import KEY_FILE
    from protocol.checkpoint import generate_signer_key

    data = tmp_path / "data"
    data.mkdir()
    (data / KEY_FILE).write_text(generate_signer_key(f"toastmachine.archive/{uuid.uuid4()}").text() + "\n")
    node = await procs.start("up", env=_env(data))
    code = await node.wait(timeout=90)
    text = "\n".join(node.output)
    assert code == 2, text
    last = [line for line in node.output if line.strip()][-1]
    assert last.startswith(f"toastmachine: the archive signing key {data / KEY_FILE} is named "), text
    assert "belongs to another corpus" in last and "TOASTMACHINE_DATA_DIR" in last, text
    assert "actor.misconfigured" in text and "actor.crashed" not in text, text
    assert not procs.unexpected_tracebacks(node.output), text
    assert "PRIVATE+KEY" not in text  # the key itself is never printed


async def test_json_log_mode_writes_only_json_lines(tmp_path: Path) -> None:
    env = _env(tmp_path / "data", TOASTMACHINE_LOG_FORMAT="json")
    node = await procs.start("up", env=env)
    try:
        url = await node.wait_listening(timeout=60)
        status, _ = await procs.get_json(url + "/healthz")
        assert status == 200
        # A refusal is a record too.
        second = await procs.start("up", env=env)
        assert await second.wait(timeout=15) == 1
        records = [json.loads(line) for line in second.output if line.strip()]
        assert [(r["event"], r["level"]) for r in records] == [("cli.failed", "error")], second.output
        assert "already using the data directory" in records[0]["detail"]
    finally:
        assert await node.stop() == 0
    lines = [line for line in node.output if line.strip()]
    not_json = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            not_json.append(line)
            continue
        assert isinstance(record, dict) and record.get("event") and record.get("level"), line
    assert not_json == [], not_json
    events = [json.loads(line)["event"] for line in lines]
    assert "node.ready" in events and "node.stopped" in events


async def test_migrate_says_up_to_date_when_nothing_was_pending(tmp_path: Path) -> None:
    env = _env(tmp_path / "data")
    proc = await procs.start("migrate", env=env)
    assert await proc.wait(timeout=60) == 0, "\n".join(proc.output)
    first = [line for line in proc.output if line.startswith("migrations applied to ")]
    assert len(first) == 1 and "0001_corpus_witness" in first[0], proc.output

    proc = await procs.start("migrate", env=env)
    assert await proc.wait(timeout=60) == 0, "\n".join(proc.output)
    assert any(line.startswith("database up to date, nothing to apply") for line in proc.output), proc.output
    assert not any("migrations applied" in line for line in proc.output), proc.output


async def test_server_header_names_the_product_not_the_framework(tmp_path: Path) -> None:
    node = await procs.start("up", env=_env(tmp_path / "data"))
    try:
        url = await node.wait_listening(timeout=60)
        async with aiohttp.ClientSession() as session:
            for path in ("/healthz", "/no-such-route", "/corpus"):
                async with session.get(url + path) as resp:
                    assert resp.headers.get("Server") == "ToastMachine", (path, resp.headers.get("Server"))
    finally:
        assert await node.stop() == 0


async def test_an_address_this_machine_cannot_listen_on_is_a_configuration_error(tmp_path: Path) -> None:
    """Not a crash-loop until the start deadline and then exit 0, as before: exit 2 at once, naming the variable."""
    # 203.0.113.0/24 is TEST-NET-3 (RFC 5737): never an address of this machine.
    proc = await procs.start("up", env=_env(tmp_path / "data", TOASTMACHINE_HOST="203.0.113.7", TOASTMACHINE_PORT="8080"))
    assert await proc.wait(timeout=15) == 2, proc.output
    lines = [line for line in proc.output if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("toastmachine: cannot listen on 203.0.113.7:8080 (") and \
        lines[0].endswith("); check TOASTMACHINE_HOST"), lines


async def test_a_data_dir_that_cannot_hold_the_lock_is_a_configuration_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = await procs.start("up", env=_env(blocker / "data"))
    assert await proc.wait(timeout=15) == 2, proc.output
    lines = [line for line in proc.output if line.strip()]
    assert len(lines) == 1 and "TOASTMACHINE_DATA_DIR=" in lines[0] and "writable directory" in lines[0], lines


async def test_a_service_url_with_an_impossible_port_is_a_configuration_error(tmp_path: Path) -> None:
    """Was an OverflowError traceback from deep inside the connect call."""
    proc = await procs.start("migrate", env=_env(tmp_path / "data",
                                                 TOASTMACHINE_DATABASE_URL="postgresql://127.0.0.1:99999/x"))
    assert await proc.wait(timeout=15) == 2, proc.output
    lines = [line for line in proc.output if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("toastmachine: configuration error: TOASTMACHINE_DATABASE_URL"), lines


@pytest.mark.parametrize("where", ["userinfo", "query"])
async def test_a_database_outage_logs_no_password_and_no_traceback(tmp_path: Path, database_url: str,
                                                                   where: str) -> None:
    """The node's database goes away for a while (a forwarder in front of it cut: every connection
    dropped, new ones refused) and comes back: the node says so in one line per event and never
    shows the password of its database URL, given as ``user:password@`` or as libpq's
    ``?password=`` (with rich installed, structlog's tracebacks showed every frame's local
    variables, a connection's DSN among them; the query form was printed by every DSN label)."""
    from tests.tcp_proxy import TcpProxy

    server = urlsplit(database_url)
    proxy = TcpProxy(server.hostname or "127.0.0.1", server.port or 5432)
    await proxy.up()
    password = f"Pw-{uuid.uuid4().hex}"  # trust authentication ignores it; it must still never be shown
    user = server.username or "postgres"
    url = (f"postgresql://{user}:{password}@127.0.0.1:{proxy.port}{server.path}" if where == "userinfo" else
           f"postgresql://{user}@127.0.0.1:{proxy.port}{server.path}?sslmode=disable&password={password}")
    doctor = await procs.start("doctor", env=_env(tmp_path / "data", TOASTMACHINE_DATABASE_URL=url))
    await doctor.wait(timeout=60)
    assert password not in "\n".join(doctor.output) and "database" in "\n".join(doctor.output)
    node = await procs.start("up", env=_env(tmp_path / "data", TOASTMACHINE_DATABASE_URL=url))
    try:
        await node.wait_listening(timeout=60)
        await proxy.down()
        # asyncpg's pool reports its failed reconnects on its own (with the exception attached).
        await node.wait_for_line(r"restore the pool connection floor", timeout=60)
        await proxy.up()
        await node.wait_for_line(r"(publisher|archiver)\.active", timeout=60)  # back, by itself
    finally:
        await node.stop()
        await proxy.down()
    text = "\n".join(node.output)
    assert password not in text
    assert not procs.unexpected_tracebacks(node.output), text
    assert not [line for line in node.output if line.lstrip().startswith(("│", "╭", "Traceback"))], text
