"""The archive's object store: create-only put, get, head and list over a directory or S3 (SPEC §5).

One small contract, :class:`ArchiveStore`, over `obstore` (the Rust ``object_store`` bindings), so a
local directory and any S3-compatible server take the same code path:

- ``TOASTMACHINE_ARCHIVE_URL`` unset: the directory ``DATA_DIR/archive``; a path or ``file:///path``:
  that directory; ``s3://bucket[/prefix]``: that bucket, with endpoint, region and credentials from
  ``TOASTMACHINE_ARCHIVE_S3_*`` (else obstore's defaults, i.e. the ``AWS_*`` environment).
- :meth:`ArchiveStore.put` is create-only (S3 ``If-None-Match: *``; obstore's exclusive create on a
  directory, done here as obstore does it: see :meth:`ArchiveStore._create_file`). When the key
  exists, the stored bytes are fetched and compared: identical is success
  (a retried upload after a crash), different raises :class:`ForkAlarm`, which the archiver must treat as
  fatal: two histories are claiming the same name.
- :meth:`ArchiveStore.replace` overwrites, and exists only for the derived ``manifest.json``.
- :meth:`ArchiveStore.probe_create_only` checks, with a throw-away key under ``probes/``, that the
  store really refuses a second create (some S3-compatible stores ignore the precondition).

Reads are bounded: :meth:`get` refuses an object larger than ``max_bytes`` before reading it. On a
directory, :meth:`put` and :meth:`get` write and read the files themselves (an object is written
under a staging name and linked into place, as obstore does it, so a file at a key is always whole):
measured, obstore's local get cost eight times a plain read and its put twice the CPU of a plain
write, and the archiver writes and reads back every segment once.
Errors from the store are re-raised as :class:`ArchiveStoreError` naming the operation and key,
never the store's credentials.

Not here yet: the archiver's back-off and retry policy around these calls (issue #11, item 1).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, NotFoundError, PreconditionError
from obstore.store import LocalStore, S3Store

from infra.config import Settings
from infra.redact import redact_url
from protocol.archive import MAX_SEGMENT_BYTES
from protocol.errors import ConfigError, ToastMachineError


class ArchiveStoreError(ToastMachineError):
    """The object store failed or refused an operation (unreachable, denied, vanished object)."""


class ObjectNotFound(ArchiveStoreError):
    """No object under that key."""


class StoreMissing(ArchiveStoreError):
    """The store's bucket does not exist: there is no archive there (and nothing can be written)."""


class ObjectTooLarge(ArchiveStoreError):
    """The object is larger than the caller's bound; it was not read."""


class ForkAlarm(ArchiveStoreError):
    """A create-only put found different bytes under its key: the archive has forked. Stop loudly."""

    def __init__(self, key: str, stored_sha256: str, new_sha256: str) -> None:
        self.key = key
        self.stored_sha256 = stored_sha256
        self.new_sha256 = new_sha256
        super().__init__(f"fork alarm: {key} already holds different bytes (stored sha256 {stored_sha256}, "
                         f"new {new_sha256}); stop archiving and investigate")


class CreateOnlyIgnored(ArchiveStoreError):
    """The store overwrote an existing object on a create-only put: it cannot hold an archive."""


class PutOutcome(enum.Enum):
    """What a create-only put did."""

    CREATED = "created"
    #: The key already held exactly these bytes (a retry after a crash): nothing written.
    ALREADY_PRESENT = "already_present"


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a head or a listing says about one object."""

    key: str
    size: int
    etag: str | None


@dataclass(frozen=True, slots=True)
class S3Options:
    """Where and how to reach an S3-compatible store; None fields fall back to obstore's defaults."""

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None

    def __repr__(self) -> str:
        return f"S3Options(endpoint={self.endpoint!r}, region={self.region!r}, access_key_id=...)"


#: Short client timeouts and few retries: the archiver owns the retry policy (back off, catch up),
#: so one call must not hang for minutes inside obstore's own retry loop.
_CLIENT_OPTIONS: dict[str, Any] = {"timeout": timedelta(seconds=60), "connect_timeout": timedelta(seconds=10)}
_RETRY: dict[str, Any] = {"max_retries": 2}


#: Keys a directory store reads as plain paths (every key the archive writes); others go through obstore.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
#: A directory store reads and writes files up to this size on the event loop, larger ones in a
#: thread. Measured on a 120,000-event catch-up, writing every 0.5 MiB segment in a thread instead
#: was slower: each hand-off to a thread and back costs more than the write it moves.
_READ_INLINE = 1 << 20
#: A staging file's name: an object's name, "#", digits (obstore's local store uses the same form).
_STAGING_NAME = re.compile(r".+#[0-9]+")
#: Seconds a staging file must have been left untouched before :meth:`ArchiveStore.sweep_staging`
#: removes it.
STAGING_MAX_AGE = 3600.0
#: Threads a directory store's sync spreads its files' fsyncs over: concurrent fsyncs share the
#: filesystem journal's commits. Measured on a 120,000-event catch-up (3 rounds each): the syncs
#: took 0.85-0.97 s in one thread, 0.64-0.84 s in four.
SYNC_LANES = 4


#: The S3 error code in a server's XML answer (``<Code>NoSuchBucket</Code>``).
_S3_CODE = re.compile(r"<Code>([A-Za-z]{1,64})</Code>")
#: What an S3 error code means to the operator, and what to check.
_S3_CAUSES = {
    "NoSuchBucket": "the bucket does not exist",
    "SignatureDoesNotMatch": "the server refused the credentials' signature "
                             "(check TOASTMACHINE_ARCHIVE_S3_SECRET_ACCESS_KEY)",
    "InvalidAccessKeyId": "the server knows no such access key id (check TOASTMACHINE_ARCHIVE_S3_ACCESS_KEY_ID)",
    "AccessDenied": "access denied (the credentials lack a permission on this bucket)",
    "InvalidBucketName": "the bucket name is not valid",
    "SlowDown": "the server asks to slow down",
}


def _cause(e: BaseException) -> tuple[str, str | None]:
    """Why a store call failed, in words that hold nothing of the server's answer but its S3 error
    code (a fixed vocabulary); and that code, when there is one."""
    text = str(e)
    found = _S3_CODE.search(text)
    if found is not None:
        code = found.group(1)
        return f"{_S3_CAUSES.get(code, 'the server answered')} ({code})", code
    if "169.254.169.254" in text or "169.254.170.2" in text:
        # No credentials were given, so the client asked the cloud's instance metadata for some.
        return ("no credentials (set TOASTMACHINE_ARCHIVE_S3_ACCESS_KEY_ID and "
                "TOASTMACHINE_ARCHIVE_S3_SECRET_ACCESS_KEY, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"), None
    if "error sending request" in text or "dns error" in text or "Connection refused" in text:
        return f"the server is unreachable (check TOASTMACHINE_ARCHIVE_S3_ENDPOINT) ({type(e).__name__})", None
    if "timed out" in text or "TimedOut" in text:
        return f"the server did not answer in time ({type(e).__name__})", None
    return type(e).__name__, None


def _check_key(key: str) -> None:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a relative object key: {key!r}")


class ArchiveStore:
    """Create-only object storage for archive segments, checkpoints and the manifest."""

    def __init__(self, store: LocalStore | S3Store, description: str, directory: Path | None = None) -> None:
        """Wrap an obstore store; ``description`` names it in messages (no credentials in it);
        ``directory``: the local store's root, read directly by :meth:`get`."""
        self._store = store
        self.description = description
        self._directory = directory

    @classmethod
    def local(cls, directory: Path) -> ArchiveStore:
        """A store in ``directory`` (created if missing)."""
        directory = directory.expanduser().resolve()
        directory.mkdir(parents=True, exist_ok=True)
        return cls(LocalStore(directory, mkdir=True), f"directory {directory}", directory)

    @classmethod
    def s3(cls, bucket: str, prefix: str, options: S3Options) -> ArchiveStore:
        """A store in ``bucket`` under ``prefix`` on an S3-compatible server."""
        config: dict[str, Any] = {}
        client = dict(_CLIENT_OPTIONS)
        # Without TOASTMACHINE_ARCHIVE_S3_ENDPOINT, obstore takes AWS_ENDPOINT_URL (or AWS_ENDPOINT)
        # from the environment, as the README says: name it, and let an http:// one through too.
        endpoint = options.endpoint or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
        if options.endpoint:
            config["endpoint"] = options.endpoint
        if endpoint:
            # obstore refuses plain HTTP unless told; an http:// endpoint is an explicit choice.
            client["allow_http"] = endpoint.startswith("http://")
        if options.region:
            config["region"] = options.region
        if options.access_key_id:
            config["access_key_id"] = options.access_key_id
        if options.secret_access_key:
            config["secret_access_key"] = options.secret_access_key
        store = S3Store(bucket, prefix=prefix or None, config=config, client_options=client,  # type: ignore[arg-type]
                        retry_config=_RETRY)  # type: ignore[arg-type]
        where = f"s3://{bucket}/{prefix}".rstrip("/")
        return cls(store, f"{where} at {redact_url(endpoint) if endpoint else 'the default endpoint'}")

    @staticmethod
    def local_directory(url: str | None, data_dir: Path) -> Path | None:
        """The directory a ``TOASTMACHINE_ARCHIVE_URL`` value names, or None when it names no directory."""
        if url is None:
            return data_dir / "archive"
        if "://" not in url:
            return Path(url)
        parts = urlsplit(url)
        return Path(unquote(parts.path)) if parts.scheme == "file" else None

    @classmethod
    def from_url(cls, url: str | None, *, data_dir: Path, s3: S3Options | None = None) -> ArchiveStore:
        """The store named by a ``TOASTMACHINE_ARCHIVE_URL`` value (None: ``data_dir/archive``)."""
        directory = cls.local_directory(url, data_dir)
        if directory is not None:
            try:
                return cls.local(directory)
            except OSError as e:  # a file there, a path under /proc, no permission...
                raise ConfigError(f"the archive directory {directory} cannot be used: "
                                  f"{e.strerror or type(e).__name__} (TOASTMACHINE_ARCHIVE_URL, or "
                                  "TOASTMACHINE_DATA_DIR when it is unset, must name a directory this "
                                  "process can create and write)") from None
        assert url is not None
        parts = urlsplit(url)
        if parts.scheme == "s3" and parts.netloc:
            return cls.s3(parts.netloc, unquote(parts.path).strip("/"), s3 or S3Options())
        raise ConfigError("TOASTMACHINE_ARCHIVE_URL must be a directory, file:// or s3://bucket[/prefix] URL")

    @classmethod
    def from_settings(cls, settings: Settings) -> ArchiveStore:
        """The store the configuration names."""
        return cls.from_url(settings.archive_url, data_dir=settings.data_dir, s3=S3Options(
            settings.archive_s3_endpoint, settings.archive_s3_region,
            settings.archive_s3_access_key_id, settings.archive_s3_secret_access_key))

    def _failed(self, op: str, key: str, e: BaseException) -> ArchiveStoreError:
        # obstore's message carries the server's whole XML answer, which is never repeated: only the
        # S3 error code in it, or what kind of failure it was (see _cause); the original stays
        # chained for a debug log.
        cause, code = _cause(e)
        kind = StoreMissing if code == "NoSuchBucket" else ArchiveStoreError
        return kind(f"archive store ({self.description}): {op} {key} failed: {cause}")

    async def _create(self, key: str, data: bytes, op: str) -> bool:
        """Create ``key`` with ``data``: True, or False when the key exists (nothing written)."""
        try:
            if self._directory is not None and _PLAIN_KEY.fullmatch(key):
                return await self._create_file(key, data)
            # One request, never multipart: conditional create applies to a single PUT everywhere.
            await obstore.put_async(self._store, key, data, mode="create", use_multipart=False)
            return True
        except (AlreadyExistsError, PreconditionError, FileExistsError):
            return False
        except (BaseError, OSError) as e:
            raise self._failed(op, key, e) from e

    async def put(self, key: str, data: bytes) -> PutOutcome:
        """Create ``key`` with ``data``; if it exists, success when identical, ForkAlarm otherwise.

        On a directory the bytes may still be in the operating system's cache when this returns:
        :meth:`sync` makes them durable."""
        _check_key(key)
        if await self._create(key, data, "put"):
            return PutOutcome.CREATED
        try:
            stored = await self.get(key, max_bytes=len(data))
        except ObjectTooLarge:
            stored = None
        except ObjectNotFound:
            raise ArchiveStoreError(f"archive store ({self.description}): {key} was reported present "
                                    "and then missing; retry the put") from None
        if stored == data:
            return PutOutcome.ALREADY_PRESENT
        stored_hash = hashlib.sha256(stored).hexdigest() if stored is not None else "(larger object)"
        raise ForkAlarm(key, stored_hash, hashlib.sha256(data).hexdigest())

    async def replace(self, key: str, data: bytes) -> None:
        """Write ``key`` whatever it held. Only for derived objects (``manifest.json``)."""
        _check_key(key)
        try:
            await obstore.put_async(self._store, key, data, mode="overwrite", use_multipart=False)
        except (BaseError, OSError) as e:
            raise self._failed("replace", key, e) from e

    async def get(self, key: str, *, max_bytes: int = MAX_SEGMENT_BYTES) -> bytes:
        """The bytes of ``key``; ObjectNotFound, or ObjectTooLarge when over ``max_bytes`` (not read)."""
        _check_key(key)
        if self._directory is not None and _PLAIN_KEY.fullmatch(key):
            return await self._read_file(key, max_bytes)
        try:
            result = await obstore.get_async(self._store, key)
            size = int(result.meta["size"])
            if size > max_bytes:
                raise ObjectTooLarge(f"{key} is {size} bytes, more than {max_bytes}")
            data = bytes(await result.bytes_async())
        except (NotFoundError, FileNotFoundError) as e:
            if _cause(e)[1] == "NoSuchBucket":  # the bucket is missing, not the object
                raise self._failed("get", key, e) from e
            raise ObjectNotFound(f"archive store ({self.description}): no object {key}") from None
        except (BaseError, OSError) as e:
            raise self._failed("get", key, e) from e
        if len(data) != size:
            raise ArchiveStoreError(f"archive store ({self.description}): {key} changed while being read")
        return data

    async def sync(self, keys: list[str]) -> None:
        """Make the objects under ``keys`` durable: on a directory, each file and then the directories
        holding them are flushed to disk (fsync), the files over :data:`SYNC_LANES` threads, before
        the caller records them verified or published; on S3 a put is durable once answered, so
        nothing to do. Measured here: about 0.12 s for 125 MB in 250 files on an idle disk.
        ObjectNotFound when a key has no object."""
        if self._directory is None or not keys:
            return
        for key in keys:
            _check_key(key)
        directory = self._directory

        def flush_files(paths: list[Path]) -> None:
            for path in paths:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        paths = [directory / key for key in keys]
        parents = sorted({path.parent for path in paths})  # the links' directory entries
        try:
            await asyncio.gather(*(asyncio.to_thread(flush_files, paths[lane::SYNC_LANES])
                                   for lane in range(min(SYNC_LANES, len(paths)))))
            await asyncio.to_thread(flush_files, parents)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(f"archive store ({self.description}): an object to sync is gone") from None
        except OSError as e:
            raise self._failed("sync", keys[0], e) from e

    async def _create_file(self, key: str, data: bytes) -> bool:
        """:meth:`put` on a directory, as obstore's local store does it: the bytes go to a staging
        file beside the key, named ``<name>#<random digits>`` (the form of obstore's own staging
        files, which its listings skip), then hard-linked to the key; the link fails when the key
        exists, so a file at a key is always whole and never replaced. True when created, False
        when the key existed. A small file is written on the event loop, a larger one in a thread,
        as :meth:`_read_file` reads."""
        assert self._directory is not None
        path = self._directory / key
        staging = path.with_name(f"{path.name}#{uuid.uuid4().int}")  # digits after "#": obstore's staging form

        def write() -> bool:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except FileExistsError as e:  # a file stands where a directory of the key must be
                raise NotADirectoryError(f"{path.parent} is not a directory") from e
            try:
                with staging.open("xb") as f:
                    f.write(data)
                try:
                    os.link(staging, path)
                except FileExistsError:
                    return False
                return True
            finally:
                staging.unlink(missing_ok=True)

        return write() if len(data) <= _READ_INLINE else await asyncio.to_thread(write)

    async def _read_file(self, key: str, max_bytes: int) -> bytes:
        """:meth:`get` on a directory: the file under the key (a small one read at once, a larger one
        in a thread, so the event loop never waits long on the disk)."""
        assert self._directory is not None
        path = self._directory / key
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise ObjectTooLarge(f"{key} is {size} bytes, more than {max_bytes}")
                data = f.read(size + 1) if size <= _READ_INLINE else await asyncio.to_thread(f.read, size + 1)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(f"archive store ({self.description}): no object {key}") from None
        except OSError as e:
            raise self._failed("get", key, e) from e
        if len(data) != size:
            raise ArchiveStoreError(f"archive store ({self.description}): {key} changed while being read")
        return data

    async def head(self, key: str) -> ObjectInfo | None:
        """Size and ETag of ``key``, or None when there is no such object."""
        _check_key(key)
        try:
            meta = await obstore.head_async(self._store, key)
        except (NotFoundError, FileNotFoundError):
            return None
        except (BaseError, OSError) as e:
            raise self._failed("head", key, e) from e
        return ObjectInfo(str(meta["path"]), int(meta["size"]), meta.get("e_tag"))

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` + "/" (all when empty), in pages of 500.

        Order is the store's (lexicographic on S3 and, in practice, on directories); sort if it matters.
        """
        if prefix:
            _check_key(prefix)
        try:
            async for chunk in obstore.list(self._store, prefix or None, chunk_size=500):
                for meta in chunk:
                    yield ObjectInfo(str(meta["path"]), int(meta["size"]), meta.get("e_tag"))
        except (BaseError, OSError) as e:
            raise self._failed("list", prefix or "(all)", e) from e

    async def sweep_staging(self, older_than: float = STAGING_MAX_AGE) -> tuple[int, int]:
        """Remove the staging files (``<name>#<digits>``, see :meth:`_create_file`) that a crash
        between writing one and linking it left behind, once older than ``older_than`` seconds (a
        put's own lives for milliseconds, so a younger one may still be in use): ``(removed, left)``,
        ``left`` counting the old ones that could not be removed (or folders not read). Never raises:
        listings and reads skip these files anyway, so this only gives their space back and must
        not hold anything up. Nothing to do on S3, whose puts leave nothing behind."""
        if self._directory is None:
            return 0, 0
        directory = self._directory

        def sweep() -> tuple[int, int]:
            cutoff = time.time() - older_than
            removed = left = 0

            def unreadable(_error: OSError) -> None:
                nonlocal left
                left += 1

            for folder, _dirs, files in os.walk(directory, onerror=unreadable):
                for name in files:
                    if not _STAGING_NAME.fullmatch(name):
                        continue
                    path = os.path.join(folder, name)
                    try:
                        if os.lstat(path).st_mtime < cutoff:
                            os.unlink(path)
                            removed += 1
                    except FileNotFoundError:  # a put's own, just linked and removed
                        pass
                    except OSError:
                        left += 1
            return removed, left

        return await asyncio.to_thread(sweep)

    async def probe_create_only(self) -> None:
        """Raise CreateOnlyIgnored unless a second create of the same key is refused.

        Leaves one small object under ``probes/`` (the contract has no delete, on purpose).
        """
        key = f"probes/{uuid.uuid4()}"
        first, second = b"create-only probe: first\n", b"create-only probe: second\n"
        # The same create as put's (on a directory, this store's own), so the probe tests that path.
        if not await self._create(key, first, "probe put"):
            raise self._failed("probe put", key, FileExistsError(key))
        if not await self._create(key, second, "probe put"):
            return
        raise CreateOnlyIgnored(f"archive store ({self.description}) overwrote {key} on a create-only put; "
                                "it cannot hold a write-once archive")
