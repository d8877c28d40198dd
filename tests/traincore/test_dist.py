"""Process-group lifecycle with real gloo ranks on the CPU, and the launcher-env and backend checks.

Two-rank tests spawn processes that read the torchrun variables (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
LOCAL_RANK) like a real launch; each rank writes what it observed to a JSON file that the test checks.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from traincore.config import DistConfig
from traincore.dist import (
    all_reduce_sum,
    distributed,
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
    """Run ``worker(rank, out_dir)`` as ranks 0 and 1; return what each rank recorded."""
    mp.spawn(_as_rank, args=(worker, str(tmp_path)), nprocs=2, join=True)
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
