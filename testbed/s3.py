"""An S3 endpoint on 127.0.0.1: moto's standalone server, for s3fs and boto3.

    with serve_s3() as (endpoint_url, storage_options):
        upload_folder(root, "corpus", endpoint_url=endpoint_url)
        ds = StreamingJsonl("s3://corpus/", storage=Storage(options=storage_options))

Credentials are dummies and the environment is set (for the block's duration, so DataLoader
workers forked inside it inherit it) so that no client reaches the network: no instance
metadata lookups, no shared config or credential files. moto keeps buckets in memory, in this
process, shared by every server it runs: use a bucket name per test corpus.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["REGION", "offline_aws_env", "serve_s3", "storage_options", "upload_folder"]

REGION = "us-east-1"
KEY = SECRET = "testing"

# no credentials, region or endpoint from the machine; no IMDS (169.254.169.254) lookups
_ENV = {
    "AWS_ACCESS_KEY_ID": KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET,
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
_UNSET = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE")


@contextmanager
def offline_aws_env() -> Iterator[None]:
    """Dummy AWS credentials and no network lookups while the block runs; then as it was."""
    saved = {name: os.environ.get(name) for name in (*_ENV, *_UNSET)}
    os.environ.update(_ENV)
    for name in _UNSET:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def serve_s3() -> Iterator[tuple[str, dict[str, Any]]]:
    """Run moto's S3 on 127.0.0.1 (a free port); yields (endpoint_url, s3fs storage_options)."""
    from moto.server import ThreadedMotoServer  # the "dev" extra

    access_log = logging.getLogger("werkzeug")  # one line per request otherwise
    level = access_log.level
    access_log.setLevel(logging.WARNING)
    with offline_aws_env():
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint_url = f"http://{host}:{port}"
            yield endpoint_url, storage_options(endpoint_url)
        finally:
            server.stop()
            access_log.setLevel(level)


def storage_options(endpoint_url: str) -> dict[str, Any]:
    """s3fs options for the server at `endpoint_url` (fresh instance: no stale listings)."""
    return {
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": REGION},
        "skip_instance_cache": True,
    }


def upload_folder(root: Path, bucket: str, *, endpoint_url: str, prefix: str = "") -> list[str]:
    """Put every file under `root` into `bucket` (created if missing) at `prefix` + its relative
    path; returns the keys, sorted. Uses boto3, so s3fs caches in the caller stay untouched."""
    import boto3  # comes with moto

    client = boto3.client(
        "s3", endpoint_url=endpoint_url, region_name=REGION,
        aws_access_key_id=KEY, aws_secret_access_key=SECRET,
    )
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)
    keys = []
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        key = prefix + path.relative_to(root).as_posix()
        client.upload_file(os.fspath(path), bucket, key)
        keys.append(key)
    return keys
