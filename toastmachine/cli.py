"""The ``toastmachine`` command line: up, web, run ACTOR, migrate, doctor.

Exit codes: 0 success, 1 a service failed or shutdown missed its deadline, 2 bad configuration
or usage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from actors.registry import ACTORS
from infra.bus import make_bus
from infra.bus.base import COMMANDS_EXCHANGE
from infra.config import Settings, redact_url
from infra.logs import configure_logging, get_logger
from protocol.errors import ConfigError, ToastMachineError
from protocol.messages import ErrorReply, Ping, Pong
from toastmachine.node import open_database, serve

log = get_logger("toastmachine.cli")


def _print(line: str) -> None:
    print(line, flush=True)


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
    return _run(serve(settings, actors=list(ACTORS), web=True, allow_memory_bus=True, announce=_print))


def cmd_web(settings: Settings, args: argparse.Namespace) -> int:
    """The web front alone (ingress and hub); needs TOASTMACHINE_AMQP_URL."""
    return _run(serve(settings, actors=[], web=True, allow_memory_bus=False, announce=_print))


def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    """One back-end actor in this process; needs TOASTMACHINE_AMQP_URL."""
    return _run(serve(settings, actors=[args.actor], web=False, allow_memory_bus=False, announce=_print))


def cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    """Apply pending migrations (under an advisory lock, so concurrent runs are safe) and exit."""

    async def go() -> None:
        # open_database migrates on entry; there is nothing more to do.
        async with open_database(settings) as (_db, _embedded, label):
            _print(f"migrations applied: {label}")

    asyncio.run(go())
    return 0


def cmd_doctor(settings: Settings, args: argparse.Namespace) -> int:
    """Check configuration and connectivity, one line each; exit 1 if any check fails."""
    from infra.db import Database, pending_migrations, read_identity, start_embedded

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
                        raise ConfigError(f"{len(pending)} pending ({', '.join(pending)}): run 'toastmachine migrate'")
                    return "schema up to date"

                async def corpus() -> str:
                    ident = await read_identity(db)
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
            if await check("bus", connect):

                async def writer() -> str:
                    started = time.perf_counter()
                    reply = await bus.request(COMMANDS_EXCHANGE, Ping.TYPE, Ping(nonce=uuid.uuid4().hex), timeout=5)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toastmachine",
        description="ToastMachine node. Configuration comes from TOASTMACHINE_* environment variables (see README).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("up", help=cmd_up.__doc__).set_defaults(func=cmd_up)
    sub.add_parser("web", help=cmd_web.__doc__).set_defaults(func=cmd_web)
    run = sub.add_parser("run", help=cmd_run.__doc__)
    run.add_argument("actor", choices=sorted(ACTORS), help="the actor to run")
    run.set_defaults(func=cmd_run)
    sub.add_parser("migrate", help=cmd_migrate.__doc__).set_defaults(func=cmd_migrate)
    sub.add_parser("doctor", help=cmd_doctor.__doc__).set_defaults(func=cmd_doctor)
    return parser


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
        print(f"toastmachine: {e}", file=sys.stderr)
        return 2
    except ToastMachineError as e:
        # Services unreachable at start: say so plainly, without a traceback.
        print(f"toastmachine: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
