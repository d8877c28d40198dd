"""The registered workflow, replayed node by node the way a Flyte cluster runs it.

Two whole-workflow replays cover the four corners between them: fast registration with one pod of two
processes (DDP), and non-fast registration with a two-pod elastic PyTorchJob of one process each that
shards the model across the pods (FSDP).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from replay_helpers import run_replay  # noqa: I001  (a module beside this file)

STEPS = "max_steps=80"  # enough for the digits preset to pass 0.8 test accuracy in a few seconds


def train_node(summary: dict) -> dict:
    (node,) = [n for n in summary["nodes"] if n["task"].startswith("tasks.train.")]
    return node


def accuracy(summary: dict) -> float:
    return summary["outputs"]["report"]["result"]["accuracy"]


def world_size(summary: dict) -> int:
    return summary["node_outputs"][train_node(summary)["node_id"]]["o0"]["summary"]["world_size"]


def pod_dirs(workdir: Path, node: dict) -> list[Path]:
    return sorted(workdir.glob(f"pods/*-{node['node_id']}-0*"))


@pytest.mark.slow
def test_fast_registration_one_pod_two_processes(fast_package, tmp_path):
    code, output, summary = run_replay(fast_package, tmp_path / "run", STEPS, "nproc_per_node=2")
    assert code == 0, output
    node = train_node(summary)
    assert node["task"].endswith("1x2") and node["pods"] == 1  # the train task for 1 node x 2 processes
    assert world_size(summary) == 1 * 2
    assert accuracy(summary) >= 0.8, output
    # Every pod fetched the code tarball into its own directory and ran from there, not from the checkout.
    (pod,) = pod_dirs(tmp_path / "run", node)
    args = json.loads((pod / "pod.json").read_text())["args"]
    assert args[0] == "pyflyte-fast-execute" and (pod / "code" / "tasks" / "train.py").is_file()
    assert "--prev-checkpoint" in args and args[args.index("--prev-checkpoint") + 1] == '""'
    assert [n["node_id"] for n in summary["nodes"]] == ["n0", "n1", "n2", "n2-0-dn0", "n3", "n4"]
    assert "replay: output report: accuracy" in output and "tasks.evaluate.evaluate_model" in output


@pytest.mark.slow
def test_non_fast_registration_two_pod_pytorch_job(non_fast_package, tmp_path):
    workdir = tmp_path / "run"
    code, output, summary = run_replay(non_fast_package, workdir, STEPS, "backend=kubernetes", "nnodes=2",
                                       "nproc_per_node=1", "parallelism=fsdp")
    assert code == 0, output
    node = train_node(summary)
    assert node["task"].endswith("2x1") and node["pods"] == 2  # a PyTorchJob of two worker pods
    assert world_size(summary) == 2 * 1  # one world across both pods, not two worlds of one
    # The model was sharded across the pods: each held half of its parameters (the telemetry record).
    (metrics,) = workdir.glob("**/run/metrics.jsonl")
    memory = next(json.loads(line) for line in metrics.read_text().splitlines() if '"memory"' in line)
    assert memory["param_bytes_per_rank"] < 0.6 * memory["param_bytes_total"], memory
    assert accuracy(summary) >= 0.8, output
    pods = pod_dirs(workdir, node)
    assert [p.name.rsplit("-", 2)[1:] for p in pods] == [["worker", "0"], ["worker", "1"]]
    # Only the pod holding global rank 0 (the one that printed rank 0's summary) kept its outputs.
    logs = {p.name: (p / "log.txt").read_text() for p in pods}
    (rank0,) = [name for name, log in logs.items() if "\ntrain: trained" in log or log.startswith("train:")]
    assert node["writer"] == rank0
    assert all("IgnoreOutputs received" in log for name, log in logs.items() if name != rank0)
    # The pods ran with exactly the manifest's args; only the rendezvous host and port were swapped.
    (manifest,) = (workdir / "jobs").glob("*.json")
    container = json.loads(manifest.read_text())["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "containers"][0]
    for pod in pods:
        started = json.loads((pod / "pod.json").read_text())
        assert started["args"] == container["args"] and started["args"][0] == "pyflyte-execute"
        env = started["env"]
        assert env["PET_NNODES"] == "2:2" and env["PET_RDZV_ENDPOINT"].startswith("127.0.0.1:")


def test_a_failing_node_fails_the_replay(non_fast_package, tmp_path):
    code, output, summary = run_replay(non_fast_package, tmp_path / "run", "preset=no-such-preset")
    assert code == 1 and not summary
    assert "node n0" in output and "no-such-preset" in output


def test_unknown_input_is_a_usage_error(non_fast_package, tmp_path):
    code, output, _ = run_replay(non_fast_package, tmp_path / "run", "no_such_input=1")
    assert code == 2 and "unknown input(s) ['no_such_input']" in output
