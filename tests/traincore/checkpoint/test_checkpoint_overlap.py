"""Async saves whose copy of the state overlaps the next forward and backward: still the state at their step.

The copy is held open (the staging thread waits on a gate the test opens), so "training went on while the
copy was in flight" is a fact of the test, not a matter of timing.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from traincore.checkpoint import Checkpointer
from traincore.checkpoint import snapshot as checkpoint_staging
from traincore.checkpoint.snapshot import SYNC_COPY_BYTES
from traincore.config.schema import CheckpointConfig
from traincore.run.state import Progress, RNGState, training_registry

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WIDTH = 768  # a 768x768 float32 weight (2.25 MiB) is copied in the background; BatchNorm statistics are not
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


class Loader:
    """The loader's resumable position."""

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"seed": 0, "epoch": 0, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


class Run:
    """A model with BatchNorm (whose forward changes its buffers) and a large layer, AdamW, a schedule."""

    def __init__(self, device: str, seed: int = 0):
        torch.manual_seed(seed)
        self.device = device
        self.model = nn.Sequential(nn.Linear(16, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(),
                                   nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, 10))
        self.model.to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (1 + step))
        self.loader, self.progress = Loader(), Progress()
        self.registry = training_registry(self.model, self.optimizer, self.scheduler, self.loader,
                                          self.progress, meta={"shape": [16], "classes": list("0123456789")})

    def forward_backward(self) -> None:
        """What runs between a save and the next optimizer step; draws from the RNG like dropout would."""
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(self.progress.step)) + torch.rand(1)
        y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(self.progress.step))
        F.cross_entropy(self.model(x.to(self.device)), y.to(self.device)).backward()

    def finish_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.loader.consumed += 8
        self.progress.step += 1

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.forward_backward()
            self.finish_step()

    def capture(self) -> dict:
        """Everything a resume restores, copied now: the expected content of a save taken now."""
        optim = self.optimizer.state_dict()
        return {"model": {k: v.cpu().clone() for k, v in self.model.state_dict().items()},
                "optim": {i: {k: v.cpu().clone() for k, v in s.items()} for i, s in optim["state"].items()},
                "param_groups": optim["param_groups"], "scheduler": self.scheduler.state_dict(),
                "loader": self.loader.state_dict(), "step": self.progress.step,
                "rng": torch.get_rng_state()}


def assert_bitwise(expected: dict, actual: dict) -> None:
    assert expected["model"].keys() == actual["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(tensor, actual["model"][name]), name
    for index, entries in expected["optim"].items():
        for key, tensor in entries.items():
            assert torch.equal(tensor, actual["optim"][index][key]), (index, key)
    for key in ("param_groups", "scheduler", "loader", "step"):
        assert expected[key] == actual[key], key
    assert torch.equal(expected["rng"], actual["rng"])


def load_into_fresh(root: Path, step: int, device: str) -> dict:
    """Load ``step`` into a fresh run; its captured state. The process's RNG streams are put back after."""
    rng = RNGState().state_dict()
    fresh = Run(device, seed=1)
    checkpointer = Checkpointer(root, CheckpointConfig(mode="async"), fresh.registry)
    try:
        assert checkpointer.load(step) == step
        return fresh.capture()
    finally:
        checkpointer.close()
        RNGState().load_state_dict(rng)


@pytest.fixture
def gate(monkeypatch) -> threading.Event:
    """Holds every background copy until set; records the copies that finished in ``gate.copied``."""
    gate = threading.Event()
    gate.copied = []
    copy = checkpoint_staging.SnapshotStager._copy

    def gated_copy(self, tree, ready):
        assert gate.wait(timeout=60), "the test never opened the gate"
        staged = copy(self, tree, ready)
        gate.copied.append(staged)
        return staged
    monkeypatch.setattr(checkpoint_staging.SnapshotStager, "_copy", gated_copy)
    return gate


def test_the_small_and_large_tensors_lie_on_either_side_of_the_line():
    run = Run("cpu")
    sizes = {name: t.nbytes for name, t in run.model.state_dict().items()}
    assert sizes["3.weight"] > SYNC_COPY_BYTES  # copied in the background
    assert sizes["1.running_mean"] <= SYNC_COPY_BYTES and sizes["4.running_var"] <= SYNC_COPY_BYTES


@pytest.mark.parametrize("device", DEVICES)
def test_save_returns_before_the_copy_and_holds_the_state_at_its_step(tmp_path, gate, device):
    run = Run(device)
    run.train(3)
    expected = run.capture()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(mode="async"), run.registry)
    checkpointer.save(run.progress.step)
    assert gate.copied == []  # save returned while the copy of the large tensors had not even begun
    run.forward_backward()  # BatchNorm statistics change, the RNG advances, gradients are written
    assert not torch.equal(run.model[1].running_mean.cpu(), expected["model"]["1.running_mean"])
    gate.set()
    checkpointer.wait_for_snapshot()
    assert len(gate.copied) == 1
    run.finish_step()  # the weights, the optimizer state, the schedule and the loader position change
    run.train(1)
    checkpointer.close()
    assert_bitwise(expected, load_into_fresh(tmp_path, 3, device))


def test_an_optimizer_step_waits_for_the_copy(tmp_path, gate):
    """Code that never calls wait_for_snapshot still saves the state at the save's step."""
    run = Run("cpu")
    run.train(2)
    expected = run.capture()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(mode="async"), run.registry)
    checkpointer.save(run.progress.step)
    run.forward_backward()
    opener = threading.Timer(0.5, gate.set)  # opened later, from elsewhere: the step below must wait for it
    opener.start()
    run.finish_step()
    assert gate.is_set() and len(gate.copied) == 1
    opener.join()
    checkpointer.close()
    assert_bitwise(expected, load_into_fresh(tmp_path, 2, "cpu"))


def test_without_overlap_save_returns_with_the_copy_taken(tmp_path):
    run = Run("cpu")
    run.train(2)
    expected = run.capture()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(mode="async", overlap_copy=False), run.registry)
    checkpointer.save(run.progress.step)
    with torch.no_grad():  # in place, behind the optimizer's back: legitimate once save() has returned
        for parameter in run.model.parameters():
            parameter.add_(1.0)
    checkpointer.close()
    assert_bitwise(expected, load_into_fresh(tmp_path, 2, "cpu"))


def test_wait_for_snapshot_without_a_save_in_flight_returns(tmp_path):
    run = Run("cpu")
    for mode in ("sync", "async"):
        checkpointer = Checkpointer(tmp_path / mode, CheckpointConfig(mode=mode), run.registry)
        checkpointer.wait_for_snapshot()
        checkpointer.save(0)
        checkpointer.wait()
        checkpointer.wait_for_snapshot()
        checkpointer.close()


def test_a_failed_copy_fails_its_save_and_leaves_nothing(tmp_path, monkeypatch):
    def failing_copy(self, tree, ready):
        raise MemoryError("no memory for the staging buffers")
    monkeypatch.setattr(checkpoint_staging.SnapshotStager, "_copy", failing_copy)
    run = Run("cpu")
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(mode="async"), run.registry)
    checkpointer.save(1)
    with pytest.raises(MemoryError, match="staging buffers"):
        checkpointer.wait_for_snapshot()
    run.train(1)  # the optimizer no longer waits for the failed copy
    with pytest.raises(MemoryError):
        checkpointer.close()
    assert list(tmp_path.iterdir()) == []  # the torn directory is deleted


NO_DCP = """
import sys
import torch
from traincore.checkpoint import format as checkpoint_format
from traincore.checkpoint import layout as checkpoint_files
from traincore.checkpoint import writer as checkpoint_writer
from traincore.checkpoint import Checkpointer
from traincore.config.schema import CheckpointConfig

class Registry:
    # What the Checkpointer uses of a StateRegistry (traincore.run.state itself imports DCP's state-dict
    # helpers).
    def __init__(self, value):
        self.weights = {"w": torch.full((4,), value)}
    def shared_state(self, full=False):
        return {"model": dict(self.weights)}
    def rank_state(self):
        return {}
    def load(self, shared, rank):
        self.weights = dict(shared["model"])

root = sys.argv[1]
checkpointer = Checkpointer(root, CheckpointConfig(mode="sync"), Registry(1.0))
checkpointer.save(1)
checkpointer.close()
fresh = Registry(0.0)
loader = Checkpointer(root, CheckpointConfig(mode="sync"), fresh)
assert loader.load() == 1 and torch.equal(fresh.weights["w"], torch.ones(4))
loader.close()
weights, _ = checkpoint_format.read_checkpoint(checkpoint_files.step_dir(root, 1))
assert torch.equal(weights["w"], torch.ones(4))
print("sync", "torch.distributed.checkpoint" in sys.modules)
Checkpointer(root + "-dcp", CheckpointConfig(mode="dcp"), Registry(2.0)).save(1)
print("dcp", "torch.distributed.checkpoint" in sys.modules)
"""


def test_a_sync_run_never_imports_dcp(tmp_path):
    script = tmp_path / "no_dcp.py"
    script.write_text(textwrap.dedent(NO_DCP))
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True,
                            text=True, timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["sync", "False", "dcp", "True"]
