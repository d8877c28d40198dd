"""SIGKILL in the middle of a checkpoint write, in every mode, at every point of the write.

Each case runs a child process (a script this module writes) that trains a tiny registry, saves at steps 2,
4, 6 with ``keep_last=2`` and kills itself with SIGKILL inside the save of step 8, at one named point:
patching one function of our own modules in that child only (DCP's files: our FileSystemWriter
subclass, after this rank's data file is written and before DCP's .metadata is). dcp and async also run on
2 ranks (gloo), where one rank dies and the launcher takes the other down. The parent then checks, before
anything resumes:

* the torn step 8 is not complete (or, for kills during pruning, it is and the step being pruned is torn);
* every step that was complete before the save (but the one pruning was deleting) is still complete and
  verifies;
* the torn state on disk is the one the kill point leaves (a partial file, an unrenamed .tmp, ...).

A fresh process then loads every complete step into a fresh registry (bitwise what was saved), resumes from
the latest (the previous complete step; never the torn one), re-trains bit for bit the steps the killed run
had taken, saves over the torn step and completes, leaving only complete, verified step directories.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from faultlib import Job, read_jsonl, wait_jobs

from traincore.checkpoint import MARKER, complete_steps, step_dir, verify_checkpoint

EVERY, KEEP_LAST, KILL_STEP, UNTIL = 2, 2, 8, 12

CHILD = '''
"""A checkpointing run that SIGKILLs itself at one point of one save (written by test_checkpoint_kills.py).

python child.py --root R --logs L --mode dcp --until 12 [--kill-point data --kill-step 8 --kill-rank 0]
[--check-all]; RANK / WORLD_SIZE / FAULT_INIT (file:// rendezvous) from the environment.
"""
import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from faultlib import TinyRun

from traincore.checkpoint import checkpointer as checkpoint
from traincore.checkpoint import commit as checkpoint_commit
from traincore.checkpoint import store as checkpoint_store
from traincore.checkpoint import writer as checkpoint_writer
from traincore.checkpoint import Checkpointer
from traincore.checkpoint import MARKER, complete_steps, step_dir
from traincore.config.schema import CheckpointConfig

parser = argparse.ArgumentParser()
parser.add_argument("--root", type=Path, required=True)
parser.add_argument("--logs", type=Path, required=True)
parser.add_argument("--mode", required=True)
parser.add_argument("--every", type=int, default=2)
parser.add_argument("--keep-last", type=int, default=2)
parser.add_argument("--until", type=int, required=True)
parser.add_argument("--kill-point", default="")
parser.add_argument("--kill-step", type=int, default=0)
parser.add_argument("--kill-rank", type=int, default=0)
parser.add_argument("--check-all", action="store_true")
args = parser.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if world > 1:
    dist.init_process_group("gloo", init_method=os.environ["FAULT_INIT"], rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
# Small write blocks: a file is written in several, so a kill mid-file leaves some of it on disk.
BLOCK = checkpoint_writer._WRITE_BLOCK = 1 << 16
TARGET = step_dir(args.root, args.kill_step)
args.logs.mkdir(parents=True, exist_ok=True)
LOG = open(args.logs / f"rank{rank}.jsonl", "a")


def log(event, **fields):
    LOG.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields}) + "\\n")
    LOG.flush()


def die(where):
    log("kill", point=args.kill_point, where=str(where), complete=complete_steps(args.root))
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point):
    """Patch the function of our own module where ``point`` lies, to SIGKILL this process there."""
    if point in ("data", "metadata") and args.mode != "sync":  # torch's writer writes DCP's files
        from traincore.checkpoint import dcp as checkpoint_dcp
        writer = checkpoint_dcp.CheckedFileSystemWriter
        write_data, finish = writer.write_data, writer.finish

        def killing_write_data(self, plan, planner):  # this rank's data file written, nothing after it
            written = write_data(self, plan, planner)
            if self.directory == TARGET and point == "data":
                die(sorted(TARGET.glob(f"__{rank}_*.distcp"))[-1])
            return written

        def killing_finish(self, metadata, results):  # every data file written, .metadata not begun
            if self.directory == TARGET:
                die(self.directory)
            finish(self, metadata, results)
        writer.write_data, writer.finish = killing_write_data, killing_finish
    elif point in ("data", "extra"):  # inside ChecksumWriter.write of that file
        names = {"data": (".state.pt.tmp",), "extra": (".extra.pt.tmp",)}[point]
        write = checkpoint_writer.ChecksumWriter.write

        def killing_write(self, data):
            written = write(self, data)
            if (self.path.parent == TARGET and self.path.name.endswith(names)
                    and (point != "data" or self.tell() > BLOCK)):
                for future in self._pending:
                    future.result()  # the blocks handed to the write thread are on disk
                die(self.path)
            return written
        checkpoint_writer.ChecksumWriter.write = killing_write
    elif point == "publish-state":  # state.pt written in full, not renamed into place
        publish = checkpoint_writer.publish

        def killing_publish(tmp, path):
            if Path(tmp).parent == TARGET:
                die(tmp)
            publish(tmp, path)
        checkpoint_writer.publish = killing_publish
    elif point == "marker":  # every data file written, the marker not begun
        write_marker = checkpoint.write_marker

        def killing_write_marker(directory, *rest):
            if Path(str(directory)) == TARGET:  # a Store, whose str() is its path
                die(directory)
            return write_marker(directory, *rest)
        checkpoint.write_marker = killing_write_marker
    elif point == "marker-publish":  # the marker written to its .tmp, not renamed into place
        publish = checkpoint_commit.publish

        def killing_marker_publish(tmp, path):
            if Path(tmp).parent == TARGET and Path(path).name == MARKER:
                die(tmp)
            publish(tmp, path)
        checkpoint_commit.publish = killing_marker_publish
    elif point in ("prune-start", "prune-mid"):  # the step committed, pruning begun / a marker removed
        prune, fsync = checkpoint.prune, checkpoint_store.fsync_path
        pruning = []

        def killing_prune(root, keep_last, keep_best=None):
            if complete_steps(root)[-1:] == [args.kill_step]:
                if point == "prune-start":
                    die(root)
                pruning.append(True)
            prune(root, keep_last, keep_best)

        def killing_fsync(path):
            # remove_step fsyncs the step directory once its marker is gone, before deleting any file
            if pruning and Path(path).parent == args.root and not (Path(path) / MARKER).exists():
                die(path)
            fsync(path)
        checkpoint.prune, checkpoint_store.fsync_path = killing_prune, killing_fsync
    else:
        raise SystemExit(f"unknown kill point {point!r}")


def log_before_save(step):
    """Log what is complete when the save of ``step`` begins, once the previous (async) one committed."""
    save = Checkpointer.save

    def logging_save(self, saving, metrics=None):
        if saving == step:
            self.wait()
            log("saving", step=step, complete=complete_steps(args.root))
        save(self, saving, metrics)
    Checkpointer.save = logging_save


if args.kill_point:
    log_before_save(args.kill_step)
    if rank == args.kill_rank:
        arm(args.kill_point)
cfg = CheckpointConfig(mode=args.mode, every=args.every, keep_last=args.keep_last)
if args.check_all:  # every complete step, loaded into a fresh registry by number
    for step in complete_steps(args.root):
        fresh = TinyRun(rank, world, seed=100 + step)
        loader = Checkpointer(args.root, cfg, fresh.registry, rank, world)
        assert loader.load(step) == step
        loader.close()
        log("loaded", step=step, digests=fresh.digests())
run = TinyRun(rank, world)
checkpointer = Checkpointer(args.root, cfg, run.registry, rank, world)
resumed = checkpointer.load()
log("start", resumed=resumed, step=run.step, digests=run.digests())
while run.step < args.until:
    run.train_step()
    log("step", step=run.step, digests=run.digests())
    checkpointer.maybe_save(run.step, last_step=run.step == args.until)
checkpointer.close()
log("done", step=run.step, complete=complete_steps(args.root))
if world > 1:
    dist.destroy_process_group()
'''

# (mode, ranks): the kill points tried, each with the rank that dies there.
CASES = {
    ("sync", 1): [("data", 0), ("publish-state", 0), ("marker", 0), ("marker-publish", 0),
                  ("prune-start", 0), ("prune-mid", 0)],
    ("dcp", 1): [("data", 0), ("extra", 0), ("metadata", 0), ("marker", 0), ("prune-mid", 0)],
    ("async", 1): [("data", 0), ("metadata", 0), ("marker-publish", 0), ("prune-start", 0)],
    ("dcp", 2): [("data", 1), ("marker", 0), ("prune-start", 0)],
    ("async", 2): [("data", 1), ("metadata", 0), ("prune-mid", 0)],
}


class Case:
    """One kill point of one mode: its directories and the records its processes logged."""

    def __init__(self, tmp: Path, script: Path, mode: str, world: int, point: str, kill_rank: int):
        self.mode, self.world, self.point, self.kill_rank = mode, world, point, kill_rank
        self.dir = tmp / f"{mode}-{world}-{point}"
        self.root, self.script = self.dir / "checkpoints", script
        self.killed_logs, self.resumed_logs = self.dir / "killed", self.dir / "resumed"

    def args(self, logs: Path, *extra: str) -> list[str]:
        return ["--root", str(self.root), "--logs", str(logs), "--mode", self.mode, "--every", str(EVERY),
                "--keep-last", str(KEEP_LAST), "--until", str(UNTIL), *extra]

    def start_killed(self) -> Job:
        return Job(self.script, self.args(self.killed_logs, "--kill-point", self.point, "--kill-step",
                                          str(KILL_STEP), "--kill-rank", str(self.kill_rank)),
                   self.world, self.dir, "killed")

    def start_resumed(self) -> Job:
        return Job(self.script, self.args(self.resumed_logs, "--check-all"), self.world, self.dir, "resumed")

    def records(self, logs: Path, rank: int, event: str) -> list[dict]:
        return [r for r in read_jsonl(logs / f"rank{rank}.jsonl") if r["event"] == event]


def check_torn_state(case: Case, before: list[int], after: list[int], kill: dict) -> None:
    """What the kill left on disk is what that point leaves, and nothing complete was lost."""
    torn = step_dir(case.root, KILL_STEP)
    names = sorted(p.name for p in torn.iterdir()) if torn.is_dir() else []
    where = f"{case.point}: {torn} holds {names}"
    if case.point.startswith("prune"):
        committed = [*before, KILL_STEP]
        victims = committed[:-KEEP_LAST]
        assert victims, where
        if case.point == "prune-start":  # nothing deleted yet
            assert after == committed, where
        else:  # the victim's marker is gone (durably, before anything else), its files are still there
            assert after == [s for s in committed if s != victims[0]], where
            victim = step_dir(case.root, victims[0])
            assert victim.is_dir() and not (victim / MARKER).exists(), victim
            assert any(p.stat().st_size > 0 for p in victim.iterdir()), list(victim.iterdir())
        return
    assert after == before, f"{where}: complete before the save {before}, after the kill {after}"
    assert MARKER not in names, where
    # A surviving rank 0 sees the save fail and deletes the torn directory; the launcher may take it down
    # before, during or after that deletion, so any part of the directory may be gone.
    survivor_cleans = case.world > 1 and case.kill_rank != 0
    if not torn.is_dir():
        assert survivor_cleans, where
        return
    if case.point == "data":
        torn_file = Path(kill["where"])
        if torn_file.exists():
            # sync: a block of state.pt reached the disk; dcp: the rank's file, written by torch's writer
            assert torn_file.stat().st_size >= (1 << 16 if case.mode == "sync" else 1), where
        else:
            assert survivor_cleans, where
    if case.point == "metadata":  # every rank's data is written, DCP's index is not
        assert ".metadata" not in names and any(name.endswith(".distcp") for name in names), where
    expected = {"extra": ".extra.pt.tmp", "publish-state": ".state.pt.tmp",
                "marker-publish": f".{MARKER}.tmp"}.get(case.point)
    if expected:
        assert expected in names, where
    if case.point == "publish-state":
        assert "state.pt" not in names, where
    if case.point in ("marker", "marker-publish"):  # every data file is in place
        assert ("state.pt" if case.mode == "sync" else ".metadata") in names, where


def check_killed(case: Case, job: Job) -> tuple[list[int], list[int]]:
    """The kill happened at its point and left what it should; returns (complete before, after)."""
    codes = job.codes()
    assert codes[case.kill_rank] == -9, f"{case.point}: exit codes {codes}\n{job.output()}"
    kills = case.records(case.killed_logs, case.kill_rank, "kill")
    assert len(kills) == 1, f"{case.point}: the kill point was not reached\n{job.output()}"
    before = case.records(case.killed_logs, 0, "saving")[0]["complete"]
    after = complete_steps(case.root)
    assert after == kills[0]["complete"], (case.point, after, kills[0])  # nothing changed once it died
    check_torn_state(case, before, after, kills[0])
    for step in after:
        verify_checkpoint(step_dir(case.root, step))
    return before, after


def check_resumed(case: Case, after: list[int], job: Job) -> None:
    """A fresh run loads every complete step bitwise, resumes from the latest and completes."""
    assert job.codes() == [0] * case.world, f"{case.point}: resumed run exited {job.codes()}\n{job.output()}"
    for rank in range(case.world):
        saved = {r["step"]: r["digests"] for r in case.records(case.killed_logs, rank, "step")}
        loaded = {r["step"]: r["digests"] for r in case.records(case.resumed_logs, rank, "loaded")}
        assert sorted(loaded) == after
        for step, digests in loaded.items():  # bitwise what was saved, shared and this rank's RNG
            assert digests == saved[step], (case.point, rank, step)
        start = case.records(case.resumed_logs, rank, "start")[0]
        assert start["resumed"] == after[-1], (case.point, start, after)  # the latest complete, not the torn
        assert start["digests"] == saved[after[-1]]
        replayed = {r["step"]: r["digests"] for r in case.records(case.resumed_logs, rank, "step")}
        assert sorted(replayed) == list(range(after[-1] + 1, UNTIL + 1))
        for step in sorted(set(replayed) & set(saved)):  # the resumed run retraces the killed one
            assert replayed[step] == saved[step], (case.point, rank, step)
    done = case.records(case.resumed_logs, 0, "done")[0]
    final = complete_steps(case.root)
    assert done["complete"] == final and final[-1] == UNTIL
    assert sorted(p.name for p in case.root.iterdir()) == [step_dir("", s).name for s in final]  # none torn
    for step in final:
        verify_checkpoint(step_dir(case.root, step))


@pytest.mark.parametrize("mode, world", list(CASES), ids=[f"{m}-{w}rank" for m, w in CASES])
def test_sigkill_during_checkpoint_write(tmp_path, mode, world):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    cases = [Case(tmp_path, script, mode, world, point, rank) for point, rank in CASES[mode, world]]
    start = time.perf_counter()
    killed = [case.start_killed() for case in cases]
    wait_jobs(killed, timeout=240)
    kill_s = time.perf_counter() - start
    states = [check_killed(case, job) for case, job in zip(cases, killed, strict=True)]  # before any resume
    resumed = [case.start_resumed() for case in cases]
    wait_jobs(resumed, timeout=240)
    total_s = time.perf_counter() - start
    for case, (before, after), job in zip(cases, states, resumed, strict=True):
        check_resumed(case, after, job)
        print(f"[kill] mode={mode} ranks={world} point={case.point} rank={case.kill_rank}: complete before "
              f"{before}, after the kill {after}, resumed from {after[-1]}, final "
              f"{complete_steps(case.root)}")
    print(f"[kill] mode={mode} ranks={world}: {len(cases)} kill points, {len(cases) * world * 2} processes, "
          f"kills {kill_s:.1f} s, total {total_s:.1f} s")
