"""Checkpoint roots in an object store (a local S3 server, moto): every mode writes straight into the store,
the commit marker is the commit, and loading reads from the store, in one process and on real gloo ranks."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ranks import start_train, wait_exit
from test_checkpoint import assert_same, load, make_state, save_steps, snapshot, train  # noqa: I001  (beside this file)
from trainruns import CHECKPOINTED, TINY, kill_tree, train_cmd

from traincore.checkpoint import (
    MARKER,
    Checkpointer,
    CheckpointError,
    Store,
    complete_steps,
    read_marker,
    step_store,
    verify_checkpoint,
)
from traincore.checkpoint.format import read_checkpoint
from traincore.config.schema import CHECKPOINT_MODES, CheckpointConfig
from traincore.exitcodes import PREEMPTED_EXIT_CODE
from traincore.run.preemption import read_record
from traincore.run.preflight import OutputError, ensure_writable_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def fresh_root(s3, name: str) -> Store:
    """A new, empty prefix of the test bucket as a checkpoint root."""
    return Store(f"s3://{s3.bucket}/{name}-{uuid.uuid4().hex[:8]}", s3.storage_options)


def objects(s3, root: Store) -> dict[str, bytes]:
    """Every object under ``root`` by its name relative to the root, read with boto3 (not through fsspec)."""
    prefix = root.uri.removeprefix(f"s3://{s3.bucket}/") + "/"
    client = s3.client()
    return {key.removeprefix(prefix): client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
            for key in s3.keys(prefix)}


def marker_matches_store(s3, root: Store, step: int) -> dict:
    """The marker of ``step`` lists every other object of its prefix with its true size and CRC32."""
    name = step_store(root, step).name
    found = {key.removeprefix(f"{name}/"): data for key, data in objects(s3, root).items()
             if key.startswith(f"{name}/") and key != f"{name}/{MARKER}"}
    marker = read_marker(step_store(root, step))
    listed = {name: {"bytes": entry["bytes"], "crc32": entry["crc32"]}
              for name, entry in marker["files"].items()}
    assert listed == {key: {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
                      for key, data in found.items()}
    for name, entry in marker["files"].items():  # each DCP file was written, and checksummed, by its rank
        if name.endswith(".distcp"):
            assert entry["rank"] == int(name.split("_")[2]), (name, entry)
    return marker


@pytest.mark.parametrize("mode", CHECKPOINT_MODES)
def test_every_mode_commits_into_the_store_and_resumes_bitwise(s3_server, mode):
    root = fresh_root(s3_server, mode)
    state = save_steps(root, mode, [2, 4, 6], keep_last=2)
    assert complete_steps(root) == [4, 6]  # pruned in the store too
    marker = marker_matches_store(s3_server, root, 6)
    expected = {"state.pt"} if mode == "sync" else {"extra.pt", ".metadata", "__0_0.distcp"}
    assert set(marker["files"]) == expected and marker["mode"] == mode
    resumed = make_state(seed=1)
    assert load(root, resumed, mode=mode) == 6
    assert_same(snapshot(state), snapshot(resumed))
    train(state, 2)
    train(resumed, 2)
    assert_same(snapshot(state), snapshot(resumed))
    weights, info = read_checkpoint(step_store(root, 6))  # what export reads, straight from the store
    assert info["step"] == 6 and set(weights) == set(snapshot(make_state())["model"])


def test_a_prefix_without_marker_never_loads_and_junk_is_named_not_deleted(s3_server, caplog):
    root = fresh_root(s3_server, "junk")
    save_steps(root, "dcp", [2, 4])
    client, prefix = s3_server.client(), root.uri.removeprefix(f"s3://{s3_server.bucket}/")
    # A save killed mid-upload: every file but the marker (ours, torn); and another program's prefix.
    for key, data in objects(s3_server, root).items():
        if key.startswith("step-000004/") and not key.endswith(MARKER):
            client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/step-000006/{key.split('/', 1)[1]}",
                              Body=data)
    client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/step-000008/notes.txt", Body=b"not ours")
    caplog.set_level(logging.WARNING)
    assert complete_steps(root) == [2, 4]
    assert load(root, mode="dcp") == 4
    assert f"ignoring {root.uri}/step-000008: it is not a checkpoint of traincore" in caplog.text
    assert f"skipping {root.uri}/step-000006: its save never committed" in caplog.text
    with pytest.raises(CheckpointError, match="no complete checkpoint for step 6"):
        load(root, step=6, mode="dcp")
    save_steps(root, "dcp", [10])  # its prune deletes our torn prefix, never the other program's
    names = set(objects(s3_server, root))
    assert not any(name.startswith("step-000006/") for name in names)
    assert "step-000008/notes.txt" in names


def test_a_corrupt_object_falls_back_to_the_previous_step_naming_it(s3_server, caplog):
    root = fresh_root(s3_server, "corrupt")
    save_steps(root, "sync", [2, 4])
    key = f"{root.uri.removeprefix(f's3://{s3_server.bucket}/')}/step-000004/state.pt"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(data))
    caplog.set_level(logging.WARNING)
    assert load(root, mode="sync") == 2
    assert f"{root.uri}/step-000004/state.pt is corrupt" in caplog.text


def test_a_save_that_fails_in_the_store_commits_nothing_and_names_the_file(s3_server):
    state = make_state()
    missing = Store(f"s3://missing-{uuid.uuid4().hex[:8]}/run", s3_server.storage_options)  # no such bucket
    checkpointer = Checkpointer(missing, CheckpointConfig(mode="dcp"), state.registry)
    try:
        with pytest.raises(CheckpointError, match=rf"writing checkpoint file {missing.uri}/step-000001/"):
            checkpointer.save(1)
    finally:
        checkpointer.close()
    bucket = missing.uri.split("/")[2]
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)  # now it exists: still nothing there, complete or torn
    assert client.list_objects_v2(Bucket=bucket)["KeyCount"] == 0 and complete_steps(missing) == []


def test_preflight_names_an_object_store_root_it_cannot_write(s3_server):
    root = fresh_root(s3_server, "probe")
    ensure_writable_store(root)
    assert objects(s3_server, root) == {}  # the probe is gone again
    with pytest.raises(OutputError, match=r"checkpoint root s3://no-such-bucket/x cannot be written .*"
                                          r"the bucket exists and that the credentials"):
        ensure_writable_store(Store("s3://no-such-bucket/x", s3_server.storage_options))


# ---- several ranks, through the CLI --------------------------------------------------------------

def start_on_store(data_dir: Path, output: Path, nproc: int, root: str, env: dict, *flags: str,
                   config: dict = CHECKPOINTED) -> multiprocessing.Process:
    """The train CLI on ``nproc`` ranks (trainruns.train_cmd's arguments) checkpointing into ``root``, started
    as a child forked from the tests' preloaded server (tests/ranks.py, as conftest.py's ``forked_train``
    runs): a process of its own that forks its ranks, without the imports a fresh interpreter spends; ``env``
    added to its environment, what it prints appended to ``output``.log. None of these tests is about the
    CLI's start-up."""
    args = train_cmd(data_dir, output, nproc, "--checkpoint-dir", root, *flags, config=config)[3:]
    return start_train(args, output.with_name(f"{output.name}.log"), env)


def train_on_store(data_dir: Path, output: Path, nproc: int, root: str, env: dict, *flags: str,
                   config: dict = CHECKPOINTED) -> str:
    """``start_on_store`` until the run ends, which must be with exit code 0: what the run printed."""
    log = output.with_name(f"{output.name}.log")
    start = log.stat().st_size if log.is_file() else 0
    code = wait_exit(start_on_store(data_dir, output, nproc, root, env, *flags, config=config), timeout=300)
    printed = log.read_bytes()[start:].decode(errors="replace")
    assert code == 0, printed[-6000:]
    return printed


def model_weights(root: Store | Path, step: int) -> dict[str, torch.Tensor]:
    return read_checkpoint(step_store(root, step))[0]


def wait_for_step(running: Callable[[], bool], output: Path, step: int, deadline: float) -> None:
    """Until rank 0 has logged ``step`` or a later one in ``output``/metrics.jsonl, read from the local disk,
    or the run has ended (``running()`` is false): the store is polled only from then on, not through the
    run's start-up (every poll is a request that the server spends CPU time on)."""
    def logged() -> int:
        path = output / "metrics.jsonl"
        text = path.read_text() if path.is_file() else ""
        records = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]  # not a torn line
        return max((record["step"] for record in records if record.get("kind") == "train"), default=0)
    while logged() < step and running():
        assert time.monotonic() < deadline, f"the run logged no step {step}"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["dcp", "async"])
def test_two_ranks_write_their_own_shards_and_the_root_reshards_on_one_and_three(s3_server, data_dir, saved,
                                                                                 tmp_path, mode):
    s3, uri = s3_server, f"s3://{s3_server.bucket}/ranks-{mode}-{uuid.uuid4().hex[:8]}"
    root = Store(uri, s3.storage_options)
    # The standard AWS variables: what a user of traincore alone sets (tasks pass Flyte's settings instead).
    train_on_store(data_dir, tmp_path / "two", 2, uri, s3.aws_env, "--max-steps", "10",
                   "--checkpoint-mode", mode, "--parallelism", "fsdp")
    assert complete_steps(root) == [5, 10]
    for step in (5, 10):
        marker = marker_matches_store(s3, root, step)
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra.pt"} == set(marker["files"])
        assert marker["world_size"] == 2
    # Exactly what the same training writes to a local disk (in dcp mode: a run's weights do not depend on
    # how it checkpoints, and the session's dcp run serves both modes).
    on_disk, in_store = model_weights(saved("fsdp-dcp-2"), 10), model_weights(root, 10)
    assert on_disk.keys() == in_store.keys() and all(torch.equal(on_disk[k], in_store[k]) for k in on_disk)
    # Resharded straight from the store: on 1 rank under DDP, on 3 under FSDP.
    for nproc, parallelism, steps in ((1, "ddp", 15), (3, "fsdp", 20)):
        out = train_on_store(data_dir, tmp_path / f"on-{nproc}", nproc, uri, s3.aws_env, "--max-steps",
                             str(steps), "--checkpoint-mode", mode, "--parallelism", parallelism)
        assert f"resumed from step {steps - 5} in {uri}" in out
        assert complete_steps(root)[-1] == steps
    secret = s3.aws_env["AWS_SECRET_ACCESS_KEY"].encode()
    assert not [name for name, data in objects(s3, root).items() if secret in data]
    assert json.loads(objects(s3, root)["step-000020/commit.json"])["world_size"] == 3


def test_a_run_killed_mid_upload_resumes_from_the_last_committed_step_and_names_the_torn_one(
        s3_server, data_dir, tmp_path):
    s3, uri = s3_server, f"s3://{s3_server.bucket}/killed-{uuid.uuid4().hex[:8]}"
    root, bucket = Store(uri, s3.storage_options), s3_server.bucket
    prefix = uri.removeprefix(f"s3://{bucket}/")
    # ~40 MB of FSDP state per rank, uploaded in 5 MiB parts: each save spends a while mid-upload. Saves at
    # steps 4, 8, 12 and 16: the first commits, one of the next three is caught mid-upload.
    steps = 16
    config = {**TINY, "model": {"name": "mlp", "width": 2048}, "checkpoint": {"every": 4, "mode": "dcp"}}
    flags = ("--max-steps", str(steps), "--parallelism", "fsdp")
    # A fresh interpreter, not a forked one: fsspec reads FSSPEC_S3 when it is imported, which the tests'
    # preloaded server has done long before.
    command = train_cmd(data_dir, tmp_path / "run", 2, "--checkpoint-dir", uri, *flags, config=config)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **s3.aws_env, "FSSPEC_S3": '{"default_block_size": 5242880}'}
    client = s3.client()

    def uploading() -> list[str]:
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads", [])
        return [upload["Key"] for upload in uploads]

    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        wait_for_step(lambda: process.poll() is None, tmp_path / "run", 2, deadline)
        while not (complete_steps(root) and uploading()) and process.poll() is None:
            assert time.monotonic() < deadline, "no upload was caught in flight"
            time.sleep(0.02)
        in_flight = uploading()
    finally:
        kill_tree(process.pid)
        process.wait(timeout=30)
    assert in_flight, "the run ended before an upload was caught in flight"
    torn = int(in_flight[0].split("/")[-2].removeprefix("step-"))
    committed = complete_steps(root)
    assert committed and torn not in committed and committed[-1] < torn, (committed, in_flight)
    # The next attempt (forked: its own uploads need not be in parts): never the torn step, which it names;
    # the previous committed one instead.
    log = train_on_store(data_dir, tmp_path / "run", 2, uri, s3.aws_env, *flags, config=config)
    assert f"resumed from step {committed[-1]} in {uri}" in log, log[-3000:]
    assert f"skipping {uri}/step-{torn:06d}: its save never committed" in log, log[-3000:]
    assert complete_steps(root)[-1] == steps and uploading() == []  # the torn upload is aborted, not billed
    for step in complete_steps(root):
        marker_matches_store(s3, root, step)


@pytest.mark.parametrize("grace_s", [20.0, 0.05])
def test_a_signal_commits_the_agreed_step_in_the_store_within_the_grace_or_names_the_one_that_stands(
        s3_server, data_dir, tmp_path, grace_s):
    """SIGTERM to a 2-rank run (the launcher forwards it to both workers): with the default grace the step
    they agree on is committed in the store before they exit; with a grace too short for its upload the
    previous committed step stands, and the message names it."""
    s3, uri = s3_server, f"s3://{s3_server.bucket}/signal-{uuid.uuid4().hex[:8]}"
    root = Store(uri, s3.storage_options)
    config = {**TINY, "model": {"name": "mlp", "width": 2048},
              "checkpoint": {"every": 4, "mode": "dcp", "preemption_grace_s": grace_s}}
    process = start_on_store(data_dir, tmp_path / "run", 2, uri, s3.aws_env, "--max-steps", "400",
                             "--parallelism", "fsdp", config=config)
    try:
        deadline = time.monotonic() + 240
        wait_for_step(lambda: process.exitcode is None, tmp_path / "run", 2, deadline)
        while not complete_steps(root) and process.exitcode is None:
            assert time.monotonic() < deadline, "no checkpoint was committed"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGTERM)
        assert wait_exit(process, timeout=60) == PREEMPTED_EXIT_CODE
    finally:
        kill_tree(process.pid)
    text = (tmp_path / "run.log").read_text(errors="replace")
    latest = complete_steps(root)[-1]
    if grace_s == 20.0:
        assert f"preempted at step {latest} by SIGTERM: checkpoint step-{latest} saved in {uri}" in text, (
            text[-3000:])
        assert read_record(root).step == latest
    else:
        named = re.search(rf"exiting: the committed checkpoint step (\d+) in {re.escape(uri)} stays the one "
                          "a resume loads", text)
        assert named and int(named[1]) in complete_steps(root), text[-3000:]
        assert read_record(root) is None
    for step in complete_steps(root):
        verify_checkpoint(step_store(root, step))


def test_a_load_fetches_in_bounded_batches_and_restores_bitwise(s3_server, monkeypatch):
    from traincore.checkpoint import dcp as checkpoint_dcp

    root = fresh_root(s3_server, "batches")
    state = save_steps(root, "dcp", [3])
    fetched = []
    read_ranges = Store.read_ranges

    def counting(self, ranges):
        fetched.append((len(ranges), sum(length for _, _, length in ranges)))
        return read_ranges(self, ranges)
    monkeypatch.setattr(checkpoint_dcp, "READ_BATCH_BYTES", 4096)
    monkeypatch.setattr(Store, "read_ranges", counting)
    resumed = make_state(seed=1)
    assert load(root, resumed, mode="dcp") == 3
    assert_same(snapshot(state), snapshot(resumed))
    # Many fetches, each within the bound unless it is one item that alone is larger.
    assert len(fetched) > 2 and all(size <= 4096 or count == 1 for count, size in fetched), fetched
