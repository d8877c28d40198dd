"""The local S3 server (bench/s3_server.py, moto) as the tests use it, and TensorBoard's reader on it.

Without moto the tests that need the server skip, except under CI=true, where a server that cannot start
fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.s3_server import DUMMY_KEY, DUMMY_SECRET, S3Server, S3ServerError, local_s3

_READ_STEPS = """
import json, sys
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
accumulator = EventAccumulator(sys.argv[1])
accumulator.Reload()
print(json.dumps([event.step for event in accumulator.Tensors(sys.argv[2])]))
"""


def start_s3_server(directory: Path, host: str = "127.0.0.1"):
    """Start the server on ``host``, yield an S3Server; stop it afterwards (a generator for a pytest
    fixture)."""
    try:
        with local_s3(directory, host) as server:
            yield server
    except S3ServerError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"local S3 server unavailable under CI=true: {exc}")
        pytest.skip(f"local S3 server unavailable: {exc}")


def tensorboard_steps(server: S3Server, logdir: str, tag: str) -> list[int]:
    """The steps of ``tag`` in the event files under the s3:// ``logdir``, read by TensorBoard's own reader
    in a process of its own, as ``tensorboard --logdir s3://...`` reads them: its S3 filesystem takes the
    endpoint from S3_ENDPOINT when it is imported."""
    env = {**os.environ, "S3_ENDPOINT": server.endpoint, "AWS_ACCESS_KEY_ID": DUMMY_KEY,
           "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET, "AWS_REGION": "us-east-1"}
    done = subprocess.run([sys.executable, "-c", _READ_STEPS, logdir, tag], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
