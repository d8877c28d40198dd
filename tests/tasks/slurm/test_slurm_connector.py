"""The connector's decisions that need no cluster: a requeued job's bounded wait, markup-safe messages."""

from __future__ import annotations

import asyncio

from flyteidl.core.execution_pb2 import TaskExecution
from flytekit.core.context_manager import ExecutionState, FlyteContextManager

from tasks.slurm.connector import SlurmJobMeta, SlurmTrainConnector
from tasks.slurm.states import JobInfo, Outcome


class ScriptedConnector(SlurmTrainConnector):
    """The connector with its Slurm calls answered from a script instead of an SSH connection."""

    def __init__(self, job: JobInfo):
        super().__init__()
        self.job, self.calls = job, []

    async def _call(self, target, method, *args):
        self.calls.append(method)
        gloo = "[/__w/gloo/transport.cc:1] connection closed\n"  # a worker's stderr line
        return {"job": self.job, "cancel": None, "tail": gloo}[method]


META = SlurmJobMeta(job_id="12", target="hpc", output_prefix="/nonexistent/prefix")


def test_a_requeued_job_waits_for_nodes_only_up_to_the_bound():
    requeued = JobInfo(job_id="12", state="PENDING", outcome=Outcome.QUEUED, reason="BeginTime", restarts=1)
    connector = ScriptedConnector(requeued)
    connector.requeue_wait_s = 0.2
    first = asyncio.run(connector.get(META))
    assert first.phase == TaskExecution.QUEUED and "requeued 1 time(s), waiting for nodes" in first.message
    asyncio.run(asyncio.sleep(0.3))
    expired = asyncio.run(connector.get(META))
    assert expired.phase == TaskExecution.RETRYABLE_FAILED and connector.calls[-1] == "cancel"
    assert "waited 0 s without starting again, so it was cancelled" in expired.message
    assert "sinfo -R" in expired.message and connector.last["12"].outcome is Outcome.RETRYABLE


def test_worker_output_in_a_local_run_message_is_never_rich_markup():
    failed = JobInfo(job_id="12", state="FAILED", outcome=Outcome.FAILED, exit_code=1,
                     stderr_path="/home/u/jobs/slurm-12.err")
    ctx = FlyteContextManager.current_context()
    local = ctx.with_execution_state(ctx.new_execution_state().with_params(
        mode=ExecutionState.Mode.LOCAL_TASK_EXECUTION))
    with FlyteContextManager.with_context(local):
        shown = asyncio.run(ScriptedConnector(failed).get(META)).message
    remote = asyncio.run(ScriptedConnector(failed).get(META)).message
    assert "\\[/__w/gloo/transport.cc:1]" in shown  # escaped for flytekit's rich progress line
    assert "[/__w/gloo/transport.cc:1]" in remote and "\\[" not in remote  # as it is for a Flyte cluster
