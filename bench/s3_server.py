"""A local S3-compatible object store on a free port: moto's server mode (``moto[server]``, a dev extra).

The benchmarks and the tests start their own (``with local_s3(directory) as server:``), with one bucket and
moto's dummy test credentials, never real secrets. flytekit reaches it through FLYTE_AWS_ENDPOINT,
FLYTE_AWS_ACCESS_KEY_ID and FLYTE_AWS_SECRET_ACCESS_KEY (:attr:`S3Server.env`), fsspec (s3fs) through
:attr:`S3Server.storage_options`, boto3 and the AWS CLI through :attr:`S3Server.aws_env`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BUCKET = "replay-test"
# moto accepts any credentials; a secret no file would hold by chance, so a test can look for it
DUMMY_KEY, DUMMY_SECRET = "testing", f"replay-secret-{secrets.token_hex(8)}"
START_TIMEOUT_S = 60


class S3ServerError(RuntimeError):
    """The local S3 server could not start; the message says why."""


@dataclass
class S3Server:
    """A running moto server and the one bucket it was started with."""

    endpoint: str
    bucket: str
    log: Path

    @property
    def env(self) -> dict[str, str]:
        """What a pod (and the replay harness) needs to reach the store: Flyte's settings."""
        return {"FLYTE_AWS_ENDPOINT": self.endpoint, "FLYTE_AWS_ACCESS_KEY_ID": DUMMY_KEY,
                "FLYTE_AWS_SECRET_ACCESS_KEY": DUMMY_SECRET}

    @property
    def storage_options(self) -> dict:
        """fsspec's (s3fs's) options for the store, as a task derives them from FLYTE_AWS_*."""
        return {"key": DUMMY_KEY, "secret": DUMMY_SECRET, "client_kwargs": {"endpoint_url": self.endpoint}}

    @property
    def aws_env(self) -> dict[str, str]:
        """The store through the standard AWS variables, as a user of traincore alone sets them."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": DUMMY_KEY,
                "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self):
        """A boto3 S3 client on the same endpoint."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=DUMMY_KEY,
                            aws_secret_access_key=DUMMY_SECRET, region_name="us-east-1")

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` in the bucket."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def free_port() -> int:
    """A free 127.0.0.1 port (bound once to get a number, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(process: subprocess.Popen, endpoint: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise S3ServerError(f"moto server exited {process.returncode}: "
                                f"{log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise S3ServerError(f"moto server did not answer within {START_TIMEOUT_S} s")


@contextlib.contextmanager
def local_s3(directory: Path, host: str = "127.0.0.1") -> Iterator[S3Server]:
    """Start the server on ``host`` (its log in ``directory``), create the bucket, yield; stop it after."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as exc:
        raise S3ServerError(f"cannot import {exc.name} (pip install 'moto[server]')") from exc
    port, log = free_port(), directory / "moto.log"
    endpoint = f"http://{host}:{port}"
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                                   stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(process, endpoint, log)
        server = S3Server(endpoint, BUCKET, log)
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
