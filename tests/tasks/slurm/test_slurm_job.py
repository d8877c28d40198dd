"""The Slurm task's pieces that need no cluster: sbatch flags, the batch script, phases, serialisation."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

from flyteidl.admin import task_pb2
from flyteidl.core import errors_pb2
from flytekit.core import utils
from google.protobuf.json_format import MessageToDict

from tasks.slurm.connector import PHASES, SLURM_TASK_TYPE, ssh_target
from tasks.slurm.job import batch_script, main, sbatch_args
from tasks.slurm.states import Outcome
from tasks.types import SlurmSettings, Topology

ROOT = Path(__file__).resolve().parents[3]
ENTRYPOINT = ["pyflyte-execute", "--inputs", "/shared/x/inputs.pb", "--output-prefix", "/shared/x",
              "--resolver", "tasks.launch.train_task_resolver", "--", "task-key", '{"a": "b c"}']


def test_sbatch_flags_carry_nodes_gpus_and_every_launch_input():
    topology = Topology(backend="slurm", nnodes=4, nproc_per_node=8, gpus_per_node=8,
                        slurm=SlurmSettings(target="hpc", partition="gpu", account="proj42",
                                            time_limit="02:00:00", sbatch_flags="--qos=high --exclusive"))
    args = sbatch_args(topology)
    assert args[:2] == ["--nodes=4", "--ntasks-per-node=1"]
    for flag in ("--gres=gpu:8", "--partition=gpu", "--account=proj42", "--time=02:00:00", "--qos=high",
                 "--exclusive"):
        assert flag in args
    cpu = sbatch_args(Topology(backend="slurm", slurm=SlurmSettings(target="hpc")))
    assert not any(arg.startswith(("--gres", "--partition", "--account", "--time")) for arg in cpu)


def test_batch_script_runs_setup_then_one_agent_per_node_then_the_verdict():
    topology = Topology(backend="slurm", nnodes=2, nproc_per_node=3,
                        slurm=SlurmSettings(target="hpc",
                                            setup="module load cuda/12\nsource ~/venv/bin/activate"))
    script = batch_script(topology, ENTRYPOINT)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and "set -eo pipefail" in lines
    setup = lines.index("module load cuda/12")
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun"))
    assert setup < lines.index("export PET_NNODES=2") < srun
    assert lines[srun].startswith("srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 pyflyte-execute")
    assert "'{\"a\": \"b c\"}'" in lines[srun]  # the task key stays one argument
    assert lines[srun + 1] == "python -m tasks.slurm.job /shared/x"
    assert 'PET_RDZV_ENDPOINT="${head_addr:-$head_node}:$rdzv_port"' in script
    result = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


def test_every_outcome_has_a_flyte_phase():
    assert set(PHASES) == set(Outcome)


def test_verdict_fails_the_job_only_when_the_task_wrote_an_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 0
    document = errors_pb2.ErrorDocument(error=errors_pb2.ContainerError(message="ValueError: bad batch"))
    utils.write_proto_to_file(document, str(tmp_path / "error.pb"))
    assert main([str(tmp_path)]) == 1
    assert "the task failed: ValueError: bad batch" in capsys.readouterr().err


def test_slurm_task_serialises_with_pyflyte_package_and_carries_no_secret(tmp_path):
    module = tmp_path / "slurm_example.py"
    module.write_text(
        "from tasks.launch import train_task_for\n"
        "from tasks.types import SlurmSettings, Topology\n"
        "from traincore.config import Config\n"
        "slurm_train = train_task_for(Topology(\n"
        "    backend='slurm', nnodes=2, nproc_per_node=1,\n"
        "    slurm=SlurmSettings(target='hpc-login', partition='batch', setup='module load python')),\n"
        "    Config())\n")
    out = tmp_path / "pkg.tgz"
    subprocess.run([str(Path(sys.executable).parent / "pyflyte"), "--pkgs", "slurm_example", "package",
                    "--image", "example:1", "-o", str(out)], cwd=tmp_path, check=True, capture_output=True)
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
    secrets = ("PRIVATE KEY", "id_ed25519", "id_rsa", "IdentityFile", "password")
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
