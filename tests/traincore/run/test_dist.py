"""Process-group lifecycle with real gloo ranks on the CPU, and the launcher-env and backend checks.

Two-rank tests start processes that read the torchrun variables (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
LOCAL_RANK) like a real launch; each rank writes what it observed to a JSON file that the test checks.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks

from traincore.config.schema import CheckpointConfig, DistConfig
from traincore.run.dist import (
    CollectiveTimeoutError,
    all_reduce_sum,
    attempt_store,
    distributed,
    explain_timeouts,
    launch_env,
    pick_device,
    resolve_backend,
    tighten_timeout,
)

# Start-up allowance far above the step timeout: a collective failing near step_timeout_s proves the cut.
CFG = DistConfig(backend="gloo", init_timeout_s=60, step_timeout_s=2)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (rank 0's store binds it moments later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def two_rank_env(monkeypatch) -> None:
    """The launcher env the spawned ranks inherit (they add RANK and LOCAL_RANK), with CUDA hidden."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on CPU tensors even on a GPU machine


def run_ranks(worker, tmp_path: Path) -> list[dict]:
    """Run ``worker(rank, out_dir)`` as ranks 0 and 1 (forked children); return what each rank recorded."""
    start_ranks(_as_rank, (worker, str(tmp_path)), nprocs=2)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def _as_rank(rank: int, worker, out_dir: str) -> None:
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    record = worker(rank, Path(out_dir))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))


def _lifecycle(rank: int, out_dir: Path) -> dict:
    record: dict = {}
    with distributed(CFG) as ctx:
        record["ctx"] = [ctx.rank, ctx.world_size, ctx.local_rank, ctx.device.type]
        record["inside"] = dist.is_initialized()
        record["sum"] = all_reduce_sum([1.0, float(rank), 0.5], ctx.device)
    record["after"] = dist.is_initialized()
    return record


def _body_raises(rank: int, out_dir: Path) -> dict:
    raised = None
    try:
        with distributed(CFG):
            raise KeyError(f"body failed on rank {rank}")
    except KeyError as exc:
        raised = exc.args[0]
    return {"raised": raised, "after": dist.is_initialized()}


def _timeout(rank: int, out_dir: Path) -> dict:
    done = out_dir / "rank0-done"
    with distributed(CFG):
        tighten_timeout(CFG)
        if rank == 1:
            # Never joins the collective; stays in the group until rank 0 has seen it time out.
            while not done.exists():
                time.sleep(0.05)
            return {}
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            error = None
        except RuntimeError as exc:  # gloo's timeout (DistBackendError is a RuntimeError)
            error = str(exc)
        elapsed = time.monotonic() - start
        done.touch()
        return {"error": error, "elapsed": elapsed}


def test_two_ranks_sum_and_tear_down(two_rank_env, tmp_path):
    records = run_ranks(_lifecycle, tmp_path)
    for rank, record in enumerate(records):
        assert record["ctx"] == [rank, 2, rank, "cpu"]
        assert record["inside"] and not record["after"]
        assert record["sum"] == [2.0, 1.0, 1.0]


def test_group_is_destroyed_when_the_body_raises(two_rank_env, tmp_path):
    records = run_ranks(_body_raises, tmp_path)
    for rank, record in enumerate(records):
        assert record["raised"] == f"body failed on rank {rank}"  # propagated, not swallowed
        assert record["after"] is False


def test_tightened_timeout_fails_a_hung_collective_in_seconds(two_rank_env, tmp_path):
    record = run_ranks(_timeout, tmp_path)[0]
    assert "timed out" in (record["error"] or "").lower(), record  # the collective rank 1 never joined
    # Well under the 60 s start-up timeout; the margin covers a loaded 2-core machine.
    assert CFG.step_timeout_s * 0.75 <= record["elapsed"] < CFG.step_timeout_s + 8, record


def test_single_process_without_launcher_has_no_group(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    assert launch_env() == (0, 1, 0)
    with distributed(DistConfig()) as ctx:
        assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.distributed) == (0, 1, True, False)
        assert not dist.is_initialized()
        tighten_timeout(DistConfig())  # no group: nothing to tighten, and no error
        assert all_reduce_sum([1.5, 2.0], ctx.device) == [1.5, 2.0]
    assert not dist.is_initialized()


def test_launch_env_reads_the_torchrun_variables(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch_env() == (5, 8, 1)


def test_bad_rank_env_names_torchrun(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK/WORLD_SIZE/LOCAL_RANK must be integers.*launch with torchrun"):
        launch_env()
    with pytest.raises(ValueError, match="torchrun"), distributed(CFG):
        pass
    assert not dist.is_initialized()


@pytest.mark.parametrize(("backend", "cuda", "expected"), [
    ("auto", False, "gloo"),
    ("auto", True, "cpu:gloo,cuda:nccl"),
    ("gloo", True, "gloo"),
    ("nccl", True, "nccl"),
])
def test_resolve_backend(backend, cuda, expected):
    assert resolve_backend(DistConfig(backend=backend), cuda) == expected


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_without_cuda_says_use_auto_or_gloo(backend):
    with pytest.raises(ValueError, match=f"dist.backend='{backend}' needs CUDA.*'auto' or 'gloo'"):
        resolve_backend(DistConfig(backend=backend), cuda=False)


def test_pick_device_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device(3) == torch.device("cpu")


@pytest.mark.gpu
def test_pick_device_wraps_local_rank_onto_the_gpus():
    count = torch.cuda.device_count()
    device = pick_device(count + 1)  # more local ranks than GPUs: wrap around, never index past the last
    assert device == torch.device("cuda", 1 % count)
    assert torch.cuda.current_device() == device.index
    torch.cuda.set_device(0)


# ---- torch elastic's agent store: one key namespace per restart attempt ------------------------------------

@pytest.fixture
def agent_store(two_rank_env, monkeypatch) -> dist.TCPStore:
    """A store server at MASTER_ADDR:MASTER_PORT outliving the ranks, as torch elastic's agent hosts it."""
    server = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True,
                           wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    return server


def test_restarted_groups_never_read_a_dead_attempts_keys(agent_store, monkeypatch, tmp_path):
    # Without a namespace per attempt, attempt 1 or 2 reads attempt 0's gloo addresses and barrier counts
    # from the shared store (connection refused to a dead port, or a barrier that is already "complete").
    for attempt in range(3):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        (tmp_path / str(attempt)).mkdir()
        for rank, record in enumerate(run_ranks(_lifecycle, tmp_path / str(attempt))):
            assert record["ctx"] == [rank, 2, rank, "cpu"] and record["sum"] == [2.0, 1.0, 1.0], attempt


def test_attempt_store_prefixes_keys_with_the_restart_count(agent_store, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    attempt_store(timedelta(seconds=10)).set("key", "two")
    assert agent_store.get("traincore/attempt-2/key") == b"two"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert not attempt_store(timedelta(seconds=10)).check(["key"])  # the next attempt starts empty


@pytest.mark.parametrize("flag", [None, "False"])
def test_no_attempt_store_without_the_agent_store(flag, monkeypatch):
    if flag is None:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", flag)
    assert attempt_store(timedelta(seconds=1)) is None  # plain env://


def test_attempt_store_without_master_port_names_torchrun(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR, an integer MASTER_PORT.*launch with torchrun"):
        attempt_store(timedelta(seconds=1))


# ---- bounded waits and what a timeout says ---------------------------------------------------------------

def test_a_collective_timeout_says_what_timed_out_and_the_fix():
    gloo = RuntimeError("[unbound_buffer.cc:129] Timed out waiting 5000ms for send operation to complete")
    with pytest.raises(CollectiveTimeoutError) as caught, explain_timeouts(CFG, 1, lambda: 7):
        raise gloo
    message = str(caught.value)
    assert message.startswith("rank 1: a collective timed out after step 7: another rank never joined it")
    assert "dist.step_timeout_s=2 s" in message and "raise dist.step_timeout_s" in message
    assert "Timed out waiting 5000ms" in message and caught.value.__cause__ is gloo
    assert isinstance(caught.value, dist.DistError)  # the Flyte task retries DistErrors


@pytest.mark.parametrize("error", [RuntimeError("Connection reset by peer"), ValueError("timed out")])
def test_other_errors_pass_through_unexplained(error):
    with pytest.raises(type(error)) as caught, explain_timeouts(CFG, 0, lambda: 1):
        raise error
    assert caught.value is error


def _checkpoint_group_bounds(rank: int, out_dir: Path) -> dict:
    import traincore.checkpoint.checkpointer as checkpoint
    from traincore.run.state import StateRegistry

    checkpoint.GROUP_START_TIMEOUT = timedelta(seconds=1.5)  # our own constant, in this child process only
    record: dict = {}
    with distributed(CFG):
        ckpt = checkpoint.Checkpointer(out_dir / "ckpt", CheckpointConfig(), StateRegistry(), rank, 2)
        if rank == 1:
            time.sleep(4)  # longer than the creation bound: the saves' allowance must apply now
        start = time.monotonic()
        record["loaded"] = ckpt.load()  # a broadcast on the checkpoint group; nothing to resume
        record["load_s"] = time.monotonic() - start
        ckpt.close()
        done = out_dir / "rank0-done"
        if rank == 1:  # never creates a second group; stays until rank 0 has seen its creation fail
            while not done.exists():
                time.sleep(0.05)
            return record
        start = time.monotonic()
        try:
            checkpoint.Checkpointer(out_dir / "ckpt", CheckpointConfig(), StateRegistry(), rank, 2)
        except RuntimeError as exc:  # DistStoreError: a rank missing
            record["error"] = str(exc)
        record["create_s"] = time.monotonic() - start
        done.touch()
    return record


def test_checkpoint_group_creation_is_bounded_but_its_collectives_wait_for_saves(two_rank_env, tmp_path):
    record = run_ranks(_checkpoint_group_bounds, tmp_path)[0]
    assert record["loaded"] is None and record["load_s"] > 2, record  # waited past the 1.5 s creation bound
    assert "timeout" in record.get("error", "").lower(), record
    assert record["create_s"] < 1.5 + 8, record  # the margin covers a loaded 2-core machine
