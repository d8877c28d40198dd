"""A run's records copied into its durable root while it runs, on a local S3 server (moto), read back with
TensorBoard's own reader."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest
from s3_server import tensorboard_steps  # noqa: I001  (tests/s3_server.py)

from traincore.checkpoint import Store
from traincore.config.presets import debug
from traincore.run.trainer import Trainer
from traincore.telemetry.records import (
    TAIL_BYTES,
    RecordsSync,
    attempt_records,
    continue_records,
    next_attempt,
)


def fresh_root(s3) -> Store:
    return Store(f"s3://{s3.bucket}/records-{uuid.uuid4().hex[:8]}", s3.storage_options)


def test_changed_files_are_copied_whole_and_stderr_only_by_its_tail(s3_server, tmp_path):
    root = fresh_root(s3_server)
    assert next_attempt(root) == 0
    target = attempt_records(root, next_attempt(root))
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.1").write_bytes(b"e1")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "stderr").mkdir()
    (tmp_path / "stderr" / "rank-0.log").write_bytes(b"x" * TAIL_BYTES + b"the end")
    sources = {"metrics.jsonl": tmp_path / "metrics.jsonl", "tensorboard": tmp_path / "tb"}
    sync = RecordsSync(target, 0, sources, tails={"stderr": tmp_path / "stderr"})
    sync.sync()
    assert target.read_bytes("metrics.jsonl") == b'{"step": 1}\n'
    assert target.read_bytes("tensorboard/events.1") == b"e1"
    tail = target.read_bytes("stderr/rank-0.log")
    assert len(tail) == TAIL_BYTES and tail.endswith(b"the end")
    target.remove_file("tensorboard/events.1")  # unchanged locally: not copied again
    with (tmp_path / "metrics.jsonl").open("a") as rows:
        rows.write('{"step": 2}\n')
    sync.close()  # the last copy
    assert target.read_bytes("metrics.jsonl").count(b"step") == 2
    assert not target.is_file("tensorboard/events.1")
    assert next_attempt(root) == 1


def test_a_run_keeps_its_records_in_an_object_store_root_while_it_runs(s3_server, synthetic_dir, tmp_path):
    root = fresh_root(s3_server)
    cfg = debug().with_overrides({"train.max_steps": 12, "telemetry.log_every": 4})
    summary = Trainer(cfg, synthetic_dir, tmp_path / "run", root).train()
    records = attempt_records(root, 0)
    assert summary.records == records.uri and f"records in {records.uri}" in summary_line(summary)
    rows = [json.loads(line) for line in records.read_bytes("metrics.jsonl").splitlines()]
    assert max(row["step"] for row in rows if row.get("kind") == "train") == 12
    # TensorBoard's own reader on the store, as `tensorboard --logdir s3://...` reads it (docs/outputs.md).
    (events,) = [name for name in records.files() if name.startswith("tensorboard/")]
    assert tensorboard_steps(s3_server, records.uri_of(events.rsplit("/", 1)[0]), "train/loss")[-1] == 12
    # A second attempt on the same root gets records of its own.
    cfg = cfg.with_overrides({"train.max_steps": 16})
    assert Trainer(cfg, synthetic_dir, tmp_path / "run", root).train().records == attempt_records(root, 1).uri


def summary_line(summary) -> str:
    from traincore.telemetry.summary import format_summary

    return format_summary(summary)


@pytest.fixture(autouse=True)
def _no_aws_profile(monkeypatch):
    """The store's settings come from the test, never from a developer's ~/.aws."""
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


def test_a_main_rank_on_a_node_without_the_attempts_metrics_continues_its_durable_copy(tmp_path):
    """An elastic run re-formed with its main rank on another node: that node starts from the attempt's
    records in the root, so they go on instead of being replaced; a node that has its own keeps it."""
    target = attempt_records(Store(str(tmp_path / "root")), 0)
    here = tmp_path / "node" / "run" / "metrics.jsonl"
    continue_records(target, here)  # nothing durable yet: nothing to continue
    assert not here.exists()
    target.write_bytes("metrics.jsonl", b'{"step": 20, "kind": "train"}\n')
    continue_records(target, here)
    assert here.read_bytes() == b'{"step": 20, "kind": "train"}\n'
    here.write_bytes(b'{"step": 30, "kind": "train"}\n')
    continue_records(target, here)
    assert here.read_bytes() == b'{"step": 30, "kind": "train"}\n'


class SlowStore(Store):
    """A local root whose writes wait for ``go``: a copy to a slow store, under way."""

    def __init__(self, location):
        super().__init__(location)
        self.writing, self.go = threading.Event(), threading.Event()

    def write_bytes(self, name, data):
        self.writing.set()
        self.go.wait(30)
        return super().write_bytes(name, data)


def test_a_fork_waits_for_the_copy_under_way(tmp_path):
    """A launcher forking its workers while its records thread copies (whose host-name look-up holds
    glibc's resolver lock) would give them that lock, held: the fork waits for the copy instead."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    target = SlowStore(tmp_path / "root")
    sync = RecordsSync(target, 0.05, {"metrics.jsonl": tmp_path / "metrics.jsonl"}).start()
    try:
        assert target.writing.wait(30)
        threading.Timer(0.5, target.go.set).start()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the copy ended before this process was made
            os._exit(0 if target.is_file("metrics.jsonl") else 1)
        waited = time.monotonic() - started
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert waited >= 0.4
    finally:
        target.go.set()
        sync.close()
