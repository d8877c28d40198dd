"""The Slurm batch job a training run becomes: sbatch flags and the script, built from a Topology, and the
failures its nodes report.

One Slurm task per node (``--ntasks-per-node=1``): ``srun`` starts the task's own entrypoint
(``pyflyte-execute ...``) once on every node, and each of those runs one torch elastic agent with
``nproc_per_node`` workers. The agents meet in a c10d rendezvous on the first node of the allocation, at a
port derived from the job id, so two jobs sharing a node do not collide. Only global rank 0 writes the
task's outputs; the other nodes end with flytekit's IgnoreOutputs.

A failed node writes an error document of its own (flytekit's distributed error strategy: ``error-<uuid>.pb``
named by the node), so no node's failure overwrites another's, and each node's stderr goes to a file of its
own (``slurm-<job>-<node>.err``). :func:`task_failures` orders them so that the cause comes first.
"""

from __future__ import annotations

import argparse
import logging
import math
import posixpath
import re
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flyteidl.core import errors_pb2, execution_pb2
from flytekit.core import utils
from flytekit.core.context_manager import FlyteContextManager
from google.protobuf.timestamp_pb2 import Timestamp

from tasks.failures import killed_rank, preemption_signal
from tasks.slurm.states import JobInfo, Outcome
from traincore.exitcodes import PREEMPTED_EXIT_CODE

if TYPE_CHECKING:  # the batch job runs this module's verdicts on every node: no torch there (exitcodes.py)
    from tasks.types import Topology

log = logging.getLogger(__name__)

RDZV_PORT_BASE = 29400  # c10d rendezvous port = base + job id modulo RDZV_PORT_SPAN
RDZV_PORT_SPAN = 1000
JOB_NAME = "flyte-torch-train"
# Seconds the warning signal comes before the time limit beyond the preemption grace: the agents' own
# shutdown and the step in progress when the signal arrives.
SIGNAL_MARGIN_S = 15
SETUP_ERROR = "slurm_setup did not activate an environment with flyte-torch-pipeline installed"


def warning_lead_s(grace_s: float) -> int:
    """Seconds before the time limit at which the job's steps get SIGTERM: the grace, rounded up, plus a
    margin, so the workers save a checkpoint before Slurm ends the job with TIMEOUT."""
    return math.ceil(grace_s) + SIGNAL_MARGIN_S


_TIME_LIMIT = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_s(text: str) -> int | None:
    """Seconds of a Slurm time limit (sbatch ``--time``: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S); None when it
    is empty, unlimited or of another form (sbatch has the last word on those)."""
    match = _TIME_LIMIT.match(text.strip())
    if not match:
        return None
    days, first, second, third = (int(group) if group else None for group in match.groups())
    if days is not None:
        return ((days * 24 + first) * 60 + (second or 0)) * 60 + (third or 0)
    if third is not None:
        return (first * 60 + second) * 60 + third
    return first * 60 + (second or 0)


@dataclass(frozen=True)
class NodeRequest:
    """What the job asks of each node: CPUs, memory and GPUs. One Slurm task runs per node, so these are
    the train task's requests, which are already per node (nproc_per_node times the per-process requests,
    tasks/train.py). 0 = not asked: the partition's default, or the user's own sbatch flag."""

    cpus: int = 0
    mem_mib: int = 0
    gpus: int = 0

    def flags(self) -> list[str]:
        """``--cpus-per-task``, ``--mem`` and ``--gres=gpu:N`` for what is asked."""
        return [flag for value, flag in ((self.cpus, f"--cpus-per-task={self.cpus}"),
                                         (self.mem_mib, f"--mem={self.mem_mib}M"),
                                         (self.gpus, f"--gres=gpu:{self.gpus}")) if value]

    def without(self, sbatch_flags: str) -> NodeRequest:
        """This request less what the user's own sbatch flags already ask (``--mem-per-cpu`` instead of
        ``--mem``, say: sbatch refuses the two together), so that theirs hold."""
        given = {arg.split("=", 1)[0] for arg in shlex.split(sbatch_flags) if arg.startswith("-")}
        return NodeRequest(cpus=0 if given & _CPU_FLAGS else self.cpus,
                           mem_mib=0 if given & _MEM_FLAGS else self.mem_mib,
                           gpus=0 if given & _GPU_FLAGS else self.gpus)


_CPU_FLAGS = frozenset({"-c", "--cpus-per-task", "--cpus-per-gpu"})
_MEM_FLAGS = frozenset({"--mem", "--mem-per-cpu", "--mem-per-gpu"})
_GPU_FLAGS = frozenset({"--gres", "-G", "--gpus", "--gpus-per-node", "--gpus-per-task"})
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)([a-zA-Z]*)$")
_BYTES = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
          "Ti": 2**40}


def _quantity(text: str) -> float:
    """A Kubernetes resource quantity (``4``, ``500m``, ``12Gi``) as a number (CPUs, or bytes)."""
    match = _QUANTITY.match(text.strip())
    if not match or (match.group(2) not in _BYTES and match.group(2) != "m"):
        raise ValueError(f"not a resource quantity: {text!r}")
    number, unit = float(match.group(1)), match.group(2)
    return number / 1000 if unit == "m" else number * _BYTES[unit]


def node_request(requests: dict[str, str]) -> NodeRequest:
    """The node request of a task's resource requests (``{"cpu": "4", "memory": "12Gi", "gpu": "1"}``):
    CPUs rounded up, memory in MiB rounded up."""
    return NodeRequest(cpus=math.ceil(_quantity(requests.get("cpu", "0"))),
                       mem_mib=math.ceil(_quantity(requests.get("memory", "0")) / 2**20),
                       gpus=math.ceil(_quantity(requests.get("gpu", "0"))))


def sbatch_args(topology: Topology, grace_s: float, request: NodeRequest) -> list[str]:
    """The sbatch command-line flags of the job: nodes, each node's CPUs, memory and GPUs (``request``,
    less what ``slurm_sbatch_flags`` ask themselves), partition, account, time, the warning signal before
    the time limit, extra flags. A requeued job appends to its logs instead of overwriting them."""
    slurm = topology.slurm
    # No "B:": the signal goes to the job's steps, i.e. srun's tasks and every process under them (the
    # torch elastic agents and their workers), not to the batch shell that waits for srun.
    args = [f"--nodes={topology.nnodes}", "--ntasks-per-node=1", f"--job-name={JOB_NAME}",
            "--output=slurm-%j.out", "--error=slurm-%j.err", "--open-mode=append",
            f"--signal=TERM@{warning_lead_s(grace_s)}"]
    args += request.without(slurm.sbatch_flags).flags()
    flags = (("partition", slurm.partition), ("account", slurm.account), ("time", slurm.time_limit))
    for flag, value in flags:
        if value:
            args.append(f"--{flag}={value}")
    return args + shlex.split(slurm.sbatch_flags)


def node_stderr(job_stderr: str, job_id: str, node: str) -> str:
    """The stderr file of ``node``'s task, next to the job's own stderr ``job_stderr``."""
    return posixpath.join(posixpath.dirname(job_stderr), f"slurm-{job_id}-{node}.err")


def batch_script(topology: Topology, entrypoint: list[str]) -> str:
    """The batch script: the user's set-up lines, the rendezvous endpoint, then ``srun`` of each node's part:
    the entrypoint, then that node's verdict (pyflyte-execute reports a task's exception in an error document
    and exits 0, because Flyte reads that file; a node that failed must exit non-zero instead, so that
    ``--kill-on-bad-exit`` ends the other nodes, whose workers would otherwise wait in a collective for
    their lost peer until it times out)."""
    nodes = topology.nnodes
    prefix = shlex.quote(entrypoint[entrypoint.index("--output-prefix") + 1])
    return f"""#!/bin/bash
# Written by flyte-torch-pipeline: one torch elastic agent per node, {topology.nproc_per_node} worker(s) each.
set -eo pipefail
{topology.slurm.setup.strip()}
# The set-up lines must activate an environment that has this project: say so once, here, rather than
# as every node's "command not found".
if ! command -v pyflyte-execute >/dev/null || ! python -c "import tasks.slurm" 2>/dev/null; then
    echo "{SETUP_ERROR}: pyflyte-execute: $(command -v pyflyte-execute || echo not found)," \
        "python: $(command -v python || echo not found). Fix slurm_setup, e.g." \
        "'source <venv with flyte-torch-pipeline>/bin/activate'" >&2
    exit 127
fi
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The head node's address as Slurm knows it (NodeAddr), which other nodes can reach even without DNS.
head_addr=$(scontrol show node "$head_node" -o | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')
rdzv_port=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN} ))
export PET_RDZV_ENDPOINT="${{head_addr:-$head_node}}:$rdzv_port"
export PET_NNODES={nodes}
# torch elastic agents meet under one run id, which flytekit takes from the execution id: without one each
# agent would draw a random id and wait alone until the rendezvous timeout.
export FLYTE_INTERNAL_EXECUTION_ID="${{FLYTE_INTERNAL_EXECUTION_ID:-slurm-$SLURM_JOB_ID}}"
# Each node's error document gets a name of its own and says which node wrote it.
export FLYTE_INTERNAL_DIST_ERROR_STRATEGY=Earliest
attempt=$(( ${{SLURM_RESTART_COUNT:-0}} + 1 ))
echo "job $SLURM_JOB_ID attempt $attempt: {nodes} node(s) $SLURM_JOB_NODELIST," \\
    "rendezvous at $PET_RDZV_ENDPOINT" >&2
if [ "$attempt" -gt 1 ]; then python -m tasks.slurm.job --clear {prefix}; fi
node_task() {{
    export FLYTE_INTERNAL_WORKER_NAME="$SLURMD_NODENAME"
    # The warning signal (or a preemption's) reaches every process of the step, this shell too: it waits
    # for the task, which saves its step, then gives the verdict, told whether the signal came (a trap,
    # unlike an ignored signal, is not inherited by the task).
    signalled=""
    trap 'signalled=SIGTERM' TERM
    trap 'signalled=SIGINT' INT
    status=0
    "$@" || status=$?
    python -m tasks.slurm.job --node "$SLURMD_NODENAME" --status "$status" --signal "$signalled" {prefix}
}}
export -f node_task
status=0
# srun gives its task the job's CPUs per task only when told (Slurm 22.05 stopped reading it from sbatch).
srun --nodes={nodes} --ntasks-per-node=1 ${{SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK}} \\
    --kill-on-bad-exit=1 --error=slurm-%j-%N.err --open-mode=append \\
    bash -c 'node_task "$@"' node {shlex.join(entrypoint)} || status=$?
# The job's verdict from all the nodes' error documents: srun exits with the largest of the nodes' codes,
# and a node it stopped because another failed first (--kill-on-bad-exit) shows 143, not the cause.
python -m tasks.slurm.job --job --status "$status" {prefix}
"""


@dataclass(frozen=True)
class TaskFailure:
    """One node's error document: who wrote it, when, whether Flyte may retry, and the message."""

    node: str
    timestamp: float
    recoverable: bool
    message: str

    @property
    def worker_signal(self) -> tuple[int, str] | None:
        """(rank, signal name) when the node's first failed worker was killed by a signal (the cause of its
        peers' collective errors), else None: read from the train task's own first line
        (tasks.failures.first_failure)."""
        return killed_rank(self.message)

    @property
    def preempted_by(self) -> str | None:
        """The signal's name when the node's task was preempted (a time limit's warning, a preemption),
        else None (tasks.failures.preemption_signal)."""
        return preemption_signal(self.message)

    def summary(self) -> str:
        """Where it failed and how, in one line: the node, and the rank and signal when one killed it."""
        where = f"node {self.node}" if self.node else "a node"
        killed = self.worker_signal
        return f"{where}: rank {killed[0]} was killed by {killed[1]}" if killed else f"{where} failed"


def _read_error(path: str) -> TaskFailure:
    ctx = FlyteContextManager.current_context()
    local = ctx.file_access.get_random_local_path()
    ctx.file_access.get_data(path, local)
    error = utils.load_proto_from_file(errors_pb2.ErrorDocument, local).error
    return TaskFailure(node=error.worker, timestamp=error.timestamp.ToMicroseconds() / 1e6,
                       recoverable=error.kind == errors_pb2.ContainerError.RECOVERABLE,
                       message=error.message.strip())


def error_documents(output_prefix: str) -> list[str]:
    """The paths of the error documents under the task's output prefix (``error.pb``, ``error-*.pb``)."""
    ctx = FlyteContextManager.current_context()
    prefix = output_prefix.rstrip("/")
    fs = ctx.file_access.get_filesystem_for_path(prefix)
    found = fs.glob(f"{prefix}/error*.pb")
    protocol = prefix.split("://", 1)[0] if "://" in prefix else ""
    return sorted(path if not protocol or "://" in path else f"{protocol}://{path}" for path in found)


def task_failures(output_prefix: str) -> list[TaskFailure]:
    """The nodes' failures, the cause first: a worker ended by a signal from outside (its peers' collective
    errors follow from it), then by time. Empty when none is readable."""
    try:
        failures = [_read_error(path) for path in error_documents(output_prefix)]
    except Exception as exc:  # the task's error is a courtesy: never hide the job's state behind it
        log.warning("could not read the error documents under %s: %s", output_prefix, exc)
        return []
    return sorted(failures, key=lambda failure: (failure.worker_signal is None, failure.timestamp))


def job_outcome(job: JobInfo, failures: list[TaskFailure]) -> Outcome:
    """A finished job's outcome from its Slurm state and the nodes' own failure markers: a job that Slurm
    ended for its time limit, a preemption or a lost node, one whose tasks exited 75 (a preempted worker) and
    one whose first failure is recoverable (its error document says so) are worth a retry."""
    if job.outcome is not Outcome.FAILED:
        return job.outcome
    if job.exit_code == PREEMPTED_EXIT_CODE or (failures and failures[0].recoverable):
        return Outcome.RETRYABLE
    return Outcome.FAILED


def _clear(output_prefix: str) -> None:
    """Remove an earlier attempt's error documents (a job Slurm requeued runs again in the same prefix)."""
    ctx = FlyteContextManager.current_context()
    fs = ctx.file_access.get_filesystem_for_path(output_prefix)
    for path in error_documents(output_prefix):
        fs.rm(path)


def _write_signalled(output_prefix: str, node: str, signal_name: str) -> str:
    """Leave the error document of a node whose task a signal ended before it could write one (while it
    started: its workers had no step to save): recoverable, so that a retry runs. Returns its message."""
    message = (f"stopped by {signal_name} while the task started, before this attempt trained a step: "
               "nothing new to save")
    stamp = Timestamp()
    stamp.GetCurrentTime()
    document = errors_pb2.ErrorDocument(error=errors_pb2.ContainerError(
        code="Signalled", message=message, kind=errors_pb2.ContainerError.RECOVERABLE,
        origin=execution_pb2.ExecutionError.USER, timestamp=stamp, worker=node))
    ctx = FlyteContextManager.current_context()
    local = ctx.file_access.get_random_local_path()
    utils.write_proto_to_file(document, local)
    ctx.file_access.put_data(local, f"{output_prefix.rstrip('/')}/error-{node}-signalled.pb")
    return message


def node_verdict(output_prefix: str, node: str, status: int, signal_name: str) -> int:
    """One node's verdict after its task exited with ``status``: 75 (retry) when the node's failure is
    recoverable, or a signal ended its task before it wrote one; 1 when its failure is not recoverable,
    printing it; else the task's own status (0 when the node did not fail)."""
    failures = [failure for failure in task_failures(output_prefix) if failure.node == node]
    if failures:
        first = failures[0]
        print(f"the task failed ({first.summary()}): {first.message}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE if first.recoverable else 1
    if status and signal_name:
        message = _write_signalled(output_prefix, node, signal_name)
        print(f"the task was {message}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    return status


def job_verdict(output_prefix: str, status: int) -> int:
    """The job's exit code once every node ended (``status``: srun's): 75 when the first failure, the
    cause, is recoverable; 1 when it is not; srun's own code when no node left an error document."""
    if status == 0:
        return 0
    failures = task_failures(output_prefix)
    if not failures:
        return status
    return PREEMPTED_EXIT_CODE if failures[0].recoverable else 1


def main(argv: list[str] | None = None) -> int:
    """The batch script's helpers, on the job's nodes:
    ``python -m tasks.slurm.job --node NODE --status N [--signal SIG] OUTPUT_PREFIX``: one node's verdict;
    ``python -m tasks.slurm.job --job --status N OUTPUT_PREFIX``: the job's;
    ``python -m tasks.slurm.job --clear OUTPUT_PREFIX``: remove an earlier attempt's error documents."""
    parser = argparse.ArgumentParser(prog="python -m tasks.slurm.job")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--node")
    which.add_argument("--job", action="store_true")
    which.add_argument("--clear", action="store_true")
    parser.add_argument("--status", type=int, default=0)
    parser.add_argument("--signal", default="")
    parser.add_argument("output_prefix")
    args = parser.parse_args(argv)
    if args.clear:
        _clear(args.output_prefix)
        return 0
    if args.job:
        return job_verdict(args.output_prefix, args.status)
    return node_verdict(args.output_prefix, args.node, args.status, args.signal)


if __name__ == "__main__":
    sys.exit(main())
