"""The recovery commands of the CLI: ``archive verify``, ``archive restore`` and ``mirror``.

Thin: each parses its options, opens what it needs (the store, the database) and calls
:mod:`actors.recovery`, which holds the logic. Reports are JSON on stdout.

Exit codes: 0 success; 1 a discrepancy (verify), a refused or failed restore; 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from infra.archive_keys import KEY_FILE
from infra.archive_store import ArchiveStore, ArchiveStoreError, S3Options, StoreMissing
from infra.config import Settings, check_archive_url
from protocol.archive import manifest_key
from protocol.checkpoint import CheckpointError, VerifierKey, parse_signer_key, parse_verifier_key
from protocol.errors import ConfigError

if TYPE_CHECKING:  # imported where used: the command line starts without the actors
    from actors.recovery.load import LoadProgress


def _print_json(value: Any) -> None:
    sys.stdout.buffer.write(orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n")
    sys.stdout.buffer.flush()


class NoSuchStore(ConfigError):
    """A store given on the command line names a directory, or a bucket, that does not exist."""

    def __init__(self, message: str, description: str) -> None:
        super().__init__(message)
        #: The store as reports name it (``directory /abs/path``).
        self.description = description


def _location(value: str) -> str:
    """An argument naming a store or a node, refused (exit 2, one line) when it does not parse as
    a URL or a path: ``http://[::1/`` would otherwise fail later with a traceback."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises for a malformed port or bracketed host
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value[:200]!r} is not a URL or a path: {e}") from None
    return value


def open_store(settings: Settings, url: str | None, *, option: str = "--from") -> ArchiveStore:
    """The store ``url`` names (directory, file:// or s3:// with the configured S3 options), else the
    configured archive store.

    These commands only read: a directory ``url`` that does not exist raises :class:`NoSuchStore`
    (named after ``option``) instead of being created, so a mistyped path is reported, not
    turned into an empty archive.
    """
    if url is None:
        return ArchiveStore.from_settings(settings)
    check_archive_url(option, url)
    directory = ArchiveStore.local_directory(url, settings.data_dir)
    if directory is not None and not directory.is_dir():
        where = directory.expanduser().resolve()
        what = "is not a directory" if directory.exists() else "does not exist"
        raise NoSuchStore(f"{option} {url}: no archive there, the directory {where} {what}", f"directory {where}")
    return ArchiveStore.from_url(url, data_dir=settings.data_dir, s3=S3Options(
        settings.archive_s3_endpoint, settings.archive_s3_region,
        settings.archive_s3_access_key_id, settings.archive_s3_secret_access_key))


def pinned_key(text: str | None) -> VerifierKey | None:
    """A ``--public-key`` value: the verifier key itself, or a file holding it."""
    if text is None:
        return None
    if "+" not in text:
        # No '+': not a key, so a file holding one; say which of the two went wrong.
        path = Path(text)
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
            raise ConfigError(f"--public-key {text}: neither a verifier key (<name>+<key id>+<key>) nor a "
                              f"readable file holding one ({reason})") from None
        try:
            return parse_verifier_key(content)
        except CheckpointError as e:
            raise ConfigError(f"--public-key {text}: the file does not hold a verifier key: {e}") from None
    try:
        return parse_verifier_key(text)
    except CheckpointError as e:
        raise ConfigError(f"--public-key: {e}") from None


def operator_key(settings: Settings) -> VerifierKey | None:
    """The public half of the operator's signing key, if there is one (never created here: a
    verifier must not mint the key it then trusts)."""
    if settings.archive_signing_key is not None:
        return parse_signer_key(settings.archive_signing_key).verifier()
    path = settings.data_dir / KEY_FILE
    if not path.exists():
        return None
    try:
        return parse_signer_key(path.read_text()).verifier()
    except (OSError, CheckpointError) as e:
        raise ConfigError(f"the archive signing key {path} cannot be read: {e}") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:  # 0 or less would poll without pause; nan fails this test too
        raise argparse.ArgumentTypeError(f"{text!r}: give more than 0 and at most 3600 seconds")
    return value


async def only_lineage(store: ArchiveStore) -> uuid.UUID | None:
    """The one lineage ``store`` archives, None when it holds none; ConfigError when it holds several
    (the commands that read one then need ``--lineage``)."""
    from actors.recovery.walk import archived_lineages

    try:
        found = await archived_lineages(store)
    except StoreMissing as e:  # a mistyped bucket: no archive there, as for a missing directory
        raise NoSuchStore(f"no archive there: {e}", store.description) from None
    if len(found) > 1:
        raise ConfigError(f"the store holds {len(found)} lineages ({', '.join(map(str, found))}): "
                          "choose one with --lineage")
    return found[0] if found else None


def _lineage(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a lineage (a UUID)") from None


# --- archive verify --------------------------------------------------------------------------------


def cmd_archive_verify(settings: Settings, args: argparse.Namespace) -> int:
    """Check the archive against itself and the database; print a JSON report; exit 1 on any discrepancy."""
    from actors.recovery.verify import verify_archive
    from actors.recovery.walk import StoreSource
    from infra.db import read_identity
    from toastmachine.node import open_database

    try:
        store = open_store(settings, args.from_store, option="--from-store")
    except NoSuchStore as e:
        _print_json(_nothing(e.description, str(e)))  # the report's contract: nothing verified, exit 1
        return 1
    trusted = pinned_key(args.public_key) or operator_key(settings)

    async def choose_lineage(db: Any) -> uuid.UUID | None:
        if args.lineage is not None:
            return args.lineage  # type: ignore[no-any-return]
        if db is not None:
            identity = await read_identity(db)
            if identity is not None:
                return identity.lineage
        return await only_lineage(store)

    async def go() -> dict[str, Any]:
        if args.no_database:
            lineage = await choose_lineage(None)
            if lineage is None:
                return _nothing(store.description)
            return (await verify_archive(StoreSource(store), lineage, trusted=trusted)).to_json()
        async with open_database(settings) as (db, _embedded, _label):
            lineage = await choose_lineage(db)
            if lineage is None:
                return _nothing(store.description)
            # The configured store is the archiver's: it holds every checkpoint the database records
            # as published. A store named by --from-store may be a copy (a replica, a backup) that lags.
            return (await verify_archive(StoreSource(store), lineage, trusted=trusted, db=db,
                                         archiver_store=args.from_store is None)).to_json()

    try:
        report = asyncio.run(go())
    except NoSuchStore as e:
        report = _nothing(e.description, str(e))
    except ArchiveStoreError as e:  # the lineages could not be listed: still the report, saying why
        report = _nothing(store.description, str(e), kind="unlistable_store")
    _print_json(report)
    return 0 if report["ok"] else 1


def _nothing(source: str, message: str = "no archived lineage in the store", *,
             kind: str = "nothing_verified") -> dict[str, Any]:
    return {"ok": False, "archive": {"source": source}, "database": None,
            "findings": [{"kind": kind, "message": message}]}


# --- archive restore -------------------------------------------------------------------------------

#: Seconds between two progress lines of ``archive restore`` (and a mirror's archive rounds) at least.
PROGRESS_EVERY = 5.0


#: A following mirror reports only rounds of at least this many changes (a catch-up), not each
#: segment the node archives.
FOLLOWING_PROGRESS_FROM = 4000


def progress_printer(command: str, *, min_changes: int = 0) -> Callable[[LoadProgress], None]:
    """What tells an operator on stderr (stdout carries the command's JSON) how far a load of
    archived history is: its first step, then a line per :data:`PROGRESS_EVERY` seconds, and its
    last, so a long restore or first mirror build shows it is moving and how far it has to go.
    Loads of fewer than ``min_changes`` changes say nothing."""
    load = [-1]  # the changes_at_start of the load being shown (a mirror's rounds each start anew)
    shown = [-PROGRESS_EVERY]

    def show(at: LoadProgress) -> None:
        if at.changes_archived - at.changes_at_start < min_changes:
            return
        if at.changes_at_start != load[0]:
            load[0], shown[0] = at.changes_at_start, -PROGRESS_EVERY  # a new load: its first step shows
        if at.seconds - shown[0] < PROGRESS_EVERY and at.changes_done < at.changes_archived:
            return
        shown[0] = at.seconds
        share = f" ({100 * at.changes_done / at.changes_archived:.0f}%)" if at.changes_archived else ""
        # This load's own changes: a mirror's round starts from the tree it already holds.
        rate = (at.changes_done - at.changes_at_start) / at.seconds if at.seconds > 0 else 0.0
        print(f"toastmachine: {command}: {at.changes_done:,} of {at.changes_archived:,} archived changes "
              f"loaded{share}, through sequence {at.through_sequence:,}, {rate:,.0f} changes/s "
              "(committed once all is checked)", file=sys.stderr, flush=True)

    return show


def cmd_archive_restore(settings: Settings, args: argparse.Namespace) -> int:
    """Restore an archive into an EMPTY database under a fresh lineage (verified before anything is written)."""
    from actors.recovery.restore import RestoreRefused, restore_archive
    from actors.recovery.walk import StoreSource
    from toastmachine.node import open_database

    store = open_store(settings, args.source)
    trusted = pinned_key(args.public_key) or operator_key(settings)

    async def go() -> dict[str, Any]:
        lineage = args.lineage or await only_lineage(store)
        if lineage is None:
            raise ConfigError(f"--from {args.source}: no archive there ({store.description} holds no "
                              "lineage with a manifest.json)")
        if args.lineage is not None and await store.head(manifest_key(lineage)) is None:
            raise ConfigError(f"--lineage {lineage}: no archive of that lineage in {store.description} "
                              "(no manifest.json under it)")
        async with open_database(settings) as (db, _embedded, _label):
            report = await restore_archive(StoreSource(store), lineage, db, trusted=trusted,
                                           new_lineage=args.new_lineage or settings.lineage,
                                           republish=args.republish, keep_signing_key=not args.new_signing_key,
                                           progress=progress_printer("restore"))
        if settings.corpus_id is not None and settings.corpus_id != report.corpus_id:
            # Written already (the archive decides the corpus); say so before a node refuses to start.
            print(f"toastmachine: note: TOASTMACHINE_CORPUS_ID={settings.corpus_id} but the restored corpus is "
                  f"{report.corpus_id}: change the configuration", file=sys.stderr)
        return report.to_json()

    try:
        report = asyncio.run(go())
    except RestoreRefused as e:
        _print_json({"ok": False, "refused": str(e), "findings": [f.report() for f in e.findings]})
        print(f"toastmachine: restore refused, nothing written: {e}", file=sys.stderr, flush=True)
        return 1
    _print_json(report)
    return 0


# --- mirror ----------------------------------------------------------------------------------------


def cmd_mirror(settings: Settings, args: argparse.Namespace) -> int:
    """Build a read-only copy of a node's history from its archive (verified against a pinned key), then follow it."""
    import signal

    import aiohttp

    from actors.recovery.mirror import Mirror, MirrorError
    from toastmachine.node import open_database

    trusted = pinned_key(args.public_key)
    assert trusted is not None  # required by the parser
    node_url = args.source if args.source.startswith(("http://", "https://")) else None

    async def open_mirror(session: aiohttp.ClientSession, db: Any) -> Mirror:
        source, lineage = await _mirror_source(settings, session, args, node_url)
        return Mirror(source, lineage, db, trusted=trusted, node_url=node_url, session=session,
                      progress=progress_printer("mirror", min_changes=0 if args.once else FOLLOWING_PROGRESS_FROM))

    async def catch_up(mirror: Mirror) -> None:
        await mirror.archive_round()
        while await mirror.tail_round():
            pass

    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, open_database(settings) as (db, _embedded, _label):
            mirror = await open_mirror(session, db)
            if args.once or args.serve:
                # --serve catches up first, here: the database must be the mirror's (its corpus
                # identity the source's) before a node opens it and would make one of its own.
                await catch_up(mirror)
                return mirror.report()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await mirror.run(stop, poll_interval=args.poll)
            return mirror.report()

    try:
        report = asyncio.run(go())
    except MirrorError as e:
        print(f"toastmachine: mirror stopped: {e}", file=sys.stderr, flush=True)
        return 1
    _print_json(report)
    if not args.serve:
        return 0
    if report.get("tree_size", 0) == 0:
        print("toastmachine: mirror: the source has published no archive segment yet, so the copy has no "
              "corpus identity to serve; try again once its archiver published one", file=sys.stderr, flush=True)
        return 1
    return _serve_mirror(settings, args, open_mirror)


def _serve_mirror(settings: Settings, args: argparse.Namespace,
                  open_mirror: Callable[[Any, Any], Awaitable[Any]]) -> int:
    """``mirror --serve``: the caught-up copy served read-only by a web front, its streams fed by a
    publisher, while a :class:`~actors.recovery.mirror.MirrorFollower` keeps following the source."""
    from actors.recovery.mirror import MirrorFollower
    from toastmachine.cli import _announcer, _run
    from toastmachine.node import Node, serve

    def follower(node: Node) -> MirrorFollower:
        return MirrorFollower(lambda session: open_mirror(session, node.db), poll_interval=args.poll)

    return _run(serve(settings, actors=["publisher"], web=True, allow_memory_bus=True,
                      announce=_announcer(settings), extra={"mirror": follower}))


async def _mirror_source(settings: Settings, session: Any, args: argparse.Namespace,
                         node_url: str | None) -> tuple[Any, uuid.UUID]:
    """The archive source the mirror reads (the node's routes, or a store) and the lineage it copies."""
    from actors.recovery.mirror import NodeArchiveSource
    from actors.recovery.walk import StoreSource

    source: Any
    if node_url is not None and args.archive is None:
        source = NodeArchiveSource(session, node_url)
    else:
        source = StoreSource(open_store(settings, args.archive or args.source,
                                        option="--archive" if args.archive else "--from"))
    if args.lineage is not None:
        return source, args.lineage
    if node_url is not None:
        return source, await NodeArchiveSource(session, node_url).lineage()
    lineage = await only_lineage(source.store)
    if lineage is None:
        raise ConfigError(f"no archive in {source.store.description} (no lineage with a manifest.json)")
    return source, lineage


def add_commands(sub: Any) -> None:
    """Add ``archive verify|restore`` and ``mirror`` to the CLI's subcommands.

    Called by :func:`toastmachine.cli.build_parser`; returns nothing. If an ``archive`` parser
    already exists (``archive status`` lives with the archiver), its subparsers are extended.
    """
    archive = sub.choices.get("archive") or sub.add_parser(
        "archive", help="the archive: status, verify, restore")
    actions = next((a for a in archive._actions if isinstance(a, argparse._SubParsersAction)), None)
    if actions is None:
        actions = archive.add_subparsers(dest="archive_command", required=True, metavar="ACTION")
    verify = actions.add_parser("verify", help=cmd_archive_verify.__doc__)
    verify.add_argument("--from-store", metavar="URL", default=None, type=_location,
                        help="the store to check (directory, file:// or s3://); default TOASTMACHINE_ARCHIVE_URL")
    verify.add_argument("--lineage", type=_lineage, default=None,
                        help="the lineage to check (default: the database's, else the store's only one)")
    verify.add_argument("--public-key", metavar="KEY", default=None,
                        help="the pinned verifier key (or a file holding it); default: the operator's signing "
                             "key, else the archive's own public-key.txt (reported as not pinned)")
    verify.add_argument("--no-database", action="store_true", help="check the archive alone")
    verify.set_defaults(func=cmd_archive_verify)
    restore = actions.add_parser("restore", help=cmd_archive_restore.__doc__)
    restore.add_argument("--from", dest="source", metavar="URL", required=True, type=_location,
                         help="the archive store (directory, file:// or s3://bucket/prefix)")
    restore.add_argument("--lineage", type=_lineage, default=None,
                         help="the lineage to restore (default: the store's only one)")
    restore.add_argument("--public-key", metavar="KEY", default=None,
                         help="the pinned verifier key (or a file); default: the operator's signing key, else "
                              "the archive's own public-key.txt")
    restore.add_argument("--new-lineage", type=_lineage, default=None,
                         help="the fresh lineage (default: TOASTMACHINE_LINEAGE, else a random one)")
    restore.add_argument("--republish", action="store_true",
                         help="publish the restored history to RabbitMQ again (default: the publisher starts "
                              "after it)")
    restore.add_argument("--new-signing-key", action="store_true",
                         help="the archive's signing key is lost: the restored corpus signs its new lineage with "
                              "another one (mirrors must pin its public key anew); default: the archive's key, "
                              "which its archivers must have")
    restore.set_defaults(func=cmd_archive_restore)
    mirror = sub.add_parser("mirror", help=cmd_mirror.__doc__)
    mirror.add_argument("--from", dest="source", metavar="URL", required=True, type=_location,
                        help="the node (https://node/: its archive routes and changes.jsonl) or an archive store "
                             "(directory, file:// or s3://bucket/prefix: the archive alone)")
    mirror.add_argument("--public-key", metavar="KEY", required=True,
                        help="the node's checkpoint verifier key, pinned out of band (or a file holding it)")
    mirror.add_argument("--archive", metavar="URL", default=None, type=_location,
                        help="read the node's archive from this store instead of its routes")
    mirror.add_argument("--lineage", type=_lineage, default=None,
                        help="the lineage to mirror (default: the node's, else the store's only one)")
    mode = mirror.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="catch up once and exit instead of following")
    mode.add_argument("--serve", action="store_true",
                      help="catch up, then serve the copy read-only (reads, exports, SSE) on TOASTMACHINE_HOST/PORT "
                           "while following the source")
    mirror.add_argument("--poll", type=_seconds, default=1.0, metavar="SECONDS",
                        help="pause between rounds when there is nothing new (default 1)")
    mirror.set_defaults(func=cmd_mirror)
