"""A second real S3 implementation for tests: moto's S3 server (``moto.server.ThreadedMotoServer``).

:func:`moto_s3` runs it in a thread of the test process on a free loopback port, creates the bucket
and hands back an :class:`~tests.s3_server.S3Server` describing it, so stores on it are built with
the same S3 options as those on SeaweedFS. moto honours ``If-None-Match: *`` on PutObject (a second
create of a key answers 412), so it holds a write-once archive and runs the same store tests.
Unlike SeaweedFS it keeps everything in memory and accepts any credentials.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from infra.archive_store import ArchiveStoreError
from tests import services
from tests.procs import free_port
from tests.s3_server import ACCESS_KEY, BUCKET, SECRET_KEY, S3Server


def _unavailable(why: str) -> None:
    if services.REQUIRED:
        pytest.fail(f"moto's S3 server is required (TOASTMACHINE_REQUIRE_SERVICES=1) but {why}")
    services.SKIPPED["moto"] = why
    pytest.skip(f"moto's S3 server unavailable: {why}")


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Server]:
    """One moto S3 server for the whole run, with the test bucket; each test works under a prefix."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        _unavailable(f"moto is not installed (pip install 'moto[server]'): {e}")
        raise  # unreachable: _unavailable skips or fails
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        # The bucket is made with moto's own client library (boto3 comes with moto); the store
        # itself never creates buckets.
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
                     aws_secret_access_key=SECRET_KEY).create_bucket(Bucket=BUCKET)
        described = S3Server(endpoint, BUCKET, ACCESS_KEY, SECRET_KEY, {"s3": port})
        try:
            asyncio.run(described.store("readiness").put(f"probe-{uuid.uuid4().hex}", b"ready?"))
        except ArchiveStoreError as e:
            _unavailable(f"a create-only PUT failed: {e}")
        yield described
    finally:
        server.stop()
