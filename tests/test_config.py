"""Configuration: every variable parses, every bad value is refused with its name, nothing falls back."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from infra.config import Settings
from infra.redact import redact_line, redact_url
from protocol.errors import ConfigError


def test_defaults_without_environment() -> None:
    s = Settings.from_env({})
    assert s.database_url is None and s.amqp_url is None
    assert s.port == 8080 and s.host == "127.0.0.1"
    assert s.register_per_minute == 20 and s.writes_per_second == 10.0
    assert s.base_url == "http://127.0.0.1:8080"


def test_every_variable_is_read() -> None:
    cid, lin = uuid.uuid4(), uuid.uuid4()
    s = Settings.from_env({
        "TOASTMACHINE_DATABASE_URL": "postgresql://u:p@db:5432/tm",
        "TOASTMACHINE_AMQP_URL": "amqp://guest:guest@mq:5672/",
        "TOASTMACHINE_DATA_DIR": "/tmp/tm-data",
        "TOASTMACHINE_HOST": "0.0.0.0",
        "TOASTMACHINE_PORT": "9000",
        "TOASTMACHINE_PUBLIC_URL": "https://toast.example/",
        "TOASTMACHINE_CORPUS_ID": str(cid),
        "TOASTMACHINE_LINEAGE": str(lin),
        "TOASTMACHINE_LOG_FORMAT": "JSON",
        "TOASTMACHINE_REGISTER_PER_MINUTE": "5",
        "TOASTMACHINE_WRITES_PER_SECOND": "2.5",
        "TOASTMACHINE_NODE_ID": "web-1",
        "TOASTMACHINE_TRUSTED_PROXIES": "127.0.0.1, 10.0.0.0/8,::1",
    })
    assert s.port == 9000 and s.host == "0.0.0.0"
    assert s.data_dir == Path("/tmp/tm-data")
    assert s.corpus_id == cid and s.lineage == lin
    assert s.log_format == "json"
    assert s.base_url == "https://toast.example"
    assert s.register_per_minute == 5 and s.writes_per_second == 2.5
    assert s.node_id == "web-1"
    assert str(s.trusted_proxies) == "127.0.0.1/32,10.0.0.0/8,::1/128"
    assert not Settings.from_env({}).trusted_proxies  # the default trusts nobody


@pytest.mark.parametrize(("var", "value", "needle"), [
    ("TOASTMACHINE_PORT", "eighty", "must be an integer"),
    ("TOASTMACHINE_PORT", "70000", "between 0 and 65535"),
    ("TOASTMACHINE_CORPUS_ID", "not-a-uuid", "must be a UUID"),
    ("TOASTMACHINE_LINEAGE", "123", "must be a UUID"),
    ("TOASTMACHINE_AMQP_URL", "http://rabbit/", "scheme amqp or amqps"),
    ("TOASTMACHINE_DATABASE_URL", "mysql://x/y", "scheme postgres or postgresql, got scheme 'mysql'"),
    ("TOASTMACHINE_DATABASE_URL", "db.example:5432/tm", "got a value without a scheme"),
    ("TOASTMACHINE_LOG_FORMAT", "xml", "one of console, json"),
    ("TOASTMACHINE_WRITES_PER_SECOND", "0", "between"),
    ("TOASTMACHINE_WRITES_PER_SECOND", "fast", "must be a number"),
    ("TOASTMACHINE_REGISTER_PER_MINUTE", "-1", "between"),
    ("TOASTMACHINE_NODE_ID", "has space", "letters, digits"),
    ("TOASTMACHINE_TRUSTED_PROXIES", "127.0.0.1, proxy.local", "'proxy.local' is not an IP address"),
    ("TOASTMACHINE_TRUSTED_PROXIES", "10.0.0.0/33", "CIDR"),
    ("TOASTMACHINE_PORTT", "80", "is not a ToastMachine setting"),
])
def test_bad_value_names_the_variable(var: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({var: value})
    assert var in str(info.value)
    assert needle in str(info.value)


def test_redaction_hides_passwords() -> None:
    assert redact_url("amqp://guest:s3cret@mq:5672/") == "amqp://guest:***@mq:5672/"
    assert redact_url("postgresql://tm@db/tm?sslmode=require&Password=s3cret&sslpassword=k3y") == \
        "postgresql://tm@db/tm?sslmode=require&Password=***&sslpassword=***"
    assert redact_url("postgresql://db/tm?application_name=password") == "postgresql://db/tm?application_name=password"
    # The value up to the next & (as the drivers split it), a percent-encoded name, the rest as written.
    assert redact_url("postgresql://tm@db/tm?password=abc;def") == "postgresql://tm@db/tm?password=***"
    assert redact_url("postgresql://tm@db/tm?pass%77ord=x&a=1") == "postgresql://tm@db/tm?pass%77ord=***&a=1"
    assert redact_url("postgresql:///tm?host=/tmp") == "postgresql:///tm?host=/tmp"
    with pytest.raises(ConfigError, match="must not carry a user name or password"):
        Settings.from_env({"TOASTMACHINE_ARCHIVE_S3_ENDPOINT": "http://key:s3cret@127.0.0.1:8333"})
    s = Settings.from_env({"TOASTMACHINE_DATABASE_URL": "postgresql://tm:hunter2@db/tm"})
    assert "hunter2" not in str(s.redacted())


@pytest.mark.parametrize("url", [
    "postgresql://tm:hunter2@db:5432/tm",
    "postgresql://db/tm?password=hunter2",
    "postgresql://db/tm?sslmode=require&SSLPassword=hunter2",
    "postgresql://db/tm?p%61ssword=hunter2",  # any letter of the name percent-encoded
    "postgresql://db/tm?ssl%70ass%77ord=hunter2&a=1",
    "postgresql://db/tm?%50ASSWORD=hunter2",  # an upper-case letter encoded
    "amqp://guest:hunter2@mq:5672/",
    "postgresql://tm:5432/hunter2@db/tm",  # a password holding an unencoded '/', read as a port and a path
    "amqp://guest:hun#ter2@mq/",
])
def test_a_log_line_and_a_url_hide_the_same_passwords(url: str) -> None:
    """The log formatter's last guard (redact_line, on a whole line holding the URL among other
    words and quotes) hides every password redact_url hides, from the one list of names."""
    assert "hunter2" not in redact_url(url) and "hun#ter2" not in redact_url(url)
    for line in (f"connect to {url} failed", f"dsn='{url}' refused", f'{{"url": "{url}"}}'):
        redacted = redact_line(line)
        assert "hunter2" not in redacted and "hun#ter2" not in redacted, line
        assert redacted.startswith(line[:8])  # the words around it stay
    assert redact_line("application_name=password and ?passwords=x") == "application_name=password and ?passwords=x"


@pytest.mark.parametrize(("var", "value"), [
    ("TOASTMACHINE_DATABASE_URL", "postgresql://tm:S3cr#etpw@db/tm"),
    ("TOASTMACHINE_DATABASE_URL", "postgresql://tm:5432/Zx9secret@127.0.0.1/tm"),
    ("TOASTMACHINE_DATABASE_URL", "postgresql://tm:ab?cd9secret@db/tm"),
    ("TOASTMACHINE_AMQP_URL", "amqp://guest:gu#est9secret@localhost/"),
    ("TOASTMACHINE_DATABASE_URL", "postgresql://tm:pw@db:99999/tm"),
])
def test_a_url_whose_password_ends_its_authority_is_refused_without_a_piece_of_it(var: str, value: str) -> None:
    """A password holding an unencoded '/', '?' or '#' ends the URL's authority early: its pieces
    used to come back in the error as a "port" (S3cr), or pass as a port and a path and then be shown
    whole by doctor and the start-up line. It is refused, saying to percent-encode, quoting nothing."""
    with pytest.raises(ConfigError) as info:
        Settings.from_env({var: value})
    text = str(info.value)
    assert var in text and "percent-encode" in text
    for piece in ("S3cr", "etpw", "Zx9", "secret", "gu", "est9", "pw@", "99999"):
        assert piece not in text, (piece, text)
    # A URL with no authority may hold an '@' in its query (libpq's user=...): accepted as before.
    assert Settings.from_env({"TOASTMACHINE_DATABASE_URL": "postgresql:///tm?user=a@b"}).database_url


def test_cli_stops_with_the_variable_name(tmp_path: Path) -> None:
    """A bad value stops the process before it does anything, naming the variable."""
    env = {"PATH": "/usr/bin:/bin", "TOASTMACHINE_PORT": "abc", "TOASTMACHINE_DATA_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "toastmachine.cli", "up"], env=env, capture_output=True,
                          text=True, timeout=60, check=False, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2
    assert "TOASTMACHINE_PORT" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "postgres").exists()


def test_mcp_settings_and_their_public_origin() -> None:
    s = Settings.from_env({"TOASTMACHINE_MCP_PORT": "9091"})
    assert s.mcp_port == 9091 and s.mcp_base_url == "http://127.0.0.1:9091"
    s = Settings.from_env({"TOASTMACHINE_MCP_PUBLIC_URL": "https://mcp.example.org/"})
    assert s.mcp_base_url == "https://mcp.example.org"
    for bad in ("https://mcp.example.org/mcp", "https://mcp.example.org?x=1", "ftp://mcp.example.org"):
        with pytest.raises(ConfigError, match="TOASTMACHINE_MCP_PUBLIC_URL"):
            Settings.from_env({"TOASTMACHINE_MCP_PUBLIC_URL": bad})
    with pytest.raises(ConfigError, match="TOASTMACHINE_MCP_PORT"):
        Settings.from_env({"TOASTMACHINE_MCP_PORT": "70000"})
    s = Settings.from_env({"TOASTMACHINE_MCP_CIMD_ALLOW_PRIVATE": "1", "TOASTMACHINE_MCP_CIMD_CA_FILE": "/etc/ca.pem"})
    assert s.mcp_cimd_allow_private is True and s.mcp_cimd_ca_file == Path("/etc/ca.pem")
    assert Settings.from_env({}).mcp_cimd_allow_private is False  # refused unless a test says so
    with pytest.raises(ConfigError, match="TOASTMACHINE_MCP_CIMD_ALLOW_PRIVATE must be 1 or 0"):
        Settings.from_env({"TOASTMACHINE_MCP_CIMD_ALLOW_PRIVATE": "maybe"})


def test_a_log_line_quoting_a_huge_client_value_is_cut(capsys: pytest.CaptureFixture[str]) -> None:
    """A library's record quoting 20 KB a client sent (as the MCP SDK's transport warnings may) and
    our own line with a long field are cut at MAX_LOG_VALUE characters, saying how long they were;
    the SDK's DNS-rebinding warning, which quotes the refused Host or Origin, is not logged at all."""
    import logging

    import structlog

    from infra.logs import MAX_LOG_VALUE, configure_logging, get_logger

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("json", "info")
        logging.getLogger("mcp.server.streamable_http").warning("Invalid Host header: %s", "H" * 20_000)
        logging.getLogger("mcp.server.transport_security").warning("Invalid Origin header: %s", "rebind.example")
        get_logger("toastmachine.test").info("test.long_field", value="V" * 20_000, short="kept")
        # A URL whose password sits across the cut: redacted before it is cut.
        get_logger("toastmachine.test").info("test.cut_url", value="U" * (MAX_LOG_VALUE - 20)
                                             + " postgresql://tm:hunter2-and-more@db/tm " + "W" * 100)
        err = capsys.readouterr().err
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        structlog.reset_defaults()
    lines = [line for line in err.splitlines() if "Invalid Host header" in line or "test.long_field" in line]
    assert len(lines) == 2, err[:500]
    assert all(len(line) < MAX_LOG_VALUE + 1000 for line in lines)
    assert "(20021 characters)" in lines[0] and "(20000 characters)" in lines[1] and '"short": "kept"' in lines[1]
    assert "test.cut_url" in err and "tm:hun" not in err and "tm:***" in err
    assert "rebind.example" not in err


def test_log_lines_carry_the_bound_trace_id_and_context_and_nesting_restores_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every line logged inside :func:`bound_trace` carries its trace id and context, a key the log
    call passes itself wins, an inner block's values hold only inside it, and nothing is left bound
    after the outer one (the library lines of ``logging`` get them too)."""
    import logging

    import orjson
    import structlog

    from infra.logs import bound_trace, configure_logging, current_trace_id, get_logger

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    log = get_logger("toastmachine.test")
    try:
        configure_logging("json", "info")
        with bound_trace("outer-trace-1", queue="q1", client="c1"):
            log.info("test.outer")
            with bound_trace(None, queue="q2") as inner:
                log.info("test.inner")
                log.info("test.own", queue="passed")
                logging.getLogger("asyncpg").warning("library line")
            log.info("test.outer_again")
        log.info("test.after")
        assert current_trace_id() is None
        err = capsys.readouterr().err
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        structlog.reset_defaults()
    lines = {line["event"]: line for line in map(orjson.loads, err.splitlines())}
    assert {k: lines["test.outer"].get(k) for k in ("trace_id", "queue", "client")} == \
        {"trace_id": "outer-trace-1", "queue": "q1", "client": "c1"}
    assert {k: lines["test.inner"].get(k) for k in ("trace_id", "queue", "client")} == \
        {"trace_id": inner, "queue": "q2", "client": "c1"}
    assert inner != "outer-trace-1" and lines["test.own"]["queue"] == "passed"
    assert lines["library line"]["trace_id"] == inner
    assert {k: lines["test.outer_again"].get(k) for k in ("trace_id", "queue")} == \
        {"trace_id": "outer-trace-1", "queue": "q1"}
    assert "trace_id" not in lines["test.after"] and "queue" not in lines["test.after"]
