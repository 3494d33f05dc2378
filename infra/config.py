"""One typed settings object, built once from ``TOASTMACHINE_*`` variables at process start.

An invalid value stops the process with a :class:`ConfigError` naming the variable; nothing falls
back silently. Every field is documented in the README's configuration table.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from infra.client_address import TrustedProxies
from infra.redact import hidden_userinfo, redact_url
from protocol.checkpoint import CheckpointError, parse_signer_key
from protocol.errors import ConfigError
from protocol.manifest import PAGE_SEGMENTS

PREFIX = "TOASTMACHINE_"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Settings:
    """Process configuration. Build it with :meth:`from_env`."""

    #: PostgreSQL DSN; None means embedded PostgreSQL (pgserver) under ``data_dir``.
    database_url: str | None = None
    #: RabbitMQ URL; None means the in-process bus (allowed for ``toastmachine up`` only).
    amqp_url: str | None = None
    #: Where the embedded database and other local state live.
    data_dir: Path = Path("data")
    #: Address the web front binds to.
    host: str = "127.0.0.1"
    #: Port the web front binds to (0 picks a free one).
    port: int = 8080
    #: Public base URL used in links; defaults to http://host:port.
    public_url: str | None = None
    #: Corpus identity; when unset, taken from the witness row or generated once and persisted.
    corpus_id: uuid.UUID | None = None
    #: History lineage; same rules as corpus_id.
    lineage: uuid.UUID | None = None
    #: Archive object store: a directory path, file:///path or s3://bucket[/prefix]; None means
    #: the directory ``data_dir/archive``.
    archive_url: str | None = None
    #: S3 endpoint for an s3:// archive (any S3-compatible store); None means AWS (or AWS_ENDPOINT_URL).
    archive_s3_endpoint: str | None = None
    #: S3 region; None means obstore's default (AWS_REGION, else us-east-1).
    archive_s3_region: str | None = None
    #: S3 access key id; None means obstore's default credential chain (AWS_* variables, instance roles).
    archive_s3_access_key_id: str | None = None
    #: S3 secret access key; never printed (``redacted()`` masks it).
    archive_s3_secret_access_key: str | None = None
    #: The checkpoint signer key (``PRIVATE+KEY+...`` text); None means the file
    #: ``data_dir/archive-signing-key``, generated on first use. Never printed.
    archive_signing_key: str | None = None
    #: The archiver seals a segment at this many events (SPEC §5: 500)...
    archive_segment_events: int = 500
    #: Segments per manifest page (protocol.manifest.PAGE_SEGMENTS).
    archive_manifest_page: int = PAGE_SEGMENTS
    #: ...or when the next event would take the segment past this many bytes (4 MiB)...
    archive_segment_bytes: int = 4 << 20
    #: ...or this many seconds after the first event not yet in a segment was committed.
    archive_segment_seconds: float = 60.0
    #: Seconds between the archiver's sweeps of the history when no wake-up arrives.
    archive_sweep_seconds: float = 5.0
    #: Segments the archiver seals, writes, verifies and publishes together at most when behind.
    archive_batch_segments: int = 32
    #: "console" (human) or "json" (production).
    log_format: str = "console"
    #: Root log level.
    log_level: str = "info"
    #: Registrations per client address per minute, on all web nodes together.
    register_per_minute: int = 20
    #: Sustained writes per agent per second (bursts of twice that), on all web nodes together.
    writes_per_second: float = 10.0
    #: Proxies whose X-Forwarded-For / Forwarded headers name the client; empty: trust nobody.
    trusted_proxies: TrustedProxies = dataclasses.field(default_factory=TrustedProxies)
    #: Seconds the ingress waits for the writer's reply before answering 504.
    command_timeout: float = 10.0
    #: Seconds a stopping process lets in-flight work finish before cancelling it.
    shutdown_grace: float = 10.0
    #: Unsettled deliveries per consumer.
    prefetch: int = 64
    #: Size of the asyncpg pool per process.
    db_pool_size: int = 10
    #: Most write commands the corpus writer applies in one transaction (group commit).
    writer_max_batch: int = 100
    #: Seconds between heartbeat comments on an idle SSE stream.
    stream_heartbeat: float = 15.0
    #: Most SSE streams one web node serves at once; more are refused with 503 and Retry-After.
    stream_max: int = 10_000
    #: Most SSE streams one client address may hold open on one web node at once.
    stream_max_per_client: int = 32
    #: Most JSONL exports (changes.jsonl, snapshot.jsonl) one client address may have running on one
    #: web node at once (each holds a database connection; the node runs half its pool at most).
    export_max_per_client: int = 2
    #: Seconds a client has to send a request's headers, and separately its body, before the
    #: connection is answered 408 and closed (idle keep-alive connections and open streams are not cut).
    http_read_timeout: float = 30.0
    #: Milliseconds a writer waits for more commands before committing a batch that is not full;
    #: 0 commits whatever is waiting at once (batches still form while a transaction runs).
    writer_linger_ms: float = 0.0
    #: Address the MCP front binds to.
    mcp_host: str = "127.0.0.1"
    #: Port the MCP front binds to (0 picks a free one).
    mcp_port: int = 8081
    #: Public base URL of the MCP front: the OAuth issuer, with the protected resource at <it>/mcp.
    mcp_public_url: str | None = None
    #: Authorization requests per client address per minute, on all MCP nodes together.
    mcp_authorize_per_minute: int = 30
    mcp_subscriptions_per_agent: int = 32
    #: Most open 2025-11-25 sessions one agent may hold on one MCP node (of the SDK's 10,000).
    mcp_sessions_per_agent: int = 32
    #: Test only: fetch client ID metadata documents from loopback and private addresses too.
    mcp_cimd_allow_private: bool = False
    #: Extra certificate authorities (PEM file) trusted when fetching client ID metadata documents.
    mcp_cimd_ca_file: Path | None = None
    #: Seconds between the MCP front's reads of the guide's version (a change is announced to subscribers).
    mcp_guide_poll: float = 30.0
    #: This process's name in logs, pong replies and per-node queues.
    node_id: str = dataclasses.field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    @property
    def base_url(self) -> str:
        """The public base URL without a trailing slash."""
        if self.public_url:
            return self.public_url.rstrip("/")
        return f"http://{self.host}:{self.port}"

    @property
    def mcp_base_url(self) -> str:
        """The MCP front's public origin (the OAuth issuer) without a trailing slash."""
        if self.mcp_public_url:
            return self.mcp_public_url.rstrip("/")
        return f"http://{self.mcp_host}:{self.mcp_port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Parse ``TOASTMACHINE_*`` variables; raise ConfigError naming the first bad one."""
        env = os.environ if env is None else env
        d = cls()

        def get(name: str, parse: Callable[[str, str], T], default: T) -> T:
            var = PREFIX + name
            raw = env.get(var)
            if raw is None or raw.strip() == "":
                return default
            return parse(var, raw.strip())

        known = {PREFIX + f.name.upper() for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in known and k not in _IGNORED)
        if unknown:
            raise ConfigError(f"{unknown[0]} is not a ToastMachine setting (see the README's configuration table)")

        return cls(
            database_url=get("DATABASE_URL", _url("postgres", "postgresql"), None),
            amqp_url=get("AMQP_URL", _url("amqp", "amqps"), None),
            data_dir=get("DATA_DIR", lambda _v, raw: Path(raw).expanduser(), d.data_dir),
            host=get("HOST", lambda _v, raw: raw, d.host),
            port=get("PORT", _int(0, 65535), d.port),
            public_url=get("PUBLIC_URL", _url("http", "https"), None),
            corpus_id=get("CORPUS_ID", _uuid, None),
            lineage=get("LINEAGE", _uuid, None),
            archive_url=get("ARCHIVE_URL", check_archive_url, None),
            archive_s3_endpoint=get("ARCHIVE_S3_ENDPOINT", _endpoint, None),
            archive_s3_region=get("ARCHIVE_S3_REGION", lambda _v, raw: raw, None),
            archive_s3_access_key_id=get("ARCHIVE_S3_ACCESS_KEY_ID", lambda _v, raw: raw, None),
            archive_s3_secret_access_key=get("ARCHIVE_S3_SECRET_ACCESS_KEY", lambda _v, raw: raw, None),
            archive_signing_key=get("ARCHIVE_SIGNING_KEY", _signer_key, None),
            archive_segment_events=get("ARCHIVE_SEGMENT_EVENTS", _int(1, 65_536), d.archive_segment_events),
            archive_manifest_page=get("ARCHIVE_MANIFEST_PAGE", _int(1, 100_000), d.archive_manifest_page),
            archive_segment_bytes=get("ARCHIVE_SEGMENT_BYTES", _int(1024, 64 << 20), d.archive_segment_bytes),
            archive_segment_seconds=get("ARCHIVE_SEGMENT_SECONDS", _float(0, 86_400), d.archive_segment_seconds),
            archive_sweep_seconds=get("ARCHIVE_SWEEP_SECONDS", _float(0.05, 3600), d.archive_sweep_seconds),
            archive_batch_segments=get("ARCHIVE_BATCH_SEGMENTS", _int(1, 1024), d.archive_batch_segments),
            log_format=get("LOG_FORMAT", _choice("console", "json"), d.log_format),
            log_level=get("LOG_LEVEL", _choice("debug", "info", "warning", "error"), d.log_level),
            register_per_minute=get("REGISTER_PER_MINUTE", _int(1, 1_000_000), d.register_per_minute),
            writes_per_second=get("WRITES_PER_SECOND", _float(0.001, 1_000_000), d.writes_per_second),
            trusted_proxies=get("TRUSTED_PROXIES", _trusted_proxies, d.trusted_proxies),
            command_timeout=get("COMMAND_TIMEOUT", _float(0.1, 600), d.command_timeout),
            shutdown_grace=get("SHUTDOWN_GRACE", _float(0, 600), d.shutdown_grace),
            prefetch=get("PREFETCH", _int(1, 10_000), d.prefetch),
            db_pool_size=get("DB_POOL_SIZE", _int(1, 1000), d.db_pool_size),
            stream_heartbeat=get("STREAM_HEARTBEAT", _float(0.01, 3600), d.stream_heartbeat),
            stream_max=get("STREAM_MAX", _int(1, 1_000_000), d.stream_max),
            stream_max_per_client=get("STREAM_MAX_PER_CLIENT", _int(1, 1_000_000), d.stream_max_per_client),
            export_max_per_client=get("EXPORT_MAX_PER_CLIENT", _int(1, 1_000_000), d.export_max_per_client),
            http_read_timeout=get("HTTP_READ_TIMEOUT", _float(0.05, 3600), d.http_read_timeout),
            writer_max_batch=get("WRITER_MAX_BATCH", _int(1, 10_000), d.writer_max_batch),
            writer_linger_ms=get("WRITER_LINGER_MS", _float(0, 1000), d.writer_linger_ms),
            mcp_host=get("MCP_HOST", lambda _v, raw: raw, d.mcp_host),
            mcp_port=get("MCP_PORT", _int(0, 65535), d.mcp_port),
            mcp_public_url=get("MCP_PUBLIC_URL", _public_origin, None),
            mcp_authorize_per_minute=get("MCP_AUTHORIZE_PER_MINUTE", _int(1, 1_000_000),
                                         d.mcp_authorize_per_minute),
            mcp_subscriptions_per_agent=get("MCP_SUBSCRIPTIONS_PER_AGENT", _int(1, 1_000_000),
                                            d.mcp_subscriptions_per_agent),
            mcp_sessions_per_agent=get("MCP_SESSIONS_PER_AGENT", _int(1, 1_000_000), d.mcp_sessions_per_agent),
            mcp_cimd_allow_private=get("MCP_CIMD_ALLOW_PRIVATE", _flag, d.mcp_cimd_allow_private),
            mcp_cimd_ca_file=get("MCP_CIMD_CA_FILE", lambda _v, raw: Path(raw).expanduser(), None),
            mcp_guide_poll=get("MCP_GUIDE_POLL", _float(0.1, 86400), d.mcp_guide_poll),
            node_id=get("NODE_ID", _node_id, d.node_id),
        )

    def redacted(self) -> dict[str, str]:
        """Settings as strings with passwords in URLs masked, for `doctor` and start-up logs."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            text = "" if value is None else str(value)
            if f.name.endswith("_url") and value:
                text = redact_url(text)
            if f.name in _SECRETS and value:
                text = "***"
            out[f.name] = text
        return out


# Fields whose value is a secret: masked whole by redacted().
_SECRETS = {"archive_s3_secret_access_key", "archive_signing_key"}

# Variables with our prefix that are read by the test suite or CI, not by a node.
_IGNORED = {"TOASTMACHINE_TEST_AMQP_URL", "TOASTMACHINE_TEST_DATABASE_URL", "TOASTMACHINE_TEST_CHROMIUM",
            "TOASTMACHINE_REQUIRE_SERVICES"}


#: What to do about a password holding a character that ends a URL's user-info part.
_ENCODE_PASSWORD = ("percent-encode any '/', '?', '#' or '@' in its user name or password "
                    "(e.g. '/' as %2F, '#' as %23)")


def _url(*schemes: str) -> Callable[[str, str], str]:
    def parse(var: str, raw: str) -> str:
        # Neither the value nor the parser's message is echoed: a password holding '/', '?' or '#'
        # ends the URL's authority early, and its pieces then show up as a "port" or a path.
        if hidden_userinfo(raw):
            raise ConfigError(f"{var} is not a valid URL: its '@' comes after a '/', '?' or '#'; {_ENCODE_PASSWORD}")
        try:
            parts = urlsplit(raw)
            parts.port  # noqa: B018 - raises for a port outside 0-65535, which connect() would hit later
        except ValueError:
            raise ConfigError(f"{var} is not a valid URL (its host or port does not parse); "
                              f"{_ENCODE_PASSWORD}") from None
        if parts.scheme not in schemes:
            # The value itself is not echoed (it may hold a password); its scheme is enough to see the mistake.
            got = f"scheme {parts.scheme!r}" if parts.scheme and "://" in raw else "a value without a scheme (no '://')"
            raise ConfigError(f"{var} must be a URL with scheme {' or '.join(schemes)}, got {got}")
        return raw
    return parse


def _endpoint(var: str, raw: str) -> str:
    """An S3 endpoint: an http(s) URL without credentials (they have settings of their own, which
    are never printed; a URL is)."""
    value = _url("http", "https")(var, raw)
    parts = urlsplit(value)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{var} must not carry a user name or password: set TOASTMACHINE_ARCHIVE_S3_ACCESS_KEY_ID "
                          "and TOASTMACHINE_ARCHIVE_S3_SECRET_ACCESS_KEY instead")
    return value


def _signer_key(var: str, raw: str) -> str:
    try:
        parse_signer_key(raw)
    except CheckpointError as e:
        # The message describes the shape only; the value is a secret and is never echoed.
        raise ConfigError(f"{var} is not a signer key: {e}") from None
    return raw


#: An S3 bucket name (the rules every S3-compatible server shares: 3-63 lowercase letters, digits,
#: dots and hyphens, starting and ending with a letter or digit).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
#: A scheme we understand, written without its "//" (``s3:bucket/x``): a typo, not a directory name.
_SCHEME_WITHOUT_SLASHES = re.compile(r"(?i)(s3|file):(?!//)")


def check_archive_url(var: str, raw: str) -> str:
    """``raw`` as an archive store location named ``var`` (a variable or a command-line option):
    a bare path is a directory; otherwise only file:// and s3://bucket[/prefix] are understood.
    ConfigError, naming ``var``, for anything else."""
    if _SCHEME_WITHOUT_SLASHES.match(raw):
        raise ConfigError(f"{var} starts like a URL but has no '//': write s3://bucket[/prefix] or "
                          "file:///path (a directory path needs no scheme)")
    if "://" not in raw:
        return raw
    parts = urlsplit(raw)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ConfigError(f"{var} must be file:///absolute/path, got {raw!r}")
        return raw
    if parts.scheme == "s3":
        if not parts.netloc or parts.query or parts.fragment or "@" in parts.netloc:
            raise ConfigError(f"{var} must be s3://bucket[/prefix] (credentials go in "
                              f"TOASTMACHINE_ARCHIVE_S3_*), got scheme s3 with a bad bucket or extras")
        if not _BUCKET.fullmatch(parts.netloc):
            raise ConfigError(f"{var}: {parts.netloc!r} is not an S3 bucket name (3 to 63 lowercase letters, "
                              "digits, dots and hyphens, starting and ending with a letter or digit)")
        return raw
    raise ConfigError(f"{var} must be a directory, file:// or s3:// URL, got scheme {parts.scheme!r}")


def _int(lo: int, hi: int) -> Callable[[str, str], int]:
    def parse(var: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{var} must be an integer, got {raw!r}") from None
        if not lo <= value <= hi:
            raise ConfigError(f"{var} must be between {lo} and {hi}, got {value}")
        return value
    return parse


def _float(lo: float, hi: float) -> Callable[[str, str], float]:
    def parse(var: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{var} must be a number, got {raw!r}") from None
        if not lo <= value <= hi:
            raise ConfigError(f"{var} must be between {lo} and {hi}, got {value}")
        return value
    return parse


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(var: str, raw: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise ConfigError(f"{var} must be one of {', '.join(choices)}, got {raw!r}")
        return value
    return parse


def _flag(var: str, raw: str) -> bool:
    value = raw.lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ConfigError(f"{var} must be 1 or 0, got {raw!r}")


def _uuid(var: str, raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise ConfigError(f"{var} must be a UUID, got {raw!r}") from None


def _trusted_proxies(var: str, raw: str) -> TrustedProxies:
    try:
        return TrustedProxies.parse(raw)
    except ValueError as e:
        raise ConfigError(f"{var} must be comma-separated IP addresses or CIDR networks: {e}") from None


def _node_id(var: str, raw: str) -> str:
    if len(raw) > 64 or not all(c.isalnum() or c in "-_." for c in raw):
        raise ConfigError(f"{var} must be 1-64 letters, digits, '-', '_' or '.', got {raw!r}")
    return raw


def _public_origin(var: str, raw: str) -> str:
    # The OAuth issuer: an http(s) origin with no path, query or fragment (RFC 8414 §2), so that
    # path-inserted and root metadata are the same document and the resource is exactly <it>/mcp.
    _url("http", "https")(var, raw)
    parts = urlsplit(raw)
    if parts.path not in ("", "/") or parts.query or parts.fragment or not parts.hostname:
        raise ConfigError(f"{var} must be an origin such as https://mcp.example.org, without path or query")
    return raw.rstrip("/")
