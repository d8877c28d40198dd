"""A worker's stderr copied to a file of its own survives the worker, and a failed group's error starts with
the first failing rank, how it ended and the last lines it wrote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tasks.failures import STDERR_DIR_ENV, first_failure, stderr_tail

# A worker that writes to its stderr from Python and below it (as gloo and NCCL do: text that looks like
# rich markup), then dies by SIGKILL, as the OOM killer ends it.
WORKER = """
import os, signal, sys
from tasks.failures import captured_stderr
with captured_stderr(rank=1):
    print("epoch 3: loss 0.25", file=sys.stderr, flush=True)
    os.write(2, b"[/__w/pytorch/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.7]\\n")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_workers_stderr_is_kept_in_full_and_still_reaches_the_console(tmp_path):
    done = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=60,
                          env={**os.environ, STDERR_DIR_ENV: str(tmp_path)})
    assert done.returncode == -signal.SIGKILL
    written = ["epoch 3: loss 0.25",
               "[/__w/pytorch/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.7]"]
    assert done.stderr.splitlines() == written  # the console (a pod's log) still gets every line
    assert stderr_tail(tmp_path, 1) == written  # and so does the rank's own file, the worker dead or not

    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=-signal.SIGKILL, error_file="<N/A>")
    message = first_failure(ChildFailedError("train", {1: failure}), tmp_path)
    assert message == ("rank 1 failed first (killed by SIGKILL, pid 4242). The last lines of its stderr:\n"
                       f"  {written[0]}\n  {written[1]}")


def test_without_a_capture_the_first_failure_still_names_the_rank_and_exit_code(tmp_path):
    failures = {3: ProcessFailure(local_rank=1, pid=7, exitcode=2, error_file="<N/A>")}
    message = first_failure(ChildFailedError("train", failures), None)
    assert message == "rank 3 failed first (exit code 2, pid 7)"
    assert stderr_tail(tmp_path, 3) == []
