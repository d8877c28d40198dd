"""A disk that fills while checkpointing (checkpoint part).

A size-limited tmpfs is mounted (as root) and a tiny run checkpoints into it every step until a save fails.
The failure must be a clear error naming the file ("no space left on device while writing <path>: free
space or choose another checkpoint root"), a CheckpointError and an OSError with errno ENOSPC; the training
state in memory is untouched; every checkpoint committed before stays complete, verifies and loads bitwise;
the torn directory is gone (rank 0 deletes it, freeing its space) and nothing without a marker looks
complete; once space is freed, the same checkpointer saves again. Without a mountable tmpfs the tests fail
in CI (CI=true) and are skipped elsewhere, with the reason.

DCP's files are written by torch's FileSystemWriter with one writer thread (DCP drops the errors of its
extra threads, so a save could commit a marker over a partial file); its ENOSPC reaches the save as the
same CheckpointWriteError, naming the .distcp or .metadata file.
"""

from __future__ import annotations

import errno
import os
import re
import time
from pathlib import Path

import pytest
from faultlib import TinyRun, mount_tmpfs, unmount

from traincore.checkpoint import Checkpointer, CheckpointError, complete_steps, step_dir, verify_checkpoint
from traincore.checkpoint.prune import remove_step
from traincore.config.schema import CheckpointConfig
from traincore.run.state import RNGState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NO_SPACE = re.compile(r"no space left on device while writing (\S+): free space or choose another checkpoint "
                      r"root")


@pytest.fixture
def small_disk(tmp_path, request) -> Path:
    """A tmpfs of ``request.param`` bytes mounted on a temporary directory, unmounted afterwards."""
    mount = tmp_path / "small-disk"
    reason = mount_tmpfs(mount, request.param)
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot mount a size-limited filesystem for the disk-full test: {reason}")
        pytest.skip(f"cannot mount a size-limited filesystem (needs root): {reason}")
    try:
        yield mount
    finally:
        unmount(mount)


def load(root: Path, mode: str, step: int | None) -> tuple[str, str]:
    """Load ``step`` into a fresh registry; its digests. The RNG streams are the process's: put back after."""
    rng = RNGState().state_dict()
    fresh = TinyRun(seed=5)
    checkpointer = Checkpointer(root, CheckpointConfig(mode=mode), fresh.registry)
    try:
        loaded = checkpointer.load(step)
        assert loaded == step or step is None, (loaded, step)
        return fresh.digests()
    finally:
        checkpointer.close()
        RNGState().load_state_dict(rng)


def assert_committed_intact(root: Path, mode: str, saved: dict[int, tuple[str, str]]) -> None:
    """Exactly the committed steps are there, each complete, verified and bitwise what was saved."""
    assert complete_steps(root) == sorted(saved)
    assert sorted(p.name for p in root.iterdir()) == [step_dir("", s).name for s in sorted(saved)]
    for step, digests in saved.items():
        verify_checkpoint(step_dir(root, step))
        assert load(root, mode, step) == digests, step


@pytest.mark.parametrize("mode, small_disk", [("sync", "700k"), ("sync", "1100k"), ("dcp", "700k"),
                                              ("dcp", "1100k"), ("async", "900k")],
                         indirect=["small_disk"], ids=["sync-700k", "sync-1100k", "dcp-700k", "dcp-1100k",
                                                       "async-900k"])
def test_checkpointing_into_a_full_disk(small_disk, mode, request):
    start = time.perf_counter()
    root = small_disk / "checkpoints"
    run = TinyRun()
    checkpointer = Checkpointer(root, CheckpointConfig(mode=mode, keep_last=100), run.registry)
    saved: dict[int, tuple[str, str]] = {}
    error = None
    for _ in range(30):
        run.train_step()
        digests = run.digests()
        try:
            checkpointer.save(run.step)
            checkpointer.wait()  # async: the write's error surfaces here
        except CheckpointError as exc:
            error = exc
            break
        saved[run.step] = digests
    assert error is not None, f"30 checkpoints fitted on {small_disk}: the disk never filled"
    assert saved, "not even the first checkpoint fitted: make the disk larger"

    message = str(error)
    match = NO_SPACE.fullmatch(message)
    assert match, message
    failed_file = Path(match.group(1))
    assert failed_file.parent == step_dir(root, run.step), message  # the file of the save that failed
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.filename == str(failed_file)
    assert run.digests() == digests  # the training state in memory is untouched
    assert not step_dir(root, run.step).exists()  # the torn directory is deleted, its space freed
    assert_committed_intact(root, mode, saved)
    assert load(root, mode, None) == saved[max(saved)]  # the next resume lands on the last committed step

    # Free space, and the same checkpointer saves the same state again.
    oldest = min(saved)
    remove_step(step_dir(root, oldest))
    del saved[oldest]
    checkpointer.save(run.step)
    checkpointer.close()
    saved[run.step] = digests
    assert_committed_intact(root, mode, saved)
    size = request.node.callspec.params["small_disk"]
    print(f"[disk-full] mode={mode} tmpfs size={size}: {len(saved)} checkpoints of "
          f"{sum(f.stat().st_size for f in step_dir(root, run.step).iterdir()) / 1024:.0f} KiB fitted; "
          f"save of step {run.step} failed writing {failed_file.name}; {time.perf_counter() - start:.1f} s")
