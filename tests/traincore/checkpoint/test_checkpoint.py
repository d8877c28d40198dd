"""Checkpoint save/resume in every mode, on real gloo process groups of 1 to 3 CPU processes."""

from __future__ import annotations

import errno
import logging
import os
import random
import time
import zlib
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import start_ranks, warm
from torch.nn.parallel import DistributedDataParallel

from traincore.checkpoint import (
    MARKER,
    Checkpointer,
    CheckpointError,
    complete_steps,
    latest_complete,
    read_marker,
    step_dir,
    verify_checkpoint,
)
from traincore.checkpoint import commit as checkpoint_commit
from traincore.checkpoint import writer as checkpoint_writer
from traincore.checkpoint.format import open_saved, read_checkpoint
from traincore.checkpoint.writer import ChecksumWriter
from traincore.config.schema import CHECKPOINT_MODES, CheckpointConfig, Config, ModelConfig
from traincore.model.build import build_model
from traincore.run.state import Progress, StateRegistry, training_registry, unwrap_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module", autouse=True)
def rank_server() -> None:
    """The ranks' server imports torch and DCP while the one-process tests run, not as a rank starts."""
    warm()


SHAPE = (1, 8, 8)
BATCH = 4


class CountingLoader:
    """The loader's resumable position: seed, epoch, samples consumed globally."""

    def __init__(self) -> None:
        self.position = {"seed": 0, "epoch": 0, "consumed": 0}

    def state_dict(self) -> dict:
        return dict(self.position)

    def load_state_dict(self, state: dict) -> None:
        self.position = dict(state)


class TrainState:
    """A run's parts and their state registry, registered as the Trainer registers them."""

    def __init__(self, model, optimizer, scheduler, loader, meta: dict):
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.progress = Progress()
        self.registry = training_registry(model, optimizer, scheduler, loader, self.progress, meta)

    @property
    def step(self) -> int:
        return self.progress.step

    @step.setter
    def step(self, value: int) -> None:
        self.progress.step = value


def make_state(width: int = 16, seed: int = 0, world_size: int = 1) -> TrainState:
    """A tiny MLP with AdamW and a decaying LambdaLR; wrapped in DDP inside a process group."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(name="mlp", width=width), 10, SHAPE)
    if dist.is_initialized():
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    meta = {"config": Config(model=ModelConfig(name="mlp", width=width)).to_dict(), "num_classes": 10,
            "shape": list(SHAPE), "classes": [str(c) for c in range(10)], "mean": [0.5], "std": [0.25],
            "source": "synthetic", "world_size": world_size}
    return TrainState(model, optimizer, scheduler, CountingLoader(), meta=meta)


def train(state: TrainState, steps: int, rank: int = 0, world_size: int = 1) -> None:
    """Deterministic steps: each batch depends only on (step, rank)."""
    for _ in range(steps):
        gen = torch.Generator().manual_seed(1000 * state.step + rank)
        x, y = torch.randn(BATCH, *SHAPE, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
        F.cross_entropy(state.model(x), y).backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.scheduler.step()
        state.loader.position["consumed"] += BATCH * world_size
        state.step += 1


def snapshot(state: TrainState) -> dict:
    """Everything a resume must restore, as plain tensors and values (also storable with torch.save)."""
    optim = state.optimizer.state_dict()
    return {"model": {k: v.clone() for k, v in unwrap_model(state.model).state_dict().items()},
            "optim_state": {i: {k: v.clone() for k, v in s.items()} for i, s in optim["state"].items()},
            "param_groups": optim["param_groups"], "scheduler": state.scheduler.state_dict(),
            "loader": state.loader.state_dict(), "step": state.step}


def assert_same(expected: dict, actual: dict) -> None:
    assert expected["model"].keys() == actual["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(tensor, actual["model"][name]), name
    assert expected["optim_state"].keys() == actual["optim_state"].keys()
    for index, entries in expected["optim_state"].items():
        for key, tensor in entries.items():
            assert torch.equal(tensor, actual["optim_state"][index][key]), (index, key)
    for key in ("param_groups", "scheduler", "loader", "step"):
        assert expected[key] == actual[key], key


def draw_rng() -> tuple:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def assert_marker_matches_disk(directory: Path) -> None:
    """The marker lists every other file of the directory with its true size and CRC32."""
    files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*")
             if p.is_file() and p.name != MARKER}
    expected = {name: {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
                for name, data in files.items()}
    assert read_marker(directory)["files"] == expected


def save_steps(root: Path, mode: str, steps: list[int], **cfg) -> TrainState:
    """Train one state and save it at each of ``steps``."""
    state = make_state()
    checkpointer = Checkpointer(root, CheckpointConfig(mode=mode, **cfg), state.registry)
    for step in steps:
        train(state, step - state.step)
        checkpointer.save(state.step)
    checkpointer.close()
    return state


def load(root: Path, state: TrainState | None = None, step: int | None = None, **cfg) -> int | None:
    checkpointer = Checkpointer(root, CheckpointConfig(**cfg), (state or make_state(seed=1)).registry)
    try:
        return checkpointer.load(step)
    finally:
        checkpointer.close()


# ---- one process -------------------------------------------------------------------------------

def test_wall_clock_saves_are_spaced_so_they_block_at_most_their_share(tmp_path, caplog):
    state = make_state()
    cfg = CheckpointConfig(every_s=0.001, max_save_share=0.01)
    paced = Checkpointer(tmp_path / "paced", cfg, state.registry)
    with caplog.at_level(logging.WARNING, logger="traincore.checkpoint.checkpointer"):
        start = time.perf_counter()
        paced.save(1)
        took = time.perf_counter() - start
    # The save held training up for most of ``took``: the next one waits that over the share.
    assert 0.001 < paced.interval_s <= took / 0.01
    assert not paced.interval_elapsed()
    assert "instead of checkpoint.every_s=0 s" in caplog.text and "max_save_share=0.01" in caplog.text
    fixed = Checkpointer(tmp_path / "fixed", CheckpointConfig(every_s=0.001, max_save_share=0),
                         state.registry)
    fixed.save(1)
    assert fixed.interval_s == 0.001
    paced.close()
    fixed.close()


@pytest.mark.parametrize("mode", CHECKPOINT_MODES)
def test_round_trip_restores_everything_bitwise(tmp_path, mode, caplog):
    caplog.set_level(logging.INFO, logger="traincore.checkpoint.checkpointer")
    state = save_steps(tmp_path, mode, [3])
    rng_after_save = draw_rng()
    resumed = make_state(seed=1)
    assert not torch.equal(unwrap_model(resumed.model).net[1].weight, unwrap_model(state.model).net[1].weight)

    assert load(tmp_path, resumed, mode=mode) == 3
    assert draw_rng() == rng_after_save
    assert_same(snapshot(state), snapshot(resumed))
    train(state, 2)
    train(resumed, 2)
    assert_same(snapshot(state), snapshot(resumed))  # the resumed run continues bit for bit
    assert f"checkpoint step=3 mode={mode} blocking=" in caplog.text
    assert "resumed from" in caplog.text


@pytest.mark.parametrize("mode", CHECKPOINT_MODES)
def test_only_dcp_files_are_read_back_to_checksum_them(tmp_path, mode, monkeypatch):
    read_back = []
    original = checkpoint_commit.file_checksum
    monkeypatch.setattr(checkpoint_commit, "file_checksum",
                        lambda path: read_back.append(path) or original(path))
    save_steps(tmp_path, mode, [1])
    # Our own files are checksummed on their way to disk; torch's writer writes DCP's, read back once each.
    directory = step_dir(tmp_path, 1)
    dcp_files = sorted(p.name for p in directory.iterdir()
                       if p.name.endswith(".distcp") or p.name == ".metadata")
    assert sorted(p.name for p in read_back) == dcp_files
    assert (mode == "sync") == (dcp_files == [])
    assert_marker_matches_disk(directory)
    assert torch.serialization.get_crc32_options()  # torch.save's zip CRC32 is back on for everyone else


def _open_flags(fd: int) -> int:
    """The open flags of a file descriptor, as Linux reports them (octal) in /proc/self/fdinfo."""
    lines = Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
    return int(next(line for line in lines if line.startswith("flags:")).split()[1], 8)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT") or not Path("/proc/self/fdinfo").is_dir(),
                    reason="Linux only")
@pytest.mark.parametrize("direct", [True, False])
def test_checksum_writer_streams_blocks_and_checksums_every_byte(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(checkpoint_writer, "_WRITE_BLOCK", 1 << 16)  # small blocks: many full ones and a tail
    monkeypatch.setattr(checkpoint_writer, "_free_blocks", [])
    if direct:
        try:
            os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        except OSError:
            pytest.skip(f"the filesystem of {tmp_path} has no direct I/O")
    else:  # a filesystem without direct I/O rejects O_DIRECT with EINVAL
        real_open = os.open

        def no_direct(path, flags, *args):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "direct I/O not supported", str(path))
            return real_open(path, flags, *args)
        monkeypatch.setattr(os, "open", no_direct)
    data = np.random.default_rng(0).integers(0, 256, 5 * (1 << 16) + 12345, dtype=np.uint8).tobytes()
    chunks = [data[:7], data[7:200_007], np.frombuffer(data[200_007:], dtype=np.uint8), b""]
    with ChecksumWriter(tmp_path / "f.bin") as writer:
        assert bool(_open_flags(writer.fileno()) & os.O_DIRECT) == direct
        for chunk in chunks:
            writer.write(chunk)
        assert writer.tell() == len(data)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert writer.checksum() == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def test_nothing_to_resume_returns_none(tmp_path):
    assert load(tmp_path / "absent") is None
    assert complete_steps(tmp_path / "absent") == [] and latest_complete(tmp_path) is None


def test_torn_checkpoint_is_skipped_and_replaced(tmp_path):
    save_steps(tmp_path, "sync", [1, 2])
    torn = step_dir(tmp_path, 3)
    torn.mkdir()
    (torn / ".state.pt.tmp").write_bytes(b"half a checkpoint")  # what a save killed mid-write leaves
    assert complete_steps(tmp_path) == [1, 2]
    assert latest_complete(tmp_path) == step_dir(tmp_path, 2)
    assert load(tmp_path) == 2

    save_steps(tmp_path, "sync", [3])  # rewrites step 3 from scratch
    assert complete_steps(tmp_path) == [1, 2, 3]
    assert not (torn / ".state.pt.tmp").exists()
    verify_checkpoint(torn)


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("mode", ["sync", "dcp"])
def test_corrupt_latest_falls_back_but_named_step_fails(tmp_path, mode, how, caplog):
    save_steps(tmp_path, mode, [2, 4])
    victim = max(step_dir(tmp_path, 4).glob("*.pt" if mode == "sync" else "*.distcp"),
                 key=lambda p: p.stat().st_size)
    _corrupt(victim, how)

    assert load(tmp_path) == 2
    assert str(victim) in caplog.text and "falling back" in caplog.text
    with pytest.raises(CheckpointError, match="truncated" if how == "truncate" else "corrupt"):
        load(tmp_path, step=4)


def test_every_complete_checkpoint_corrupt_is_an_error(tmp_path):
    save_steps(tmp_path, "sync", [1])
    _corrupt(step_dir(tmp_path, 1) / "state.pt", "flip")
    with pytest.raises(CheckpointError, match="every complete checkpoint"):
        load(tmp_path)


def test_missing_named_step_lists_available_steps(tmp_path):
    save_steps(tmp_path, "dcp", [2, 4])
    with pytest.raises(CheckpointError, match=r"step 3 .*complete steps: \[2, 4\]"):
        load(tmp_path, step=3)
    assert load(tmp_path, step=2) == 2


def test_keep_last_prunes_old_and_torn_checkpoints(tmp_path):
    old_torn, new_torn = step_dir(tmp_path, 0), step_dir(tmp_path, 9)
    old_torn.mkdir(parents=True)
    new_torn.mkdir()
    save_steps(tmp_path, "sync", [1, 2, 3, 4], keep_last=2)
    assert complete_steps(tmp_path) == [3, 4]
    assert not old_torn.exists()
    assert new_torn.exists()  # newer than every complete checkpoint: not ours to judge


def test_format_version_mismatch_is_rejected(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_commit, "FORMAT_VERSION", 99)
        save_steps(tmp_path, "sync", [1])
    with pytest.raises(CheckpointError,
                       match=f"format version 99.* reads version {checkpoint_commit.FORMAT_VERSION}"):
        load(tmp_path)


@pytest.mark.parametrize("mode", ["sync", "dcp"])
def test_model_shape_mismatch_names_parameter_and_config(tmp_path, mode):
    save_steps(tmp_path, mode, [1])
    with pytest.raises(CheckpointError) as error:
        load(tmp_path, make_state(width=32))
    message = str(error.value)
    assert "'net.1.weight' has shape [16, 64] in the checkpoint and [32, 64] in the model" in message
    assert "'width': 16" in message


def test_compiled_model_saves_canonical_names(tmp_path):
    state = make_state()
    state.model = torch.compile(state.model)  # a wrapper with _orig_mod; nothing compiles before forward
    Checkpointer(tmp_path, CheckpointConfig(mode="sync"), state.registry).save(state.step)
    weights, extra = read_checkpoint(step_dir(tmp_path, 0))
    assert list(weights) == list(unwrap_model(state.model).state_dict())
    assert extra["meta"]["num_classes"] == 10


def test_world_size_without_process_group_is_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="world_size=2 needs an initialised process group"):
        Checkpointer(tmp_path, CheckpointConfig(), StateRegistry(), rank=0, world_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_save_from_cuda_round_trip(tmp_path):
    state = make_state()
    state.model.cuda()
    resumed = make_state(seed=1)
    resumed.model.cuda()
    x = torch.randn(BATCH, *SHAPE, device="cuda")
    state.model(x).sum().backward()
    state.optimizer.step()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(mode="async"), state.registry)
    checkpointer.save(state.step)
    checkpointer.close()
    assert load(tmp_path, resumed, mode="async") == 0
    assert_same(snapshot(state), snapshot(resumed))


# ---- several processes -------------------------------------------------------------------------

def _worker(rank: int, world_size: int, rendezvous: str, action: str, root: str, modes: str,
            out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        ACTIONS[action](rank, world_size, Path(root), modes, Path(out))
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, world_size: int, action: str, root: Path, modes: str,
              timeout: float = 120) -> None:
    """Run ``action`` on ``world_size`` forked gloo processes; fail (not hang) after ``timeout`` seconds."""
    rendezvous = tmp_path / f"rendezvous-{action}-{world_size}-{time.monotonic_ns()}"
    context = start_ranks(_worker, (world_size, str(rendezvous), action, str(root), modes, str(tmp_path)),
                          nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world_size} processes running {action!r} did not finish within {timeout}s")


def _save_twice(rank: int, world_size: int, root: Path, modes: str, out: Path) -> None:
    state = make_state(world_size=world_size)
    checkpointers = [Checkpointer(root / mode, CheckpointConfig(mode=mode), state.registry, rank, world_size)
                     for mode in modes.split(",")]
    for steps in (3, 2):
        train(state, steps, rank, world_size)
        for checkpointer in checkpointers:
            checkpointer.save(state.step)
    for checkpointer in checkpointers:
        checkpointer.close()
    if rank == 0:
        torch.save(snapshot(state), out / "expected.pt")


def check_resumed(rank: int, world_size: int, root: Path, modes: str, out: Path) -> None:
    """Resume on a world size other than the writer's: state restored, this run's RNG kept."""
    for mode in modes.split(","):
        state = make_state(seed=7, world_size=world_size)
        torch.manual_seed(99 + rank)
        expected_draw = torch.rand(3)
        torch.manual_seed(99 + rank)
        checkpointer = Checkpointer(root / mode, CheckpointConfig(mode=mode), state.registry, rank,
                                    world_size)
        assert checkpointer.load() == 5
        checkpointer.close()
        assert torch.equal(torch.rand(3), expected_draw)
        assert_same(torch.load(out / "expected.pt", weights_only=True), snapshot(state))


def _save_async_every_step(rank: int, world_size: int, root: Path, modes: str, out: Path) -> None:
    state = make_state(world_size=world_size)
    checkpointer = Checkpointer(root, CheckpointConfig(mode="async", keep_last=100), state.registry, rank,
                                world_size)
    weights = {}
    for _ in range(30):
        train(state, 1, rank, world_size)
        checkpointer.save(state.step)  # the next training step changes the weights while this write runs
        weights[state.step] = snapshot(state)["model"]
    checkpointer.close()
    rng_after_last_save = draw_rng()
    if rank == 0:
        torch.save(weights, out / "weights-per-step.pt")

    resumed = make_state(seed=7, world_size=world_size)
    checkpointer = Checkpointer(root, CheckpointConfig(mode="async"), resumed.registry, rank, world_size)
    assert checkpointer.load() == 30
    checkpointer.close()
    assert draw_rng() == rng_after_last_save  # same world size: each rank gets its own RNG back
    assert_same(snapshot(state), snapshot(resumed))


ACTIONS = {"save_twice": _save_twice, "check_resumed": check_resumed,
           "async_every_step": _save_async_every_step}


def test_two_ranks_save_resume_on_three_and_one(tmp_path):
    root, modes = tmp_path / "checkpoints", "sync,dcp"
    run_ranks(tmp_path, 2, "save_twice", root, modes)
    assert complete_steps(root / "sync") == complete_steps(root / "dcp") == [3, 5]
    run_ranks(tmp_path, 3, "check_resumed", root, modes)
    check_resumed(0, 1, root, modes, tmp_path)  # this process, no process group
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    for mode in modes.split(","):
        assert_marker_matches_disk(step_dir(root / mode, 5))  # every rank's checksums reached the marker
        weights, extra = read_checkpoint(step_dir(root / mode, 5))  # consolidated without a process group
        assert all(torch.equal(weights[name], tensor) for name, tensor in expected["model"].items())
        directory = step_dir(root / mode, 5)
        assert extra["step"] == 5 and len(open_saved(directory, read_marker(directory)).per_rank) == 2


def test_async_save_every_step_never_tears_or_mixes_steps(tmp_path):
    root = tmp_path / "checkpoints"
    run_ranks(tmp_path, 2, "async_every_step", root, "async", timeout=180)
    assert complete_steps(root) == list(range(1, 31))
    assert sorted(p.name for p in root.iterdir()) == [f"step-{s:06d}" for s in range(1, 31)]  # nothing torn
    expected = torch.load(tmp_path / "weights-per-step.pt", weights_only=True)
    for step in range(1, 31):
        verify_checkpoint(step_dir(root, step))
        weights, extra = read_checkpoint(step_dir(root, step))
        assert extra["step"] == step
        for name, tensor in expected[step].items():
            assert torch.equal(weights[name], tensor), (step, name)
