"""The Slurm batch job a training run becomes: sbatch flags and the script, built from a Topology.

One Slurm task per node (``--ntasks-per-node=1``): ``srun`` starts the task's own entrypoint
(``pyflyte-execute ...``) once on every node, and each of those runs one torch elastic agent with
``nproc_per_node`` workers. The agents meet in a c10d rendezvous on the first node of the allocation, at a
port derived from the job id, so two jobs sharing a node do not collide. Only global rank 0 writes the
task's outputs; the other nodes end with flytekit's IgnoreOutputs.
"""

from __future__ import annotations

import logging
import shlex
import sys

from flyteidl.core import errors_pb2
from flytekit.core import utils
from flytekit.core.context_manager import FlyteContextManager

from tasks.types import Topology

log = logging.getLogger(__name__)

RDZV_PORT_BASE = 29400  # c10d rendezvous port = base + job id modulo RDZV_PORT_SPAN
RDZV_PORT_SPAN = 1000
JOB_NAME = "flyte-torch-train"


def sbatch_args(topology: Topology) -> list[str]:
    """The sbatch command-line flags of the job: nodes, GPUs, partition, account, time, extra flags."""
    slurm = topology.slurm
    args = [f"--nodes={topology.nnodes}", "--ntasks-per-node=1", f"--job-name={JOB_NAME}",
            "--output=slurm-%j.out", "--error=slurm-%j.err"]
    if topology.gpus_per_node:
        args.append(f"--gres=gpu:{topology.gpus_per_node}")
    flags = (("partition", slurm.partition), ("account", slurm.account), ("time", slurm.time_limit))
    for flag, value in flags:
        if value:
            args.append(f"--{flag}={value}")
    return args + shlex.split(slurm.sbatch_flags)


def batch_script(topology: Topology, entrypoint: list[str]) -> str:
    """The batch script: the user's set-up lines, the rendezvous endpoint, ``srun`` of the entrypoint, then
    the task's verdict (pyflyte-execute reports a task's exception in error.pb and exits 0, because Flyte
    reads that file; a batch job must fail instead, with the exception on its stderr)."""
    nodes = topology.nnodes
    output_prefix = entrypoint[entrypoint.index("--output-prefix") + 1]
    return f"""#!/bin/bash
# Written by flyte-torch-pipeline: one torch elastic agent per node, {topology.nproc_per_node} worker(s) each.
set -eo pipefail
{topology.slurm.setup.strip()}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The head node's address as Slurm knows it (NodeAddr), which other nodes can reach even without DNS.
head_addr=$(scontrol show node "$head_node" -o | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')
rdzv_port=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN} ))
export PET_RDZV_ENDPOINT="${{head_addr:-$head_node}}:$rdzv_port"
export PET_NNODES={nodes}
# torch elastic agents meet under one run id, which flytekit takes from the execution id: without one each
# agent would draw a random id and wait alone until the rendezvous timeout.
export FLYTE_INTERNAL_EXECUTION_ID="${{FLYTE_INTERNAL_EXECUTION_ID:-slurm-$SLURM_JOB_ID}}"
echo "job $SLURM_JOB_ID: {nodes} node(s) $SLURM_JOB_NODELIST, rendezvous at $PET_RDZV_ENDPOINT" >&2
srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 {shlex.join(entrypoint)}
python -m tasks.slurm.job {shlex.quote(output_prefix)}
"""


def task_error(output_prefix: str) -> str:
    """The message of the error document pyflyte-execute wrote for a failed task, or ''."""
    ctx = FlyteContextManager.current_context()
    path = f"{output_prefix.rstrip('/')}/error.pb"
    try:
        if not ctx.file_access.exists(path):
            return ""
        local = ctx.file_access.get_random_local_path()
        ctx.file_access.get_data(path, local)
    except Exception as exc:  # the job's error is a courtesy: never hide the job's state behind it
        log.warning("could not read %s: %s", path, exc)
        return ""
    return utils.load_proto_from_file(errors_pb2.ErrorDocument, local).error.message.strip()


def main(argv: list[str] | None = None) -> int:
    """``python -m tasks.slurm.job OUTPUT_PREFIX``: exit 1, printing the task's error, when it failed."""
    (output_prefix,) = sys.argv[1:] if argv is None else argv
    error = task_error(output_prefix)
    if error:
        print(f"the task failed: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
