"""Node ranges and membership changes: the range's checks, the global batch kept across world sizes, the
sample digest, and a real elastic run (torchrun agents on loopback) that loses a node and gets one back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ports import closed_port
from trainruns import TINY, final_weights, kill_tree

from traincore.config import Config, ConfigError, LoaderConfig
from traincore.data import StagedLoader, StagedSplit, sample_digest
from traincore.run import check_node_range, elastic_config, node_range
from traincore.run.membership import Membership
from traincore.run.steps import accumulation

ELASTIC = {**TINY, "train": {"global_batch": 16}, "telemetry": {"log_every": 1},
           "checkpoint": {"every": 10}}
STEPS = 80
# A re-formed world waits 2 s for more nodes instead of c10d's 30 s. The heartbeats keep their defaults:
# shorter ones let a stalled agent count as lost, and a returning node then formed a world of its own.
RDZV_CONF = "last_call_timeout=2"


@pytest.mark.parametrize(("text", "nodes"), [("2", (2, 2)), ("1:2", (1, 2)), (" 2:4 ", (2, 4)), (3, (3, 3))])
def test_nnodes_is_a_count_or_a_range(text, nodes):
    assert node_range(text) == nodes


@pytest.mark.parametrize("text", ["0:2", "3:2", "a:b", "1:2:3", "", "0", "-1"])
def test_a_bad_node_range_names_the_form(text):
    with pytest.raises(ValueError, match=r"give a node count N \(e.g. 2\) or a range MIN:MAX"):
        node_range(text)


def test_a_range_fixes_the_global_batch_of_the_largest_world():
    cfg = Config().with_overrides({"loader.batch_size": 8, "train.grad_accum_steps": 2})
    elastic = elastic_config(cfg, (1, 2), nproc_per_node=2)
    assert (elastic.train.global_batch, elastic.train.grad_accum_steps) == (8 * 2 * 2 * 2, 1)
    assert [accumulation(elastic, 2 * nodes) for nodes in (1, 2)] == [4, 2]
    assert elastic_config(cfg, (2, 2), nproc_per_node=2) is cfg  # a fixed count changes nothing


def test_a_range_whose_node_counts_cannot_split_the_global_batch_is_refused():
    cfg = Config().with_overrides({"loader.batch_size": 8})
    with pytest.raises(ConfigError, match=r"train.global_batch=24 cannot be split into whole batches of "
                       r"loader.batch_size=8 on 2 node\(s\).*nnodes=2:3.*a multiple of 48"):
        elastic_config(cfg, (2, 3), nproc_per_node=1)
    with pytest.raises(ConfigError, match="train.global_batch=20 is not a whole number of batches"):
        accumulation(cfg.with_overrides({"train.global_batch": 20}), 1)
    check_node_range(cfg.with_overrides({"train.global_batch": 48}), (2, 3), nproc_per_node=1)


def test_a_global_batch_needs_whole_steps_at_the_end_of_an_epoch_and_no_accumulation_of_its_own():
    with pytest.raises(ConfigError, match="loader.drop_last=false is invalid"):
        Config().with_overrides({"train.global_batch": 64, "loader.drop_last": False})
    with pytest.raises(ConfigError, match="train.grad_accum_steps.*must be 1 with train.global_batch set"):
        Config().with_overrides({"train.global_batch": 64, "train.grad_accum_steps": 2})


def test_the_digest_adds_up_over_any_split_and_changes_when_a_sample_is_lost_or_doubled():
    samples = np.random.default_rng(0).permutation(1000)
    whole = sample_digest(samples)
    assert (sum(sample_digest(part) for part in np.array_split(samples, 7)) - whole) % 2**62 == 0
    assert sample_digest(samples[:-1]) != whole
    assert sample_digest(np.concatenate([samples[:-1], samples[:1]])) != whole


def test_each_step_takes_the_same_samples_at_every_world_size(data_dir: Path):
    """16 samples a step: 2 ranks of 8, or 1 rank accumulating 2 batches of 8. Over two epochs (an epoch
    ends at its last whole step on both), each step's samples are the same set."""
    split = StagedSplit(data_dir, "train")
    cfg = LoaderConfig(batch_size=8)

    def steps(world: int) -> list[set[int]]:
        accum = 16 // (8 * world)
        loaders = [StagedLoader(split, cfg, rank=rank, world_size=world, seed=3, accum=accum)
                   for rank in range(world)]
        taken = []
        for _ in range(2):
            blocks = [list(loader.index_batches()) for loader in loaders]
            assert len(blocks[0]) == loaders[0].steps_per_epoch
            for loader in loaders:
                loader.epoch += 1
            batches = [np.concatenate(per_batch) for per_batch in zip(*blocks, strict=True)]
            taken += [set(np.concatenate(batches[i:i + accum]).tolist())
                      for i in range(0, len(batches), accum)]
        return taken

    assert steps(1) == steps(2)
    assert len(steps(1)) == 2 * (len(split) // 16)


def test_a_resume_at_another_world_size_is_one_change_with_its_line(capsys):
    saved = Membership(world_size=2, global_batch=64)
    resumed = Membership(world_size=1, global_batch=64)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.changed and resumed.changes == 1
    record = resumed.record(40, last=(47, 100.0), first_step_time=118.5)
    assert record == {"old_world_size": 2, "new_world_size": 1, "resumed_from": 40, "steps_redone": 7,
                      "seconds_lost": 18.5, "global_batch": 64, "changes": 1}
    assert capsys.readouterr().out.startswith("membership: world size 2 -> 1, resumed from step 40")
    same = Membership(world_size=2, global_batch=64)
    same.load_state_dict(saved.state_dict())
    assert not same.changed and same.changes == 0


def _agent(data: Path, output: Path, port: int, log: Path) -> subprocess.Popen:
    """One torchrun agent of a 1:2 node range on loopback, as docs/elastic.md starts one."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
               "--max-restarts", "3", "--rdzv-conf", RDZV_CONF, "-m", "traincore.train",
               "--data", str(data), "--output", str(output), "--preset", "debug", "--max-steps", str(STEPS),
               "--config", json.dumps(ELASTIC)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _rows(output: Path, kind: str = "train") -> list[dict]:
    try:
        lines = (output / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [row for row in map(json.loads, filter(None, lines)) if row["kind"] == kind]


def _wait(output: Path, reached, what: str, agents: list[subprocess.Popen], limit_s: float = 90) -> None:
    deadline = time.monotonic() + limit_s
    while not reached(_rows(output)):
        if time.monotonic() > deadline or any(agent.poll() for agent in agents):
            for agent in agents:
                kill_tree(agent.pid)
            pytest.fail(f"no {what} within {limit_s} s; agents' logs beside {output}")
        time.sleep(0.1)


def _worker(agent: subprocess.Popen) -> int:
    """The pid of an agent's one worker (its child)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == agent.pid:
                return int(stat.parent.name)
        except (OSError, IndexError):
            continue
    raise AssertionError(f"agent {agent.pid} has no worker")


def _sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits for the stopped process ``pid`` (its pending-signal masks in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    masks = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & 1 << (signal.SIGTERM - 1) for mask in masks)


def test_a_node_lost_and_one_returned_train_the_samples_of_an_undisturbed_run(data_dir, tmp_path,
                                                                              forked_train):
    """Two agents (nnodes 1:2); one is SIGKILLed with its worker (a lost node): the other trains on alone
    from the last checkpoint; a new agent arrives: the run grows back to 2 at a checkpoint boundary and
    finishes. Every step has the configured global batch and exactly the samples of an undisturbed 2-rank
    run (the per-step digests agree); weights and accuracy are those of that run, within float tolerance."""
    output, port = tmp_path / "elastic", closed_port()
    first = _agent(data_dir, output, port, tmp_path / "first.log")
    time.sleep(1.0)  # the first agent hosts the rendezvous store
    lost = _agent(data_dir, output, port, tmp_path / "lost.log")
    _wait(output, lambda rows: any(r["world_size"] == 2 and r["step"] >= 25 for r in rows),
          "step 25 at 2 ranks", [first, lost])
    kill_tree(lost.pid)
    _wait(output, lambda rows: any(r["world_size"] == 1 and r["step"] >= 35 for r in rows), "step 35 alone",
          [first])
    # One rank trains this model faster than a new agent starts: it waits, stopped, for the agent's SIGTERM
    # (the new node is seen), so that the run grows before its end.
    survivor = _worker(first)
    os.kill(survivor, signal.SIGSTOP)
    returned = _agent(data_dir, output, port, tmp_path / "returned.log")
    deadline = time.monotonic() + 60
    while not _sigterm_pending(survivor) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(survivor, signal.SIGCONT)
    ended = first.wait(timeout=90), returned.wait(timeout=60)
    assert ended == (0, 0), (tmp_path / "first.log").read_text()[-3000:]

    reference = tmp_path / "reference"
    forked_train(data_dir, reference, 2, "--max-steps", str(STEPS), config=ELASTIC)
    rows, undisturbed = _rows(output), _rows(reference)
    changes = _rows(output, "membership")
    assert [(c["old_world_size"], c["new_world_size"]) for c in changes] == [(2, 1), (1, 2)]
    shrink, grow = changes
    assert shrink["resumed_from"] % 10 == 0 and shrink["steps_redone"] >= 0
    assert 0 < shrink["seconds_lost"] < 60
    assert grow["steps_redone"] == 0  # the agent stopped the workers, which saved the step they reached
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert {r["global_batch"] for r in rows} == {16} and {r["world_size"] for r in rows} == {1, 2}
    assert [r["sample_digest"] for r in rows] == [r["sample_digest"] for r in undisturbed]
    logs = "".join((tmp_path / name).read_text() for name in ("first.log", "returned.log"))
    assert [logs.count(f"membership: world size {change},") for change in ("2 -> 1", "1 -> 2")] == [1, 1]
    # Not bitwise in general: a rank that accumulates two batches adds their gradients in another order
    # than an all-reduce of two ranks does, so rounding may differ from the first change on (1e-4 allows
    # for it; this model's parameters have come out equal). BatchNorm's running statistics follow rank 0's
    # batches, which are all of the step's on one rank (measured: up to 3e-3 apart), and its batch count
    # counts the batches accumulated.
    ours, theirs = final_weights(output), final_weights(reference)
    assert ours.keys() == theirs.keys()
    stats = [name for name in ours if name.rsplit(".", 1)[1] in ("running_mean", "running_var")]
    params = [name for name in ours if ours[name].is_floating_point() and name not in stats]
    counts = set(ours) - set(stats) - set(params)
    assert {name.rsplit(".", 1)[1] for name in counts} == {"num_batches_tracked"}
    assert max((ours[name] - theirs[name]).abs().max().item() for name in params) < 1e-4
    assert max((ours[name] - theirs[name]).abs().max().item() for name in stats) < 2e-2
    accuracy = [_rows(run, "eval")[-1]["accuracy"] for run in (output, reference)]
    assert abs(accuracy[0] - accuracy[1]) <= 0.005
