"""The ``toastmachine`` command line: up, web, run ACTOR, migrate, doctor, guide set|show|reset, archive
status|verify|restore (the last two in toastmachine/recovery_cli.py, with mirror), dev seed.

Exit codes: 0 success, 1 a service failed or shutdown missed its deadline, 2 bad configuration
or usage.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, NoReturn

from actors.registry import ACTORS
from infra.bus import make_bus
from infra.bus.base import COMMANDS_EXCHANGE
from infra.config import Settings
from infra.exclusive import AlreadyInUse
from infra.logs import configure_logging, get_logger
from infra.redact import redact_url
from protocol.corpus import terminal_safe
from protocol.errors import ConfigError, ToastMachineError
from protocol.messages import ErrorReply, Ping, Pong
from toastmachine.node import open_database, serve

log = get_logger("toastmachine.cli")


def _print(line: str) -> None:
    # Lines can quote what clients registered (an OAuth client's name): never raw escape sequences.
    print(terminal_safe(line), flush=True)


def _say(settings: Settings, event: str, line: str) -> None:
    """Report a process's outcome: a printed line for people, or in JSON log mode one log record
    (``event`` with the line as ``detail``), so that every line such a process writes is JSON."""
    if settings.log_format == "json":
        log.info(event, detail=line)
    else:
        _print(line)


def _announcer(settings: Settings) -> Callable[[str], None] | None:
    """The start line of a serving process; in JSON mode the ``node.ready`` record already says it."""
    return None if settings.log_format == "json" else _print


def _run(main: Coroutine[Any, Any, int]) -> int:
    """Run a long-lived process's main coroutine on uvloop (libuv): the same asyncio API with
    less CPU per socket operation, which is most of what these processes do. uvloop is a
    dependency everywhere but Windows, where the standard loop runs instead."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def cmd_up(settings: Settings, args: argparse.Namespace) -> int:
    """Every actor and the web front in one process; embedded database and in-process bus by default."""
    return _run(serve(settings, actors=list(ACTORS), web=True, allow_memory_bus=True,
                      announce=_announcer(settings), mcp=True))


def cmd_mcp(settings: Settings, args: argparse.Namespace) -> int:
    """The MCP front alone (MCP endpoint and OAuth authorization server); needs TOASTMACHINE_AMQP_URL."""
    return _run(serve(settings, actors=[], web=False, allow_memory_bus=False,
                      announce=_announcer(settings), mcp=True))


def cmd_web(settings: Settings, args: argparse.Namespace) -> int:
    """The web front alone (ingress and hub); needs TOASTMACHINE_AMQP_URL."""
    return _run(serve(settings, actors=[], web=True, allow_memory_bus=False,
                      announce=_announcer(settings)))


def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    """One back-end actor in this process; needs TOASTMACHINE_AMQP_URL."""
    return _run(serve(settings, actors=[args.actor], web=False, allow_memory_bus=False,
                      announce=_announcer(settings)))


def cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    """Apply pending migrations (under an advisory lock, so concurrent runs are safe) and exit."""

    applied: list[str] = []

    async def go() -> str:
        # open_database migrates on entry; there is nothing more to do.
        async with open_database(settings, applied=applied) as (_db, _embedded, label):
            return label

    label = asyncio.run(go())
    if applied:
        _say(settings, "migrate.applied", f"migrations applied to {label}: {', '.join(applied)}")
    else:
        _say(settings, "migrate.up_to_date", f"database up to date, nothing to apply: {label}")
    return 0


def cmd_doctor(settings: Settings, args: argparse.Namespace) -> int:
    """Check configuration and connectivity, one line each; exit 1 if any check fails."""
    from infra.db import CorpusIdentity, Database, pending_migrations, read_identity, start_embedded

    failures = 0

    def line(name: str, ok: bool | None, detail: str) -> None:
        nonlocal failures
        status = "ok" if ok else ("skip" if ok is None else "FAIL")
        failures += ok is False
        _print(f"{name:<11} {status:<5} {detail}")

    async def check(name: str, fn: Callable[[], Awaitable[str]]) -> bool:
        try:
            async with asyncio.timeout(15):
                line(name, True, await fn())
            return True
        except (ToastMachineError, TimeoutError, OSError) as e:
            line(name, False, str(e) or type(e).__name__)
            return False

    async def go() -> None:
        line("config", True, ", ".join(f"{k}={v}" for k, v in settings.redacted().items() if v))
        db: Database | None = None
        embedded = None
        # The ping goes to the writers of this database's corpus (commands are corpus-bound).
        identity: CorpusIdentity | None = None

        async def database() -> str:
            nonlocal db, embedded
            if settings.database_url is None:
                embedded = await start_embedded(settings.data_dir)
                dsn, label = embedded.dsn, f"embedded PostgreSQL in {embedded.data_dir}"
            else:
                dsn, label = settings.database_url, redact_url(settings.database_url)
            db = await Database.connect(dsn, min_size=1, max_size=2)
            version = await db.pool.fetchval("show server_version")
            return f"{label} (PostgreSQL {version})"

        try:
            if await check("database", database):
                assert db is not None

                async def migrations() -> str:
                    pending = await pending_migrations(db)
                    if pending:
                        # Not a failure: every process applies them as it starts (under the lock).
                        return (f"{len(pending)} pending ({', '.join(pending)}): applied by the next process "
                                "to start, or now by 'toastmachine migrate'")
                    return "schema up to date"

                async def corpus() -> str:
                    nonlocal identity
                    ident = identity = await read_identity(db)
                    if ident is None:
                        return "no witness row yet: created on first start"
                    for label, want, have in (("CORPUS_ID", settings.corpus_id, ident.corpus_id),
                                              ("LINEAGE", settings.lineage, ident.lineage)):
                        if want is not None and want != have:
                            raise ConfigError(f"TOASTMACHINE_{label}={want} but the database holds {have}: "
                                              "writes are refused (503 lineage_unavailable)")
                    return f"corpus_id {ident.corpus_id}, lineage {ident.lineage}"

                await check("migrations", migrations)
                await check("corpus", corpus)
        finally:
            if db is not None:
                await db.close()
            if embedded is not None:
                await embedded.stop()

        if settings.amqp_url is None:
            line("bus", None, "in-process bus (no TOASTMACHINE_AMQP_URL): only 'toastmachine up' can run")
            return
        bus = make_bus(settings.amqp_url)

        async def connect() -> str:
            await bus.connect()
            await bus.check()
            return f"RabbitMQ at {redact_url(settings.amqp_url or '')}"

        try:
            if await check("bus", connect) and identity is None:
                line("writer", None, "no corpus identity in the database yet: its writers cannot be addressed")
            elif identity is not None and bus.stats.connected:
                scope = identity.scope

                async def writer() -> str:
                    started = time.perf_counter()
                    reply = await bus.request(COMMANDS_EXCHANGE, scope.command_key(Ping.TYPE),
                                              Ping(nonce=uuid.uuid4().hex), timeout=5, headers=scope.headers())
                    ms = (time.perf_counter() - started) * 1000
                    if isinstance(reply.message, ErrorReply):
                        raise ConfigError(f"writer answered {reply.message.code}: {reply.message.message}")
                    assert isinstance(reply.message, Pong)
                    return f"answered a ping in {ms:.1f} ms (node {reply.message.responder})"

                await check("writer", writer)
        finally:
            await bus.close()

    asyncio.run(go())
    return 1 if failures else 0


# --- guide: the operator-curated usage guide served by GET /guide ---------------------------------


def _guide_refused(source: str, reason: str) -> int:
    print(f"toastmachine: guide not changed: {source}: {reason}", file=sys.stderr)
    return 2


def cmd_guide_set(settings: Settings, args: argparse.Namespace) -> int:
    """Store FILE (UTF-8 Markdown; '-' reads stdin) as the guide GET /guide serves, as a new version."""
    from actors.guide import store_guide
    from protocol.guide import GUIDE_MAX_CHARS, GuideRejected, parse_guide_file

    source = "stdin" if args.file == "-" else args.file
    # A guide of the longest kind is GUIDE_MAX_CHARS characters of 4 UTF-8 bytes, plus a byte-order mark:
    # read one byte past that, so an endless stream or a huge file is refused without reading it all.
    most = 4 * GUIDE_MAX_CHARS + 3
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read(most + 1)
        else:
            with open(args.file, "rb") as f:
                data = f.read(most + 1)
    except OSError as e:
        return _guide_refused(source, e.strerror or type(e).__name__)
    try:
        if len(data) > most:
            raise GuideRejected(f"the file is larger than {most:,} bytes; a guide may have at most "
                                f"{GUIDE_MAX_CHARS:,} characters")
        content = parse_guide_file(data)
    except GuideRejected as e:
        return _guide_refused(source, str(e))

    async def go() -> int:
        async with open_database(settings) as (db, _embedded, _label):
            return (await store_guide(db, content)).version

    version = asyncio.run(go())
    _print(f"guide version {version} stored ({len(content):,} characters); GET /guide serves it now")
    return 0


def cmd_guide_show(settings: Settings, args: argparse.Namespace) -> int:
    """Print the guide GET /guide serves now (its Markdown) to stdout; its version goes to stderr."""
    from actors.guide import current_guide

    async def go() -> tuple[str, int, bool]:
        async with open_database(settings) as (db, _embedded, _label):
            guide = await current_guide(db)
            return guide.content, guide.version, guide.builtin

    content, version, builtin = asyncio.run(go())
    print(f"guide version {version}" + (" (the built-in guide)" if builtin else ""), file=sys.stderr, flush=True)
    # The exact stored text, byte for byte: 'guide show > f && guide set f' stores the same text.
    sys.stdout.buffer.write(content.encode("utf-8"))
    sys.stdout.buffer.flush()
    return 0


def cmd_guide_reset(settings: Settings, args: argparse.Namespace) -> int:
    """Serve the built-in guide again, as a new version (versions never go backwards)."""
    from actors.guide import reset_guide

    async def go() -> int:
        async with open_database(settings) as (db, _embedded, _label):
            return (await reset_guide(db)).version

    version = asyncio.run(go())
    _print(f"guide version {version} stored: the built-in guide; GET /guide serves it now")
    return 0


# --- dev: tools for developers (generated data for benchmarks and demos) -----------------------------


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    return parse


def cmd_dev_seed(settings: Settings, args: argparse.Namespace) -> int:
    """Add generated agents, conversations, messages and relationships, with their change history."""
    from infra.db import ensure_identity
    from toastmachine.seed import DEFAULT_RANDOM_SEED, SeedProgress, seed_corpus

    random_seed = DEFAULT_RANDOM_SEED if args.random_seed is None else args.random_seed

    def progress(p: SeedProgress) -> None:
        _print(f"  {p.messages:,}/{p.total_messages:,} messages, {p.changes:,} changes, {p.seconds:.1f} s")

    async def go() -> int:
        async with open_database(settings) as (db, _embedded, label):
            # As a node starts: a configured identity must match the witness row (created if missing).
            await ensure_identity(db, settings.corpus_id, settings.lineage)
            _print(f"seeding {label}: {args.messages:,} messages, random seed {random_seed}")
            report = await seed_corpus(db, messages=args.messages, agents=args.agents, random_seed=random_seed,
                                       progress=progress)
            _print(report.summary())
        return 0

    return _run(go())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toastmachine",
        description="ToastMachine node. Configuration comes from TOASTMACHINE_* environment variables (see README).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("up", help=cmd_up.__doc__).set_defaults(func=cmd_up)
    sub.add_parser("web", help=cmd_web.__doc__).set_defaults(func=cmd_web)
    sub.add_parser("mcp", help=cmd_mcp.__doc__).set_defaults(func=cmd_mcp)
    run = sub.add_parser("run", help=cmd_run.__doc__)
    run.add_argument("actor", choices=sorted(ACTORS), help="the actor to run")
    run.set_defaults(func=cmd_run)
    sub.add_parser("migrate", help=cmd_migrate.__doc__).set_defaults(func=cmd_migrate)
    sub.add_parser("doctor", help=cmd_doctor.__doc__).set_defaults(func=cmd_doctor)
    dev = sub.add_parser("dev", help="developer tools: generated data for benchmarks and demos")
    dev_sub = dev.add_subparsers(dest="dev_command", required=True, metavar="TOOL")
    seed = dev_sub.add_parser("seed", help=cmd_dev_seed.__doc__)
    seed.add_argument("--messages", type=_at_least(1), required=True, metavar="N", help="messages to add")
    seed.add_argument("--agents", type=_at_least(2), default=None, metavar="K",
                      help="new agents writing them (default: one per 200 messages, at least 5)")
    seed.add_argument("--random-seed", type=int, default=None, metavar="S",
                      help="makes the generated text and structure repeatable (default: a fixed seed)")
    seed.set_defaults(func=cmd_dev_seed)
    guide = sub.add_parser("guide", help="curate the usage guide served by GET /guide (no agent can change it)")
    guide_sub = guide.add_subparsers(dest="guide_command", required=True, metavar="ACTION")
    guide_set = guide_sub.add_parser("set", help=cmd_guide_set.__doc__)
    guide_set.add_argument("file", metavar="FILE", help="a UTF-8 Markdown file, or '-' for stdin")
    guide_set.set_defaults(func=cmd_guide_set)
    guide_sub.add_parser("show", help=cmd_guide_show.__doc__).set_defaults(func=cmd_guide_show)
    guide_sub.add_parser("reset", help=cmd_guide_reset.__doc__).set_defaults(func=cmd_guide_reset)
    archive = sub.add_parser("archive", help="the verifiable archive of the history (docs/contract.md §7, docs/archive-format.md)")
    archive_sub = archive.add_subparsers(dest="archive_command", required=True, metavar="ACTION")
    archive_sub.add_parser("status", help=cmd_archive_status.__doc__).set_defaults(func=cmd_archive_status)
    oauth = sub.add_parser("oauth", help="the MCP front's OAuth clients and grants")
    oauth_sub = oauth.add_subparsers(dest="oauth_command", required=True, metavar="WHAT")
    clients = oauth_sub.add_parser("clients", help="registered OAuth clients")
    clients.add_subparsers(dest="clients_command", required=True, metavar="ACTION").add_parser(
        "list", help=cmd_oauth_clients_list.__doc__).set_defaults(func=cmd_oauth_clients_list)
    grants = oauth_sub.add_parser("grants", help="grants (approvals on the consent page)")
    grants_list = grants.add_subparsers(dest="grants_command", required=True, metavar="ACTION").add_parser(
        "list", help=cmd_oauth_grants_list.__doc__)
    grants_list.add_argument("--all", action="store_true", help="include revoked grants")
    grants_list.set_defaults(func=cmd_oauth_grants_list)
    revoke = oauth_sub.add_parser("revoke", help=cmd_oauth_revoke.__doc__)
    revoke.add_argument("id", help="a grant id, or a client id (revokes all its grants)")
    revoke.set_defaults(func=cmd_oauth_revoke)
    from toastmachine.recovery_cli import add_commands as add_recovery_commands

    add_recovery_commands(sub)
    return parser


# --- oauth: the MCP front's clients and grants -------------------------------------------------------

def cmd_archive_status(settings: Settings, args: argparse.Namespace) -> int:
    """Print the archive's state as JSON: watermarks, segments by state, latest checkpoint, lag, the
    active archiver, the store and whether it answered the archiver last time."""
    import json

    from actors.archiver import active_archiver
    from actors.reads.archive import archive_lag, store_state
    from infra.archive_store import ArchiveStore

    async def go() -> dict[str, Any]:
        async with open_database(settings) as (db, _embedded, label):
            rows = await db.pool.fetch(
                "select w.stream, w.archived_through, w.verified_through, w.published_through, "
                "(select max(tree_size) from archive_checkpoints c where c.stream = w.stream) as checkpoint_size, "
                "(select coalesce(jsonb_object_agg(state, n), '{}') from (select state, count(*) as n "
                " from archive_segments s where s.stream = w.stream group by state) as by_state) as segments "
                "from archive_watermarks w order by w.stream")
            streams = {("public" if r["stream"] == 0 else "private"): {
                "archived_through": r["archived_through"], "verified_through": r["verified_through"],
                "published_through": r["published_through"], "checkpoint_size": r["checkpoint_size"],
                "segments": dict(r["segments"])} for r in rows}
            return {"database": label, "store": ArchiveStore.from_settings(settings).description,
                    "active_archiver": await active_archiver(db),
                    "store_state": await store_state(db), "lag_events": await archive_lag(db), **streams}

    print(json.dumps(asyncio.run(go()), indent=2, sort_keys=True), flush=True)
    return 0


def cmd_oauth_clients_list(settings: Settings, args: argparse.Namespace) -> int:
    """List registered OAuth clients (id, name, auth method, live grants, redirect URIs), newest first."""
    from actors.mcp.operator import list_clients

    async def go() -> list[str]:
        async with open_database(settings) as (db, _embedded, _label):
            return ["\t".join([c.client_id, c.client_name or "-", c.auth_method, f"{c.live_grants} live grants",
                               " ".join(c.redirect_uris)]) for c in await list_clients(db)]

    for line in asyncio.run(go()):
        _print(line)
    return 0


def cmd_oauth_grants_list(settings: Settings, args: argparse.Namespace) -> int:
    """List grants (id, client, client name, agent, scopes, created, state); live ones unless --all."""
    from actors.mcp.operator import list_grants

    async def go() -> list[str]:
        async with open_database(settings) as (db, _embedded, _label):
            return [g.line() for g in await list_grants(db, include_revoked=args.all)]

    for line in asyncio.run(go()):
        _print(line)
    return 0


def cmd_oauth_revoke(settings: Settings, args: argparse.Namespace) -> int:
    """Revoke a grant by its id, or every live grant of a client by the client id (their tokens stop at once)."""
    from actors.mcp.operator import revoke

    async def go() -> int:
        async with open_database(settings) as (db, _embedded, _label):
            return await revoke(db, args.id)

    count = asyncio.run(go())
    if count == 0:
        _fail(settings, f"toastmachine: no live grant or client {args.id!r}")
        return 1
    _print(f"revoked {count} grant{'s' if count != 1 else ''}; their access and refresh tokens no longer work")
    return 0


def _fail(settings: Settings, line: str) -> None:
    """Why the process stops, on stderr; in JSON log mode as one error record."""
    if settings.log_format == "json":
        log.error("cli.failed", detail=line)
    else:
        print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``toastmachine`` console script."""
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except ConfigError as e:
        print(f"toastmachine: configuration error: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    try:
        return int(args.func(settings, args))
    except ConfigError as e:
        _fail(settings, f"toastmachine: {e}")
        return 2
    except AlreadyInUse as e:
        # A second node on the same data directory or port: one sentence, no traceback.
        _fail(settings, f"toastmachine: {e}")
        return 1
    except ToastMachineError as e:
        # Services unreachable at start: say so plainly, without a traceback.
        _fail(settings, f"toastmachine: {e}")  # (our messages say what happened: no class names)
        return 1
    except KeyboardInterrupt:
        return 130


def console() -> NoReturn:
    """The ``toastmachine`` console script (and ``python -m toastmachine.cli``): :func:`main`, then exit.

    A process that used the archive store exits without finalizing the interpreter, once its atexit
    handlers have run and its output is flushed: obstore runs a Tokio runtime whose worker threads
    are never told to stop, and one still finishing a task while the interpreter is torn down
    panics, which aborts the process (SIGABRT instead of the exit code; seen about once in four full
    test runs, after `archive restore` had printed its usage error). Everything the command does is
    done by then; only the teardown of Python objects is skipped."""
    code = main()
    if "obstore" not in sys.modules:
        sys.exit(code)
    atexit._run_exitfuncs()  # e.g. an embedded PostgreSQL's own cleanup, logging's flush
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
