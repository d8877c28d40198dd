"""A local S3-compatible object store for tests: moto's server mode (`moto[server]`) on a free port.

flytekit reaches it through FLYTE_AWS_ENDPOINT, FLYTE_AWS_ACCESS_KEY_ID and FLYTE_AWS_SECRET_ACCESS_KEY, the
settings a cluster's platform injects into every pod (the replay passes FLYTE_AWS_* on to its pods). The
credentials are moto's dummy test values, never real secrets. Without moto the tests that need it skip,
except under CI=true, where a server that cannot start fails them.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

BUCKET = "replay-test"
# moto accepts any credentials; a secret no file would hold by chance, so a test can look for it
DUMMY_KEY, DUMMY_SECRET = "testing", f"replay-secret-{secrets.token_hex(8)}"
START_TIMEOUT_S = 60


@dataclass
class S3Server:
    """A running moto server and the one bucket the tests use."""

    endpoint: str
    bucket: str
    log: Path

    @property
    def env(self) -> dict[str, str]:
        """What a pod (and the replay harness) needs to reach the store."""
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


def _unavailable(why: str) -> None:
    """Fail under CI (the server is part of the test set-up there), skip elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"local S3 server unavailable under CI=true: {why}")
    pytest.skip(f"local S3 server unavailable: {why} (pip install 'moto[server]')")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(process: subprocess.Popen, endpoint: str, log: Path) -> str | None:
    """None once the server answers HTTP; otherwise why it did not."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"moto server exited {process.returncode}: {log.read_text(errors='replace')[-2000:]}"
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                return None
        except OSError:
            time.sleep(0.2)
    return f"moto server did not answer within {START_TIMEOUT_S} s"


def start_s3_server(directory: Path):
    """Start the server, create the bucket, yield an S3Server; stop the server afterwards (a generator
    for a pytest fixture)."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as exc:
        _unavailable(f"cannot import {exc.name}")
    port, log = _free_port(), directory / "moto.log"
    endpoint = f"http://127.0.0.1:{port}"
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                   stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        why = _wait_ready(process, endpoint, log)
        if why:
            _unavailable(why)
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
