"""Soak: 200 committed async checkpoints, with the writing process SIGKILLed at random moments in between.

A child process (a script this module writes) trains a tiny run one step at a time, saves asynchronously
every 2 steps (keeping every checkpoint) and, every 5 saves, waits for the commit and loads it into a fresh
registry to compare bitwise. It logs every step's state digest. The parent SIGKILLs it 10 times at random
moments (after a random number of commits, plus a random fraction of a save cycle) and restarts it each
time; it resumes from the latest complete checkpoint until 200 saves (steps 2..400) are committed.

Checked: every resume lands on the latest complete checkpoint, which verifies, and restores bitwise what the
run had at that step (the digest logged before the save); every step trained twice (before a kill and after
the resume) gives the same state; at most two save intervals of work are lost per kill; the committed steps
are every multiple of the save interval, no gap, nothing torn left behind; each run's step log is
contiguous and starts right after its resume step.
"""

from __future__ import annotations

import random
import time

import pytest
from faultlib import Job, read_jsonl, wait_for

from traincore.checkpoint import MARKER, complete_steps, step_dir, verify_checkpoint

EVERY, SAVES, KILLS, CHECK_EVERY = 2, 200, 10, 5
UNTIL = EVERY * SAVES
SEED = 20240611  # the kill schedule; printed, so a failing schedule can be replayed

CHILD = '''
"""Soak child (written by test_soak.py): train, save async every --every steps, check a fresh load now and
then, log every step's digests; resumes from the latest complete checkpoint."""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from faultlib import TinyRun

from traincore.checkpoint import Checkpointer
from traincore.config.schema import CheckpointConfig
from traincore.run.state import RNGState

parser = argparse.ArgumentParser()
parser.add_argument("--root", type=Path, required=True)
parser.add_argument("--log", type=Path, required=True)
parser.add_argument("--every", type=int, required=True)
parser.add_argument("--until", type=int, required=True)
parser.add_argument("--check-every", type=int, required=True)
args = parser.parse_args()
LOG = open(args.log, "a")


def log(event, **fields):
    LOG.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\\n")
    LOG.flush()


run = TinyRun(width=64)
checkpointer = Checkpointer(args.root, CheckpointConfig(mode="async", keep_last=10**6), run.registry)
resumed = checkpointer.load()
log("start", resumed=resumed, step=run.step, digests=run.digests())
saves = 0
while run.step < args.until:
    run.train_step()
    log("step", step=run.step, digests=run.digests())
    if run.step % args.every == 0:
        checkpointer.save(run.step)
        saves += 1
        if saves % args.check_every == 0:
            checkpointer.wait()
            expected, rng = run.digests(), RNGState().state_dict()
            fresh = TinyRun(width=64, seed=7)
            loader = Checkpointer(args.root, CheckpointConfig(mode="dcp"), fresh.registry)
            loaded = loader.load()
            loader.close()
            got = fresh.digests()  # the RNG streams are this process's: loaded ones, then put back
            RNGState().load_state_dict(rng)
            log("checked", step=run.step, loaded=loaded, ok=loaded == run.step and got == expected)
            if not (loaded == run.step and got == expected):
                sys.exit(f"a fresh load of step {run.step} gave step {loaded}, digests {got} != {expected}")
checkpointer.close()
log("done", step=run.step)
'''


@pytest.mark.slow
def test_async_checkpoints_survive_random_kills(tmp_path):
    script, root = tmp_path / "soak_child.py", tmp_path / "checkpoints"
    script.write_text(CHILD)
    schedule = random.Random(SEED)
    # kill after these numbers of committed saves (spread over the run), plus a random fraction of a cycle
    # (none near the end: a fast machine must not finish the run before its last kill lands)
    kill_at = sorted(schedule.sample(range(8, SAVES - 40), KILLS))
    runs: list[dict] = []
    start = time.perf_counter()
    while True:
        index = len(runs)
        before = complete_steps(root)
        log = tmp_path / f"run{index}.jsonl"
        args = ["--root", str(root), "--log", str(log), "--every", str(EVERY), "--until", str(UNTIL),
                "--check-every", str(CHECK_EVERY)]
        job = Job(script, args, 1, tmp_path, f"run{index}")
        record = {"log": log, "latest_before": before[-1] if before else None}
        runs.append(record)
        if index < KILLS:
            target = max(kill_at[index], len(before) + 1)  # at least one new commit in every run
            wait_for(lambda: len(complete_steps(root)) >= target or job.poll(), timeout=180,  # noqa: B023
                     what=f"run {index} to commit {target} saves")
            time.sleep(schedule.uniform(0, 0.25))
            assert not job.poll(), f"run {index} ended before its kill: {job.codes()}\n{job.output()}"
            job.kill()
            assert job.codes() == [-9]
            after = complete_steps(root)
            torn = sorted(p.name for p in root.iterdir() if not (p / MARKER).exists())
            record.update(killed_at=after[-1], torn=torn)
            for step in sorted(set(after) - set(before)):  # every new commit is whole
                verify_checkpoint(step_dir(root, step))
        else:
            assert job.wait(timeout=300) == [0], job.output()
            break
        assert time.perf_counter() - start < 300, "the soak exceeded 300 s"
    seconds = time.perf_counter() - start

    # Every resume: the latest complete step at the kill, bitwise as logged when it was saved.
    digests: dict[int, list] = {}  # step -> the digests every run that trained it logged
    previous_last = 0
    for index, record in enumerate(runs):
        records = read_jsonl(record["log"])
        start_record = records[0]
        assert start_record["event"] == "start", records[:1]
        assert start_record["resumed"] == record["latest_before"], (index, start_record, record)
        resumed = start_record["resumed"] or 0
        if resumed:
            assert start_record["digests"] in digests[resumed], (index, resumed)
            assert previous_last - resumed <= 2 * EVERY, (index, previous_last, resumed)  # work lost per kill
        steps = [r["step"] for r in records if r["event"] == "step"]
        assert steps == list(range(resumed + 1, resumed + 1 + len(steps))), index  # contiguous, no gap
        for r in records:
            if r["event"] == "step":
                digests.setdefault(r["step"], []).append(r["digests"])
        assert all(r["ok"] for r in records if r["event"] == "checked")
        previous_last = steps[-1] if steps else resumed
    assert sorted(digests) == list(range(1, UNTIL + 1))  # every step trained, none skipped
    replayed = {step: ds for step, ds in digests.items() if len(ds) > 1}
    assert all(ds.count(ds[0]) == len(ds) for ds in replayed.values())  # replays are bitwise identical
    final = complete_steps(root)
    assert final == list(range(EVERY, UNTIL + 1, EVERY))  # 200 commits, one every save interval
    assert sorted(p.name for p in root.iterdir()) == [step_dir("", s).name for s in final]  # nothing torn
    for step in final[-20:]:
        verify_checkpoint(step_dir(root, step))

    checks = sum(1 for r in runs for x in read_jsonl(r["log"]) if x["event"] == "checked")
    torn_kills = sum(1 for r in runs if r.get("torn"))
    print(f"[soak] seed={SEED}: {len(final)} committed async saves over {len(runs)} runs, {KILLS} SIGKILLs "
          f"(after {kill_at} commits; {torn_kills} left a torn save behind), {len(replayed)} steps "
          f"replayed bitwise, {checks} fresh-load checks, {seconds:.1f} s")
