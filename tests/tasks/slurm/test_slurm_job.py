"""The Slurm task's pieces that need no cluster: sbatch flags, the batch script, phases, serialisation."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tarfile
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import pytest
from flyteidl.admin import task_pb2
from flyteidl.core import errors_pb2
from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.core import utils
from flytekit.tools.translator import get_serializable
from google.protobuf import timestamp_pb2
from google.protobuf.json_format import MessageToDict
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tasks.failures import first_failure
from tasks.plan import LaunchInputError, check_time_limit
from tasks.slurm.client import NodeSize
from tasks.slurm.connector import (
    PHASES,
    SLURM_TASK_TYPE,
    check_node_size,
    forwarded_env,
    ssh_target,
)
from tasks.slurm.job import (
    SETUP_ERROR,
    SIGNAL_MARGIN_S,
    NodeRequest,
    TaskFailure,
    batch_script,
    job_outcome,
    main,
    node_request,
    sbatch_args,
    task_failures,
    time_limit_s,
)
from tasks.slurm.report import headline
from tasks.slurm.states import JobInfo, Outcome, classify_states
from tasks.storage import resume_note
from tasks.train import CPU_PER_PROCESS, MEM_GIB_PER_PROCESS
from tasks.types import SlurmSettings, Topology
from traincore.checkpoint import MARKER
from traincore.exitcodes import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[3]
ENTRYPOINT = ["pyflyte-execute", "--inputs", "/shared/x/inputs.pb", "--output-prefix", "/shared/x",
              "--resolver", "tasks.launch.train_task_resolver", "--", "task-key", '{"a": "b c"}']


def test_sbatch_flags_carry_nodes_gpus_and_every_launch_input():
    topology = Topology(backend="slurm", nnodes=4, nproc_per_node=8, gpus_per_node=8,
                        slurm=SlurmSettings(target="hpc", partition="gpu", account="proj42",
                                            time_limit="02:00:00", sbatch_flags="--qos=high --exclusive"))
    args = sbatch_args(topology, grace_s=20.5, request=NodeRequest(cpus=16, mem_mib=49152, gpus=8))
    assert args[:2] == ["--nodes=4", "--ntasks-per-node=1"]
    # the warning signal reaches the steps (no "B:") the grace, rounded up, plus a margin before the limit
    assert f"--signal=TERM@{21 + SIGNAL_MARGIN_S}" in args and "--open-mode=append" in args
    for flag in ("--cpus-per-task=16", "--mem=49152M", "--gres=gpu:8", "--partition=gpu", "--account=proj42",
                 "--time=02:00:00", "--qos=high",
                 "--exclusive"):
        assert flag in args
    cpu = sbatch_args(Topology(backend="slurm", slurm=SlurmSettings(target="hpc")), grace_s=20.0,
                      request=NodeRequest(cpus=4, mem_mib=12288))
    assert not any(arg.startswith(("--gres", "--partition", "--account", "--time")) for arg in cpu)


def test_each_node_asks_for_the_train_tasks_requests_unless_the_users_flags_do():
    """The train task's requests are per node already (nproc_per_node x 2 CPUs and 6 GiB); quantities
    come as Kubernetes writes them. A user's own sbatch flag of the same kind replaces ours, never joins
    it (sbatch refuses --mem with --mem-per-cpu)."""
    request = node_request({"cpu": "4", "memory": "12Gi", "gpu": "2"})
    assert request == NodeRequest(cpus=4, mem_mib=12288, gpus=2)
    assert node_request({"cpu": "1500m", "memory": "1.5G"}) == NodeRequest(cpus=2, mem_mib=1431)
    with pytest.raises(ValueError, match="not a resource quantity: '12 parsecs'"):
        node_request({"memory": "12 parsecs"})
    topology = Topology(backend="slurm", nproc_per_node=2, gpus_per_node=2, slurm=SlurmSettings(
        target="hpc", sbatch_flags="--mem-per-cpu=3G -c 6 --qos=high"))
    args = sbatch_args(topology, grace_s=20.0, request=request)
    assert "--gres=gpu:2" in args and args[-4:] == ["--mem-per-cpu=3G", "-c", "6", "--qos=high"]
    assert not any(arg.startswith(("--mem=", "--cpus-per-task")) for arg in args), args
    assert request.without("--gpus-per-node=2 --exclusive").flags() == ["--cpus-per-task=4", "--mem=12288M"]


def test_the_slurm_task_asks_each_node_for_its_processes_cpus_and_memory():
    from tasks.launch import train_task_for
    from tasks.slurm.connector import template_request
    from traincore.config.presets import preset

    task = train_task_for(Topology(backend="slurm", nproc_per_node=3, slurm=SlurmSettings(target="hpc")),
                          preset("debug"))
    settings = SerializationSettings(ImageConfig.auto_default_image())
    template = get_serializable(OrderedDict(), settings, task).template
    assert template_request(template) == NodeRequest(cpus=3 * CPU_PER_PROCESS,
                                                     mem_mib=3 * MEM_GIB_PER_PROCESS * 1024)


def test_a_request_no_node_can_hold_names_the_largest_node_and_the_fix():
    topology = Topology(backend="slurm", nproc_per_node=8, slurm=SlurmSettings(target="hpc",
                                                                                partition="debug"))
    nodes = [NodeSize("big", 16, 64000), NodeSize("fat", 8, 128000), NodeSize("small", 4, 16000)]
    check_node_size(nodes, topology, NodeRequest(cpus=16, mem_mib=49152))  # "big" holds it
    with pytest.raises(LaunchInputError) as refused:
        check_node_size(nodes, topology, NodeRequest(cpus=16, mem_mib=98304))
    message = str(refused.value)
    assert message.startswith("input nproc_per_node=8: each node's task asks for 16 CPUs and 98304 MB")
    assert ("no node of partition 'debug' on hpc has that: the largest, big, has 16 CPUs and 64000 MB"
            in message)
    assert "'--cpus-per-task=16 --mem=64000M'" in message
    check_node_size(nodes, topology, NodeRequest(mem_mib=0))  # the user's own flags decide: nothing to check


def test_a_time_limit_within_the_warning_signals_lead_or_of_no_slurm_form_is_refused_in_the_plan():
    assert [time_limit_s(text) for text in ("30", "2:30", "01:00:05", "1-2", "1-0:30", "0-0:0:40")] == [
        1800, 150, 3605, 93600, 88200, 40]
    assert time_limit_s("") is None and time_limit_s("UNLIMITED") is None
    topology = Topology(backend="slurm", slurm=SlurmSettings(target="hpc", time_limit="0:30"))
    with pytest.raises(LaunchInputError) as refused:  # the signal would come 35 s before the end
        check_time_limit(topology, grace_s=20)
    assert str(refused.value) == (
        f"input slurm_time_limit='0:30' (30 s) is not longer than the warning signal's lead of "
        f"{20 + SIGNAL_MARGIN_S} s (checkpoint.preemption_grace_s=20, rounded up, plus {SIGNAL_MARGIN_S} s "
        "for the agents' shutdown): Slurm would signal the job to save and stop as soon as it starts. Raise "
        "slurm_time_limit, or lower checkpoint.preemption_grace_s")
    check_time_limit(topology, grace_s=10)  # 25 s of lead: the job trains for 5 s, then saves
    check_time_limit(replace(topology, slurm=SlurmSettings(target="hpc")), grace_s=20)  # no limit of ours
    check_time_limit(replace(topology, slurm=SlurmSettings(target="hpc", time_limit="UNLIMITED")), grace_s=20)
    # Once accepted by the plan and refused by sbatch after staging, in a connector's panel:
    with pytest.raises(LaunchInputError, match=r"input slurm_time_limit='forever' is not a Slurm time limit: "
                                               r"write minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S"):
        check_time_limit(replace(topology, slurm=SlurmSettings(target="hpc", time_limit="forever")),
                         grace_s=20)


def test_a_refused_request_names_only_what_was_asked_and_checked():
    """CPUs or memory that slurm_sbatch_flags size are not asked (0): the refusal names the rest alone."""
    topology = Topology(backend="slurm", nproc_per_node=8, slurm=SlurmSettings(target="hpc"))
    nodes = [NodeSize("big", 16, 64000), NodeSize("fat", 8, 128000)]
    with pytest.raises(LaunchInputError) as memory_only:
        check_node_size(nodes, topology, NodeRequest(mem_mib=200000))
    message = str(memory_only.value)
    assert message.startswith("input nproc_per_node=8: each node's task asks for 200000 MB of memory (8 ")
    assert "the largest, fat, has 128000 MB. " in message and message.endswith("e.g. '--mem=128000M'")
    assert "CPU" not in message
    with pytest.raises(LaunchInputError) as cpus_only:
        check_node_size(nodes, topology, NodeRequest(cpus=32))
    message = str(cpus_only.value)
    assert message.startswith("input nproc_per_node=8: each node's task asks for 32 CPUs (8 ")
    assert "the largest, big, has 16 CPUs. " in message and message.endswith("e.g. '--cpus-per-task=16'")
    assert "MB" not in message and "memory" not in message


def test_batch_script_runs_setup_then_one_agent_per_node_with_its_verdict():
    topology = Topology(backend="slurm", nnodes=2, nproc_per_node=3,
                        slurm=SlurmSettings(target="hpc",
                                            setup="module load cuda/12\nsource ~/venv/bin/activate"))
    script = batch_script(topology, ENTRYPOINT)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and "set -eo pipefail" in lines
    setup = lines.index("module load cuda/12")
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun"))
    assert setup < lines.index("export PET_NNODES=2") < srun
    # srun passes the job's CPUs per task on (Slurm 22.05+ does not by itself)
    assert lines[srun] == ("srun --nodes=2 --ntasks-per-node=1 "
                           "${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} \\")
    assert lines[srun + 1] == "    --kill-on-bad-exit=1 --error=slurm-%j-%N.err --open-mode=append \\"
    assert lines[srun + 2].startswith("    bash -c 'node_task \"$@\"' node pyflyte-execute")
    assert lines[srun + 2].endswith(" || status=$?")
    assert "'{\"a\": \"b c\"}'" in lines[srun + 2]  # the task key stays one argument
    assert ('    python -m tasks.slurm.job --node "$SLURMD_NODENAME" --status "$status" '
            '--signal "$signalled" /shared/x') in lines
    assert lines[-1] == 'python -m tasks.slurm.job --job --status "$status" /shared/x'  # the job's verdict
    assert "export FLYTE_INTERNAL_DIST_ERROR_STRATEGY=Earliest" in lines
    assert 'PET_RDZV_ENDPOINT="${head_addr:-$head_node}:$rdzv_port"' in script
    result = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


def test_a_setup_that_leaves_the_project_out_stops_the_job_at_once_and_says_how_to_fix_it(tmp_path):
    """The script's first lines, up to its check, run as a job would run them with a slurm_setup that
    activates nothing: exit 127 and one message, before any srun."""
    topology = Topology(backend="slurm", slurm=SlurmSettings(target="hpc", setup="true"))
    script = batch_script(topology, ENTRYPOINT)
    head = script[:script.index("head_node=")]
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no venv, no project
    result = subprocess.run(["bash", "-c", head], env=bare, text=True, capture_output=True, cwd=tmp_path)
    assert result.returncode == 127, result.stderr
    assert result.stderr.startswith(f"{SETUP_ERROR}: pyflyte-execute: not found,")
    assert "Fix slurm_setup, e.g. 'source <venv with flyte-torch-pipeline>/bin/activate'" in result.stderr
    venv = {**bare, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    assert subprocess.run(["bash", "-c", head], env=venv, cwd=tmp_path).returncode == 0


def test_every_outcome_has_a_flyte_phase():
    assert set(PHASES) == set(Outcome)


def killed(rank: int) -> str:
    """A failed node's message as the train task writes it: its first line, then torch elastic's report."""
    failure = ProcessFailure(local_rank=0, pid=31879, exitcode=-signal.SIGKILL, error_file="<N/A>")
    error = ChildFailedError("train", {rank: failure})
    return f"{first_failure(error, None)}\n{error}"


def write_error(prefix: Path, node: str, message: str, seconds: int, recoverable: bool = True) -> None:
    kind = errors_pb2.ContainerError.RECOVERABLE if recoverable else errors_pb2.ContainerError.NON_RECOVERABLE
    error = errors_pb2.ContainerError(message=message, kind=kind, worker=node,
                                      timestamp=timestamp_pb2.Timestamp(seconds=seconds))
    utils.write_proto_to_file(errors_pb2.ErrorDocument(error=error), str(prefix / f"error-{node}.pb"))


def test_the_worker_a_signal_killed_is_the_first_failure_though_its_peer_reported_earlier(tmp_path):
    write_error(tmp_path, "slb-node1", "DistBackendError: Connection closed by peer", seconds=100)
    write_error(tmp_path, "slb-node2", f"worker lost: {killed(1)}", seconds=101)
    first, second = task_failures(str(tmp_path))
    assert (first.node, first.worker_signal, first.summary()) == (
        "slb-node2", (1, "SIGKILL"), "node slb-node2: rank 1 was killed by SIGKILL")
    assert (second.node, second.worker_signal) == ("slb-node1", None)
    assert second.summary() == "node slb-node1 failed"


def test_a_node_fails_its_task_with_75_when_recoverable_and_1_when_not(tmp_path, capsys):
    assert main(["--node", "slb-node1", str(tmp_path)]) == 0
    assert main(["--node", "slb-node1", "--status", "3", str(tmp_path)]) == 3  # no document: its own code
    write_error(tmp_path, "slb-node1", "ValueError: bad batch", seconds=5, recoverable=False)
    write_error(tmp_path, "slb-node2", "preempted at step 7 by SIGTERM", seconds=5)
    assert main(["--node", "slb-node1", str(tmp_path)]) == 1
    assert "the task failed (node slb-node1 failed): ValueError: bad batch" in capsys.readouterr().err
    assert main(["--node", "slb-node2", str(tmp_path)]) == PREEMPTED_EXIT_CODE
    assert main(["--clear", str(tmp_path)]) == 0 and not list(tmp_path.iterdir())


def test_a_signal_while_the_task_starts_is_recoverable_and_says_so(tmp_path, capsys):
    """A time limit's warning that comes before the workers run (Slurm may send it a minute early) kills
    pyflyte-execute before it can write an error document: the node's shell saw the signal, so the node
    writes one, recoverable, and the job's verdict is 75, not the 143 srun reports."""
    assert main(["--node", "slb-node1", "--status", "143", "--signal", "SIGTERM", str(tmp_path)]) == 75
    assert "the task was stopped by SIGTERM while the task started" in capsys.readouterr().err
    [failure] = task_failures(str(tmp_path))
    assert (failure.node, failure.recoverable, failure.preempted_by) == ("slb-node1", True, "SIGTERM")
    assert main(["--job", "--status", "143", str(tmp_path)]) == PREEMPTED_EXIT_CODE
    assert main(["--node", "slb-node2", "--status", "0", "--signal", "SIGTERM", str(tmp_path)]) == 0


def test_the_jobs_verdict_is_its_first_failures_not_sruns_largest_exit_code(tmp_path):
    assert main(["--job", "--status", "0", str(tmp_path)]) == 0
    assert main(["--job", "--status", "9", str(tmp_path)]) == 9  # srun's own failure: no node reported
    write_error(tmp_path, "slb-node2", "preempted at step 7 by SIGTERM: checkpoint step-7 saved", seconds=5)
    assert main(["--job", "--status", "143", str(tmp_path)]) == PREEMPTED_EXIT_CODE
    write_error(tmp_path, "slb-node1", "ValueError: bad batch", seconds=4, recoverable=False)
    assert main(["--job", "--status", "143", str(tmp_path)]) == 1  # the earlier failure is the cause


def job(state: str, exit_code: int = 0, **extra) -> JobInfo:
    outcome = classify_states([state])[2]
    return JobInfo(job_id="12", state=state, outcome=outcome, exit_code=exit_code, **extra)


@pytest.mark.parametrize("info, failures, expected", [
    (job("TIMEOUT"), [], Outcome.RETRYABLE),
    (job("PREEMPTED"), [], Outcome.RETRYABLE),
    (job("NODE_FAIL"), [], Outcome.RETRYABLE),
    (job("FAILED", PREEMPTED_EXIT_CODE), [], Outcome.RETRYABLE),  # a worker that was preempted
    (job("FAILED", 1), [TaskFailure("n1", 0.0, True, "preempted at step 4 by SIGTERM")], Outcome.RETRYABLE),
    (job("FAILED", 1), [TaskFailure("n1", 0.0, False, "ValueError: x")], Outcome.FAILED),
    (job("FAILED", 1), [], Outcome.FAILED),
    (job("CANCELLED"), [], Outcome.ABORTED),
    (job("COMPLETED"), [], Outcome.SUCCEEDED),
])
def test_outcome_comes_from_the_state_and_the_nodes_markers_not_from_text(info, failures, expected):
    assert job_outcome(info, failures) is expected


def test_headline_gives_an_exit_code_only_where_it_means_something():
    assert headline(job("CANCELLED", signal=15), "hpc") == "Slurm job 12 CANCELLED on hpc"
    assert headline(job("TIMEOUT", reason="TimeLimit"), "hpc") == "Slurm job 12 TIMEOUT (TimeLimit) on hpc"
    assert headline(job("FAILED", 3), "hpc") == "Slurm job 12 FAILED, exit code 3 on hpc"
    assert headline(job("FAILED", 0, signal=9), "hpc") == "Slurm job 12 FAILED, killed by SIGKILL on hpc"
    assert headline(job("FAILED", PREEMPTED_EXIT_CODE), "hpc", preempted_by="SIGTERM") == (
        "Slurm job 12 signalled (SIGTERM: its time limit was near, or it was preempted) on hpc")
    assert headline(job("TIMEOUT"), "hpc", preempted_by="SIGTERM") == "Slurm job 12 TIMEOUT on hpc"


def test_a_retryable_failure_names_the_step_a_retry_resumes_from(tmp_path):
    root = tmp_path / "ckpt"
    assert "no complete checkpoint in" in resume_note(str(root))
    for step in (10, 20):
        (root / f"step-{step:06d}").mkdir(parents=True)
    (root / "step-000010" / MARKER).write_text("{}")
    assert resume_note(str(root)) == f"latest complete checkpoint: step 10 in {root}; a retry resumes from it"
    assert "latest complete checkpoint in the checkpoint root" in resume_note("")
    # An object-store root is read where it is (fsspec's in-memory filesystem stands in for one here).
    import fsspec

    fsspec.filesystem("memory").pipe_file("/slurm-note/run/step-000030/commit.json", b"{}")
    assert resume_note("memory://slurm-note/run").startswith("latest complete checkpoint: step 30 in memory://")


def test_slurm_task_serialises_with_pyflyte_package_and_carries_no_secret(tmp_path):
    module = tmp_path / "slurm_example.py"
    module.write_text(
        "from tasks.launch import train_task_for\n"
        "from tasks.types import SlurmSettings, Topology\n"
        "from traincore.config.schema import Config\n"
        "slurm_train = train_task_for(Topology(\n"
        "    backend='slurm', nnodes=2, nproc_per_node=1,\n"
        "    slurm=SlurmSettings(target='hpc-login', partition='batch', setup='module load python')),\n"
        "    Config())\n")
    out = tmp_path / "pkg.tgz"
    secret = "not-a-real-secret-0123456789"  # in the packaging process's environment, never in the spec
    subprocess.run([str(Path(sys.executable).parent / "pyflyte"), "--pkgs", "slurm_example", "package",
                    "--image", "example:1", "-o", str(out)], cwd=tmp_path, check=True, capture_output=True,
                   env={**os.environ, "FLYTE_AWS_SECRET_ACCESS_KEY": secret, "AWS_SECRET_ACCESS_KEY": secret})
    with tarfile.open(out) as archive:
        (member,) = [m for m in archive.getmembers() if "train-slurm-2x1" in m.name]
        spec = task_pb2.TaskSpec.FromString(archive.extractfile(member).read())
    template = spec.template
    assert template.type == SLURM_TASK_TYPE
    custom = MessageToDict(template.custom)
    assert custom["topology"]["nnodes"] == 2 and custom["topology"]["slurm"] == {
        "target": "hpc-login", "partition": "batch", "account": "", "time_limit": "", "sbatch_flags": "",
        "setup": "module load python"}
    text = str(spec)
    secrets = ("PRIVATE KEY", "id_ed25519", "id_rsa", "IdentityFile", "password", secret)
    assert not any(word in text for word in secrets)


def test_connector_service_offers_the_slurm_task_type(tmp_path):
    serve = subprocess.run([str(Path(sys.executable).parent / "pyflyte"), "serve", "connector", "--port", "0",
                            "--modules", "tasks.slurm.connector", "--timeout", "3"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert serve.returncode == 0, serve.stderr[-2000:]
    assert re.search(r"Slurm train connector\s*│\s*slurm_train \(1\)", serve.stdout), serve.stdout


def test_a_mounted_flyte_secret_is_the_only_key_offered(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYTE_SECRETS_DEFAULT_DIR", str(tmp_path))
    assert ssh_target("hpc-login").key_file is None  # no secret: ~/.ssh/config and the agent decide
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "ssh_key").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    assert ssh_target("hpc-login").key_file == str(tmp_path / "slurm" / "ssh_key")


def test_a_connector_pod_without_its_secret_fails_the_task_naming_the_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYTE_SECRETS_DEFAULT_DIR", str(tmp_path))
    monkeypatch.setenv("SLURM_CONNECTOR_SECRET", "slurm")  # as deploy/connector.yaml sets it
    with pytest.raises(LaunchInputError, match=r"the Slurm connector has no SSH key at .*/slurm/ssh_key: the "
                       r"Secret 'slurm' in its namespace is missing.*deploy/create-secrets.sh"):
        ssh_target("hpc-login")
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "ssh_key").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    assert ssh_target("hpc-login").key_file == str(tmp_path / "slurm" / "ssh_key")


def test_only_object_store_settings_are_forwarded_to_the_job():
    environ = {"AWS_SECRET_ACCESS_KEY": "k", "FLYTE_AWS_ENDPOINT": "http://s3", "HOME": "/root",
               "WANDB_API_KEY": "w", "MY_AWS_THING": "x"}
    assert forwarded_env(environ) == {"AWS_SECRET_ACCESS_KEY": "k", "FLYTE_AWS_ENDPOINT": "http://s3"}
