"""The train task's contract without launching workers: error classes, validation order, the resolver."""

from __future__ import annotations

import importlib
import json
import os
import signal
from dataclasses import replace

import click
import flytekit
import pytest
from flytekit import FlyteContextManager
from flytekit.core.context_manager import ExecutionState
from flytekit.exceptions.user import FlyteRecoverableException, FlyteUserRuntimeException
from flytekit.extend import IgnoreOutputs
from flytekit.tools.module_loader import load_object_from_module
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask
from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

import tasks.train as train_module
from tasks.failures import vanished_workers
from tasks.launch import train_task, train_task_for
from tasks.slurm.connector import SLURM_TASK_TYPE
from tasks.train import ElasticTrainTask
from tasks.types import SlurmSettings, StagedDataset, Topology
from traincore.config.presets import preset
from traincore.config.schema import ConfigError
from traincore.data.manifest import Manifest


@pytest.fixture
def dataset(synthetic_dir) -> StagedDataset:
    return StagedDataset.from_manifest(synthetic_dir, Manifest.load(synthetic_dir))


def failing_trainer(error: Exception) -> type:
    """A stand-in for traincore's Trainer whose run fails with ``error``."""

    class Failing:
        def __init__(self, *args, **kwargs):
            pass

        def train(self):
            raise error

    return Failing


def test_worker_turns_lost_peers_into_recoverable_errors(monkeypatch, dataset, tmp_path):
    monkeypatch.setattr(train_module, "Trainer",
                        failing_trainer(DistNetworkError("Connection reset by peer")))
    with pytest.raises(FlyteRecoverableException, match="transiently"):
        train_module.train_model(preset("debug"), dataset, str(tmp_path))


def test_worker_lets_user_errors_through(monkeypatch, dataset, tmp_path):
    monkeypatch.setattr(train_module, "Trainer",
                        failing_trainer(ConfigError("loader.batch_size=0 is invalid")))
    with pytest.raises(ConfigError):
        train_module.train_model(preset("debug"), dataset, str(tmp_path))


def test_rendezvous_timeout_is_recoverable(monkeypatch, dataset, tmp_path):
    def no_quorum(self, **kwargs):
        raise RendezvousTimeoutError("the rendezvous timed out")

    monkeypatch.setattr(PytorchElasticFunctionTask, "execute", no_quorum)
    with pytest.raises(FlyteRecoverableException, match="rendezvous failed"):
        train_task.execute(config=preset("debug"), dataset=dataset, checkpoint_root=str(tmp_path))


def test_bad_config_fails_before_any_worker_starts(monkeypatch, dataset, tmp_path):
    def launched(self, **kwargs):
        raise AssertionError("workers were launched")

    monkeypatch.setattr(PytorchElasticFunctionTask, "execute", launched)
    too_big = preset("debug").with_overrides({"loader.batch_size": 500})
    with pytest.raises(ValueError, match="loader.batch_size=500 exceeds the 80 training samples") as caught:
        train_task.execute(config=too_big, dataset=dataset, checkpoint_root=str(tmp_path))
    # pyflyte run shows it as its message alone, not after a 60-line traceback (tasks/errors.py)
    assert isinstance(caught.value, click.ClickException), type(caught.value)


def test_a_shutdown_timeout_the_plugins_launcher_cannot_read_fails_before_any_worker_starts(
        monkeypatch, dataset, tmp_path):
    """The plugin's LaunchConfig reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT with int(): a bare ValueError
    traceback once the workers were due."""
    def launched(self, **kwargs):
        raise AssertionError("workers were launched")

    monkeypatch.setattr(PytorchElasticFunctionTask, "execute", launched)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "1m")
    with pytest.raises(click.ClickException, match="TIMEOUT='1m' is not a whole number of seconds"):
        train_task.execute(config=preset("debug"), dataset=dataset, checkpoint_root=str(tmp_path))


def test_one_task_per_topology_with_matching_elastic_config():
    wide = Topology(backend="kubernetes", nnodes=3, nproc_per_node=4, gpus_per_node=4, max_restarts=0,
                    rdzv_timeout_s=1200)
    task = train_task_for(wide, preset("digits"))
    assert task is train_task_for(wide, preset("digits"))
    assert task is not train_task and task.task_type == "pytorch" and train_task.task_type == "python-task"
    assert (task.min_nodes, task.max_nodes, task.task_config.nproc_per_node) == (3, 3, 4)
    assert task.task_config.rdzv_configs == {"timeout": 1200, "join_timeout": 1200, "read_timeout": 1200}
    assert not task.task_config.increase_shared_mem and task.shared_memory is True
    # GPUs or several nodes: spawned workers (tasks.train.worker_start_method says why); one CPU node:
    # forked ones.
    assert task.task_config.start_method == "spawn" and train_task.task_config.start_method == "fork"
    cpu_nodes = train_task_for(Topology(backend="kubernetes", nnodes=2, nproc_per_node=2), preset("digits"))
    assert cpu_nodes.task_config.start_method == "spawn"
    assert task.name == "tasks.train.train-kubernetes-3x4-gpu4-rdzv1200s"
    assert train_task.name == "tasks.train.train-local-1x2"
    online = preset("digits").with_overrides({"telemetry.wandb_mode": "online"})
    assert [s.group for s in train_task_for(wide, online).security_context.secrets] == ["wandb"]
    assert not task.security_context or not task.security_context.secrets


def test_task_names_differ_wherever_templates_differ():
    base = Topology(backend="kubernetes", nnodes=2)
    variants = [base, replace(base, backend="local"), replace(base, max_restarts=1),
                replace(base, rdzv_timeout_s=60), replace(base, gpus_per_node=2, nproc_per_node=2),
                replace(base, gpus_per_node=2, nproc_per_node=2, accelerator="nvidia-h100"),
                replace(base, backend="slurm", slurm=SlurmSettings(target="a")),
                replace(base, backend="slurm", slurm=SlurmSettings(target="a", setup="module load cuda"))]
    names = {train_task_for(t, preset("digits")).name for t in variants}
    online = preset("digits").with_overrides({"telemetry.wandb_mode": "online"})
    names.add(train_task_for(base, online).name)
    assert len(names) == len(variants) + 1, names


def test_resolver_rebuilds_the_same_task_from_its_command():
    task = train_task_for(Topology(backend="kubernetes", nnodes=2, nproc_per_node=8), preset("digits"))
    resolver = load_object_from_module(task.task_resolver.location)
    rebuilt = resolver.load_task(resolver.loader_args(None, task))
    assert isinstance(rebuilt, ElasticTrainTask)
    assert rebuilt.task_config == task.task_config and rebuilt.name == task.name


def test_a_slurm_jobs_command_rebuilds_the_elastic_task_of_its_topology():
    topology = Topology(backend="slurm", nnodes=2, nproc_per_node=1, slurm=SlurmSettings(target="hpc"))
    submitted = train_task_for(topology, preset("digits"))
    assert submitted.task_type == SLURM_TASK_TYPE and submitted.task_type_version == 1
    assert not isinstance(submitted, ElasticTrainTask)  # submitted where the workflow runs, not trained
    resolver = load_object_from_module(submitted.task_resolver.location)
    on_nodes = resolver.load_task(resolver.loader_args(None, submitted))
    assert isinstance(on_nodes, ElasticTrainTask) and on_nodes.topology == topology
    assert (on_nodes.task_config.nnodes, on_nodes.task_config.nproc_per_node) == (2, 1)
    assert on_nodes.name == submitted.name
    interfaces = [(t.python_interface.inputs, t.python_interface.outputs) for t in (on_nodes, submitted)]
    assert interfaces[0] == interfaces[1]


def test_a_node_range_is_the_elastic_tasks_nnodes_with_a_short_last_call():
    topology = Topology(backend="kubernetes", nnodes=4, min_nnodes=2, nproc_per_node=1, max_restarts=2)
    task = train_task_for(topology, preset("digits"))
    assert isinstance(task, ElasticTrainTask) and task.task_config.nnodes == "2:4"
    assert (task.min_nodes, task.max_nodes) == (2, 4)
    assert task.task_config.rdzv_configs["last_call_timeout"] == train_module.LAST_CALL_S
    assert task.name == "tasks.train.train-kubernetes-2to4x1-restarts2"
    fixed = train_task_for(replace(topology, min_nnodes=0), preset("digits"))
    assert fixed.task_config.nnodes == 4 and "last_call_timeout" not in fixed.task_config.rdzv_configs


def test_task_name_depends_on_the_topology_alone(tmp_path, monkeypatch):
    """flytekit would name a task built while a module is imported after that module too."""
    (tmp_path / "builds_at_import.py").write_text(
        "from tasks.launch import train_task_for\n"
        "from tasks.types import Topology\n"
        "from traincore.config.schema import Config\n"
        "task = train_task_for(Topology(backend='kubernetes', nnodes=7, nproc_per_node=3), Config())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    built_at_import = importlib.import_module("builds_at_import").task
    assert built_at_import.name == "tasks.train.train-kubernetes-7x3"
    assert train_task_for(Topology(backend="kubernetes", nnodes=5, nproc_per_node=3),
                          preset("digits")).name == "tasks.train.train-kubernetes-5x3"  # built in a test


def test_mounted_wandb_secret_reaches_validation_and_workers(tmp_path, monkeypatch):
    from tasks.train import WANDB_SECRET, _use_wandb_secret
    from traincore.telemetry.wandb_access import resolve_wandb_key

    secret = tmp_path / WANDB_SECRET.group / WANDB_SECRET.key
    secret.parent.mkdir()
    secret.write_text("k3y-from-the-mounted-secret-0123456789abcdefghijklmnopqrstuvwxyz\n")
    # Where Flyte mounts file secrets in a pod (FLYTE_SECRETS_DEFAULT_DIR, read once at start-up).
    monkeypatch.setattr(flytekit.current_context().secrets, "_base_dir", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_API_KEY_FILE", raising=False)
    with pytest.raises(ValueError, match="needs a W&B API key"):
        resolve_wandb_key("online")
    _use_wandb_secret(preset("digits").with_overrides({"telemetry.wandb_mode": "online"}))
    assert resolve_wandb_key("online") == "k3y-from-the-mounted-secret-0123456789abcdefghijklmnopqrstuvwxyz"


def group_failure(exitcode: int, error_file: str = "<N/A>") -> ChildFailedError:
    """What torch-elastic raises when local rank 1 of a worker group ended with ``exitcode``."""
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode, error_file=error_file)
    return ChildFailedError("spawn_helper", {1: failure})


@pytest.mark.parametrize("exitcode, vanished", [
    (-signal.SIGKILL, ["rank 1 (SIGKILL, pid 4242)"]),  # OOM killer, lost node
    (-signal.SIGTERM, ["rank 1 (SIGTERM, pid 4242)"]),  # eviction, preemption
    (-signal.SIGABRT, ["rank 1 (SIGABRT, pid 4242)"]),  # NCCL's watchdog on a collective a lost peer left
    (-signal.SIGSEGV, []),  # the worker's own crash
    (1, []),  # an exception
])
def test_workers_ended_by_a_signal_from_outside_count_as_vanished(exitcode, vanished):
    assert vanished_workers(group_failure(exitcode)) == vanished


def test_a_worker_that_wrote_its_error_did_not_vanish(tmp_path):
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "ValueError: bad", "extraInfo": {
        "py_callstack": "", "timestamp": "1"}}}))
    assert vanished_workers(group_failure(-signal.SIGKILL, str(error_file))) == []


def launch_failing_with(error: ChildFailedError):
    """A stand-in for the plugin's launch: it classifies ``error`` as flytekitplugins-kfpytorch 1.16 does
    for a worker that left no recoverable marker (a user error)."""

    def launch(self, **kwargs):
        raise FlyteUserRuntimeException(error)

    return launch


def test_lost_worker_makes_the_task_recoverable(monkeypatch, dataset, tmp_path):
    monkeypatch.setattr(PytorchElasticFunctionTask, "execute",
                        launch_failing_with(group_failure(-signal.SIGKILL)))
    with pytest.raises(FlyteRecoverableException, match=r"rank 1 \(SIGKILL, pid 4242\) was killed") as caught:
        train_task.execute(config=preset("debug"), dataset=dataset, checkpoint_root=str(tmp_path))
    assert isinstance(caught.value.__cause__, FlyteUserRuntimeException)


def test_crashed_worker_stays_a_user_error(monkeypatch, dataset, tmp_path):
    monkeypatch.setattr(PytorchElasticFunctionTask, "execute",
                        launch_failing_with(group_failure(-signal.SIGSEGV)))
    with pytest.raises(FlyteUserRuntimeException) as caught:
        train_task.execute(config=preset("debug"), dataset=dataset, checkpoint_root=str(tmp_path))
    assert not isinstance(caught.value, FlyteRecoverableException)
    assert str(caught.value.value).startswith("rank 1 failed first (killed by SIGSEGV, pid 4242)")


def test_one_process_trains_in_the_task_process_and_more_launch_workers(monkeypatch, dataset, tmp_path):
    trained_in = []

    class Recording(train_module.Trainer):
        """The real Trainer, noting the process it runs in (a spawned worker would not see this class)."""

        def train(self):
            trained_in.append(os.getpid())
            return super().train()

    monkeypatch.setattr(train_module, "Trainer", Recording)
    config = preset("debug").with_overrides({"train": {"max_steps": 2}, "telemetry": {"tensorboard": False}})
    one = train_task_for(Topology(nproc_per_node=1), config)
    assert one.single_process
    result = one(config=config, dataset=dataset, checkpoint_root=str(tmp_path / "checkpoints"))
    assert trained_in == [os.getpid()]
    assert result.summary.steps == 2 and result.summary.world_size == 1
    assert "first step" in result.summary.startup_s
    # Several processes, or restarts (which need torch elastic's agent), still launch workers.
    assert not train_task_for(Topology(nproc_per_node=2), config).single_process
    assert not train_task_for(Topology(nproc_per_node=1, max_restarts=1), config).single_process


def test_cpu_workers_are_forked_from_the_task_process(monkeypatch, dataset, tmp_path):
    seen = tmp_path / "workers.jsonl"

    class Recording(train_module.Trainer):
        """The real Trainer, noting the worker it runs in: only a forked worker sees this class."""

        def train(self):
            with seen.open("a") as out:
                out.write(json.dumps({"pid": os.getpid(), "parent": os.getppid(),
                                      "rank": int(os.environ["RANK"])}) + "\n")
            return super().train()

    monkeypatch.setattr(train_module, "Trainer", Recording)
    config = preset("debug").with_overrides({"train": {"max_steps": 2}, "telemetry": {"tensorboard": False}})
    two = train_task_for(Topology(nproc_per_node=2), config)
    result = two(config=config, dataset=dataset, checkpoint_root=str(tmp_path / "checkpoints"))
    workers = [json.loads(line) for line in seen.read_text().splitlines()]
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert all(w["parent"] == os.getpid() != w["pid"] for w in workers)  # the agent runs in this process
    assert result.summary.steps == 2 and result.summary.world_size == 2


def signalled_agent_error(signum: int) -> IgnoreOutputs:
    """The error the kfpytorch plugin raises when its elastic agent gets ``signum``."""
    try:
        try:
            raise SignalException(f"Process 1 got signal: {signum}", sigval=signal.Signals(signum))
        except SignalException:
            raise IgnoreOutputs() from None  # the plugin's own raise keeps the context, as this does
    except IgnoreOutputs as error:
        return error


def test_a_signal_before_the_workers_trained_a_step_ends_the_attempt_recoverable(capsys):
    """A preemption during start-up leaves no record (nothing new to save): still a retry, not the
    IgnoreOutputs that a normal non-rank-0 pod ends with and that would leave the task without outputs."""
    assert train_module.agent_signal(signalled_agent_error(signal.SIGTERM)) == "SIGTERM"
    assert train_module.agent_signal(IgnoreOutputs()) is None
    with pytest.raises(FlyteRecoverableException, match="stopped by SIGTERM before this attempt committed a "
                       r"checkpoint .*; no complete checkpoint in /checkpoints yet: a retry starts from"):
        train_module.stop_preempted("SIGTERM", "/checkpoints")
    ctx = FlyteContextManager.current_context()
    mode = ExecutionState.Mode.LOCAL_TASK_EXECUTION
    local = ctx.with_execution_state(ctx.execution_state.with_params(mode=mode))
    with FlyteContextManager.with_context(local), pytest.raises(SystemExit) as stopped:
        train_module.stop_preempted("SIGINT", "/checkpoints")
    assert stopped.value.code == 75
    assert capsys.readouterr().err.splitlines() == [
        "stopped by SIGINT before this attempt committed a checkpoint of the step it reached (it was "
        "starting, or its save outlasted checkpoint.preemption_grace_s)",
        "to resume, run the same pyflyte command with --checkpoint_uri /checkpoints"]


def test_both_train_tasks_end_a_preempted_attempt_from_the_record_its_workers_left(monkeypatch, dataset,
                                                                                 tmp_path):
    from flytekit.exceptions.user import FlyteUserException
    from flytekit.extend.backend.base_connector import AsyncConnectorExecutorMixin

    from tasks.slurm.connector import CONNECTOR, SlurmJobMeta
    from tasks.slurm.report import JobEnd
    from tasks.slurm.states import Outcome
    from traincore.run.preemption import Preempted, write_record

    root = str(tmp_path / "checkpoints")
    saved = Preempted(12, "SIGTERM", f"{root}/step-000012")

    def evicted(self, **kwargs):
        write_record(root, saved)  # as rank 0 leaves it before the workers exit
        raise signalled_agent_error(signal.SIGTERM)

    def job_signalled(self, **kwargs):
        write_record(root, saved)
        self.resource_meta = SlurmJobMeta(job_id="12", target="hpc", output_prefix="/prefix")
        CONNECTOR.last["12"] = JobEnd(Outcome.RETRYABLE, "Slurm job 12 signalled", preempted_by="SIGUSR1")
        raise FlyteUserException("Slurm job 12 signalled")

    monkeypatch.setattr(PytorchElasticFunctionTask, "execute", evicted)
    monkeypatch.setattr(AsyncConnectorExecutorMixin, "execute", job_signalled)
    slurm_task = train_task_for(Topology(backend="slurm", slurm=SlurmSettings(target="hpc")), preset("debug"))
    for task in (train_task, slurm_task):
        # The record names the step saved: it wins over the signal the launcher saw.
        with pytest.raises(FlyteRecoverableException, match="preempted at step 12 by SIGTERM: checkpoint "
                           "step-12 saved in .*; the same command resumes from it"):
            task.execute(config=preset("debug"), dataset=dataset, checkpoint_root=root)


def test_one_function_reads_the_record_and_stops_a_preempted_attempt(tmp_path):
    from traincore.run.preemption import Preempted, write_record

    root = str(tmp_path)
    assert train_module.stop_if_preempted(root, "", None) is None  # neither a record nor a signal: go on
    with pytest.raises(FlyteRecoverableException, match="stopped by SIGTERM before this attempt committed"):
        train_module.stop_if_preempted(root, "", "SIGTERM")
    write_record(root, Preempted(7, "SIGINT", f"{root}/step-000007"))
    with pytest.raises(FlyteRecoverableException, match="preempted at step 7 by SIGINT: checkpoint step-7"):
        train_module.stop_if_preempted(root, "", "SIGTERM")
