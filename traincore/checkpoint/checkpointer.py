"""Checkpoints: save and resume a run's state registry in one of three modes.

The checkpointer is handed a :class:`~traincore.run.state.StateRegistry` and never looks inside its members:
it
saves the registry's shared state and gathers every rank's per-rank state. ``sync`` writes one ``state.pt``
from rank 0; ``dcp`` and ``async`` write a torch.distributed.checkpoint directory, every rank its own part.
Where the files go is :mod:`traincore.checkpoint.layout`, the commit marker and its checksums
:mod:`traincore.checkpoint.commit`, what the files hold :mod:`traincore.checkpoint.format`. Our own files are
checksummed while written; DCP's are written by torch's FileSystemWriter and read back once, each rank a share
of them. Rank 0 gathers the checksums and writes the marker last, once every rank's writes are done.

Resume takes the latest complete checkpoint (:mod:`traincore.checkpoint.resume`, which preflight calls too, so
both pick the same step and refuse one that does not fit the run alike). If ``verify_on_load`` finds one of
its files corrupt (checksum mismatch or truncated, or a damaged commit marker), a warning names the file and
loading FALLS BACK to the previous complete checkpoint, so one bad write costs ``every`` steps rather than the
run. A corrupt step that was asked for by number is an error, and so is a commit.json of another program or
format (refused, never skipped) and a file that passes verification but cannot be read; each message names the
file.

A save that fails (a full disk: "no space left on device while writing <path>") raises CheckpointWriteError,
a CheckpointError and an OSError; rank 0 deletes the torn directory, and the committed ones stay as they are.

``async`` returns once the copy of the state into staging buffers (pinned memory on CUDA) has *started*,
and writes from background threads over a gloo process group of its own. Every save still holds the state
at its step, bit for bit: the non-tensor state (step, loader position, schedule, RNG streams, telemetry
totals) is serialised and the tensors of up to 1 MiB (BatchNorm statistics, counters) are copied before
``save`` returns; the large tensors (parameters, optimizer state), which only an optimizer step changes, are
copied while the next forward and backward run. :meth:`Checkpointer.wait_for_snapshot` waits for that copy;
the training step calls it before ``optimizer.step()``, and the registry's optimizers wait for it anyway
while a copy is in flight (a step pre-hook on each of them, registered only for that time; no other
optimizer of the process is touched). Code that changes a large saved tensor
in place by other means calls ``wait_for_snapshot`` first, or sets ``checkpoint.overlap_copy=false``, which
copies everything before ``save`` returns. At most one save is in flight: the next ``save``, ``load``,
``wait`` and ``close`` first wait for the previous one, since overlapping DCP saves can hang.

Every mode reads and writes the model and optimizer through torch.distributed.checkpoint's state_dict API
(:mod:`traincore.run.state`), which imports the package at the first save or load, not at start-up; DCP's
storage layer (:mod:`traincore.checkpoint.dcp`) is used by ``dcp`` and ``async`` checkpoints only.

Per-rank state (RNG streams) cannot be matched to ranks when the world size changed since the save; it is
then kept as it is (and logged). Shared state reshards (DCP) or is replicated (``sync``), so every mode
resumes on any world size.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.optim import Optimizer

from traincore.checkpoint.commit import checksum_share, read_marker, write_marker
from traincore.checkpoint.errors import CheckpointError, write_error
from traincore.checkpoint.format import flat_shapes, load_tensors, open_saved, split_tensors
from traincore.checkpoint.layout import EXTRA_FILE, STATE_FILE, step_dirs, step_store
from traincore.checkpoint.prune import clear_step, prune, remove_step
from traincore.checkpoint.resume import RunFit, changed_settings, check_fit, choose_step
from traincore.checkpoint.store import Store, as_store
from traincore.checkpoint.writer import save_to_store, serialize, write_to_store
from traincore.config import CheckpointConfig

if TYPE_CHECKING:  # traincore.run.state imports DCP's state-dict helpers
    from traincore.run import StateRegistry

# Creating the checkpoint group: every rank left the process-group barrier and DDP's parameter broadcast
# moments before, and only telemetry set-up lies between (W&B's own init gives up after 90 s), so a rank
# missing for 2 minutes is hung or dead; the 30-minute allowance below would make that a 30-minute hang.
GROUP_START_TIMEOUT = timedelta(minutes=2)
# Every later checkpoint collective: the longest is a barrier while the slowest rank writes its part (sync:
# rank 0 writes everything; resume: rank 0 checksums it all). ~100 GB of training state at the slowest
# fsync'd rate measured on our machines (0.2 GB/s) is ~8 minutes; 30 leaves room for slower shared storage.
SAVE_TIMEOUT = timedelta(minutes=30)

log = logging.getLogger(__name__)


@dataclass
class SaveStats:
    """Cost of the last committed save: seconds training was blocked, seconds until committed, bytes."""

    step: int
    mode: str
    blocking_s: float
    total_s: float
    num_bytes: int  # counted by rank 0; 0 elsewhere


class Checkpointer:
    """Saves and restores a StateRegistry under ``root``; every rank constructs it and calls each method."""

    def __init__(self, root: str | Path | Store, cfg: CheckpointConfig, registry: StateRegistry,
                 rank: int = 0, world_size: int = 1, keep_best: str | None = None):
        self.root, self.cfg, self.registry = as_store(root), cfg, registry
        self.keep_best = keep_best  # the metric whose best step pruning keeps (train.metric)
        self.rank, self.world_size = rank, world_size
        self.last_save: SaveStats | None = None
        self.committed: int | None = None  # the newest step this run loaded or committed
        self._interval_start = time.monotonic()  # checkpoint.every_s counts from here
        self.interval_s = cfg.every_s  # every_s, or longer while saves block more than max_save_share
        self._present: set[int] | None = None  # object store: step prefixes known there (rank 0)
        self._group = self._new_group()
        self._pending: Future | None = None  # the commit of the save in flight
        self._snapshot: Future | None = None  # its copy of the state, while it may be in progress
        self._hold_steps: list = []  # hooks on the registered optimizers' steps that wait for the copy
        self._stager = self._executor = None
        if cfg.mode == "async":
            from traincore.checkpoint.snapshot import SnapshotStager

            self._stager = SnapshotStager(overlap=cfg.overlap_copy)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")

    def _new_group(self) -> dist.ProcessGroup | None:
        if not dist.is_initialized():
            if self.world_size != 1:
                raise CheckpointError(f"world_size={self.world_size} needs an initialised process group: "
                                      "call torch.distributed.init_process_group first")
            return None
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise CheckpointError(f"rank={self.rank}, world_size={self.world_size} disagree with the process "
                                  f"group ({dist.get_rank()}, {dist.get_world_size()}): pass the group's "
                                  "values")
        # A gloo group of our own: checkpoint collectives never queue behind the training backend's (nor
        # hit its lowered timeout during a long save), and async saves get the CPU backend they need.
        # Its creation waits for every rank: bounded by GROUP_START_TIMEOUT, not by the saves' allowance.
        group = dist.new_group(backend="gloo", timeout=GROUP_START_TIMEOUT)
        dist.set_timeout(SAVE_TIMEOUT, group=group)
        return group

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def _broadcast(self, obj: Any) -> Any:
        if self._group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _gather(self, obj: Any) -> list | None:
        if self._group is None:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._group)
        return out

    def maybe_save(self, step: int, last_step: bool, interval_due: bool = False,
                   metrics: dict[str, float] | None = None) -> bool:
        """Save at every ``cfg.every``-th step, at the last one, at a validated one (``metrics``, which its
        marker records) and when the ranks agreed that ``cfg.every_s`` ran out (``interval_due``; see
        :meth:`interval_elapsed`): the one place this rule lives. True when a save of ``step`` began."""
        due = (bool(self.cfg.every and step % self.cfg.every == 0) or last_step or interval_due
               or metrics is not None)
        if due:
            self.save(step, metrics)
        return due

    def interval_elapsed(self) -> bool:
        """Whether ``cfg.every_s`` seconds passed on this rank's clock since its last save began (or since
        the run started); the ranks agree on it before any of them saves (PreemptionWatch.agree)."""
        return bool(self.cfg.every_s) and time.monotonic() - self._interval_start >= self.interval_s

    def save(self, step: int, metrics: dict[str, float] | None = None) -> None:
        """Write ``<root>/step-{step:06d}/``, its marker recording ``metrics`` (the step's validation);
        returns once training may go on (async: once the copy of the state has started; see
        :meth:`wait_for_snapshot`)."""
        start = time.perf_counter()
        self._interval_start = time.monotonic()
        self.wait()
        directory = step_store(self.root, step)
        # sync: the naive way, the whole state gathered onto rank 0, which writes it alone
        shared = self.registry.shared_state(full=self.cfg.mode == "sync")
        per_rank = self._gather(self.registry.rank_state())
        # no rank writes before the leftover is gone; an entry that is not ours stops every rank
        error = self._broadcast(self._make_dir(directory, step) if self.rank == 0 else None)
        if error:
            raise CheckpointError(error)
        with failing_save(directory, discard=self.rank == 0):  # e.g. a full disk: the error names the file
            finish = self._write(directory, step, shared, per_rank)
        blocking = time.perf_counter() - start
        log.info("checkpoint step=%d mode=%s blocking=%.3fs", step, self.cfg.mode, blocking)
        if self._executor is None:
            self._commit(directory, step, start, blocking, finish, metrics)
            self._barrier()  # no rank goes on (or reads it) before the marker exists
        else:
            self._pending = self._executor.submit(self._commit, directory, step, start, blocking, finish,
                                                  metrics)
        self._pace(time.perf_counter() - start)

    def _pace(self, stalled_s: float) -> None:
        """The wall-clock interval after a save that held training up ``stalled_s`` (every rank alike: the
        sync path ends at a barrier): ``every_s``, or that stall over ``max_save_share`` when longer, so that
        time-triggered saves never cost more than that share of the run."""
        share, every = self.cfg.max_save_share, self.cfg.every_s
        interval = max(every, stalled_s / share) if every and share else every
        changed = interval > 1.1 * self.interval_s or interval < 0.9 * self.interval_s
        if self.rank == 0 and interval > every and changed:  # one line per run, not one per rank
            log.warning("a save held training up %.1f s: the next wall-clock save comes after %.0f s instead "
                        "of checkpoint.every_s=%.0f s, keeping saves under checkpoint.max_save_share=%g of "
                        "the run (checkpoint.mode=async holds training up for the copy of the state only)",
                        stalled_s, interval, every, share)
        self.interval_s = interval

    def _make_dir(self, directory: Store, step: int) -> str | None:
        """Rank 0: replace a torn (or superseded) leftover of the step by an empty directory; the error.

        In an object store only a step known to be there is looked at: the root's step prefixes listed at
        the first save, and this run's own saves since. A listing per save (a round trip to the store)
        would sit on the path that blocks training, which for ``async`` is otherwise milliseconds.
        """
        try:
            if self.root.local:
                clear_step(directory)
            else:
                if self._present is None:
                    self._present = set(step_dirs(self.root))
                if step in self._present:
                    clear_step(directory)
                self._present.add(step)
            directory.make_dir()
        except CheckpointError as exc:
            return str(exc)
        except OSError as exc:
            return str(write_error(exc, directory.uri))
        return None

    def _write(self, directory: Store, step: int, shared: dict, per_rank: list | None
               ) -> Callable[[], dict[str, dict]]:
        """Write this rank's part (async: start to); returns what finishes the writes and returns the
        checksums of this rank's files (async: run by the commit thread)."""
        if self.cfg.mode == "sync":
            payload = {"step": step, "shared": shared, "per_rank": per_rank}
            checksums = {STATE_FILE: save_to_store(payload, directory, STATE_FILE)} if self.rank == 0 else {}
            return lambda: checksums
        from traincore.checkpoint.dcp import save_tensors

        tensors, rest = split_tensors(shared)
        # The non-tensor state is serialised now, while it is the state at this step; written later.
        extra = serialize({"step": step, "shared": rest, "per_rank": per_rank}) if self.rank == 0 else None
        response, store_writer = save_tensors(tensors, directory, self.rank, self._group, self._stager)
        if response is not None:
            self._hold_optimizer_steps(self._stager.snapshot)

        def finish() -> dict[str, dict]:
            if response is not None:
                response.upload_completion.result()  # every rank's data and DCP's .metadata are written
            # In an object store each rank's writer checksummed its bytes on their way up: nothing is read
            # back from the store. Locally, torch's writer wrote them: each rank reads back a share.
            checksums = (dict(store_writer.checksums) if store_writer is not None
                         else checksum_share(directory, self.rank, self.world_size))
            if extra is not None:
                checksums[EXTRA_FILE] = write_to_store(extra, directory, EXTRA_FILE)
            return checksums
        return finish

    def _hold_optimizer_steps(self, snapshot: Future) -> None:
        """Make the registered optimizers' steps wait for ``snapshot``, the copy in progress, until it is
        waited for: a loop that never calls wait_for_snapshot still saves the state at its step."""
        self._snapshot = snapshot

        # Removed by wait_for_snapshot, not from inside a step (torch iterates over the hooks then).
        def wait_for_copy(optimizer: Any, args: Any, kwargs: Any) -> None:
            snapshot.result()
        self._hold_steps = [optimizer.register_step_pre_hook(wait_for_copy)
                            for optimizer in registered_optimizers(self.registry)]

    def _commit(self, directory: Store, step: int, start: float, blocking: float,
                finish: Callable[[], dict[str, dict]], metrics: dict[str, float] | None) -> None:
        """Every rank: finish writing and hand its checksums to rank 0, which writes the marker and prunes."""
        with failing_save(directory, discard=self.rank == 0):
            checksums = finish()
        gathered = self._gather(checksums)
        num_bytes = 0
        if self.rank == 0:
            every_rank = {name: entry for part in gathered for name, entry in part.items()}
            with failing_save(directory, discard=True):  # no marker: a torn save, deleted
                num_bytes = write_marker(directory, step, self.cfg.mode, self.world_size, every_rank,
                                         metrics)
            prune(self.root, self.cfg.keep_last, self.keep_best)
        self.last_save = SaveStats(step, self.cfg.mode, blocking, time.perf_counter() - start, num_bytes)
        self.committed = step
        if self.rank == 0:
            log.info("checkpoint step=%d committed: %.3f GB in %.2fs", step, num_bytes / 1e9,
                     self.last_save.total_s)

    def wait_for_snapshot(self) -> None:
        """Block until the copy of the state an async save is taking is complete; a no-op when none is.

        Call it before changing saved tensors in place: the training step calls it before
        ``optimizer.step()``. A failed copy raises here (and fails that save).
        """
        if self._snapshot is None:
            return
        snapshot, self._snapshot = self._snapshot, None
        for handle in self._hold_steps:
            handle.remove()
        self._hold_steps = []
        snapshot.result()

    def wait(self) -> None:
        """Block until an in-flight async save is complete and committed."""
        self.wait_for_snapshot()
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()
        self._barrier()  # rank 0's marker exists before any rank goes on

    def close(self) -> None:
        """Wait for an in-flight save, then release the stager, the commit thread and the process group."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._stager.close()
                self._executor = self._stager = None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    def load(self, step: int | None = None, at_most: int | None = None) -> int | None:
        """Restore the registry from ``step`` (default: the latest complete one, up to ``at_most`` when
        given); None if none exists."""
        self.wait()
        chosen, error = self._broadcast(self._choose(step, at_most) if self.rank == 0 else None)
        if error:
            raise CheckpointError(error)
        if chosen is None:
            return None
        directory = step_store(self.root, chosen)
        marker = read_marker(directory)
        saved = open_saved(directory, marker)
        state = self.registry.shared_state()
        # The run's own tensors, filled in place; members the checkpoint lacks keep theirs (registry.load).
        current = split_tensors(state)[0]
        template = {member: tensors for member, tensors in current.items() if member in saved.shared}
        check_fit(directory, saved, RunFit.of_state(state), shapes=flat_shapes(template))
        load_tensors(saved, directory, marker, template, self._group)
        rank_state = saved.per_rank[self.rank] if len(saved.per_rank) == self.world_size else None
        if rank_state is None:
            log.info("checkpoint was written by %d ranks, this run has %d: per-rank state (RNG) cannot be "
                     "matched to ranks, keeping the current one", len(saved.per_rank), self.world_size)
        self.registry.load(saved.shared, rank_state)
        log.info("resumed from %s (step %d, mode %s)", directory, saved.step, marker["mode"])
        if changes := changed_settings(saved.shared, state):
            log.info("the run continues with settings other than the checkpoint's: %s", ", ".join(changes))
        self.committed = chosen
        return saved.step

    def _choose(self, step: int | None, at_most: int | None) -> tuple[int | None, str | None]:
        """Rank 0: the step to load (None: nothing to resume), or the error every rank raises."""
        try:
            return choose_step(self.root, step, self.cfg.verify_on_load, at_most), None
        except (CheckpointError, OSError) as exc:  # raised on every rank, so no rank waits forever
            return None, str(exc)


def registered_optimizers(registry: StateRegistry) -> list[Optimizer]:
    """The optimizers whose steps change the registry's tensors: members that are one or wrap one (as
    traincore.run.state.OptimizerState does, in its ``optimizer`` attribute)."""
    found = []
    for member in [*registry.shared.values(), *registry.per_rank.values()]:
        optimizer = member if isinstance(member, Optimizer) else getattr(member, "optimizer", None)
        if isinstance(optimizer, Optimizer):
            found.append(optimizer)
    return found


def save_failure(exc: BaseException) -> BaseException:
    """The error a failed save raises: a CheckpointError from any rank rather than DCP's wrapper of it."""
    # Only a DCP save raises DCP's wrapper, and DCP is loaded then: a sync save's failure does not load it.
    api = sys.modules.get("torch.distributed.checkpoint.api")
    if api is not None and isinstance(exc, api.CheckpointException):
        for _, (failure, _) in sorted(exc.failures.items()):
            if isinstance(failure, CheckpointError):
                return failure
    return exc


@contextmanager
def failing_save(directory: Store, discard: bool) -> Iterator[None]:
    """Around a save's writes: raise :func:`save_failure` of an error and, if ``discard`` (rank 0, once no
    rank writes any more), delete the torn step directory, which frees its space."""
    try:
        yield
    except BaseException as exc:
        if discard:
            remove_step(directory)
        failure = save_failure(exc)
        if failure is exc:
            raise
        raise failure from exc
