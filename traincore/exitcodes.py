"""The exit codes a training process ends with, which launchers and schedulers act on.

A module of its own, free of torch, because the Slurm batch job reads it on every node when the node's task
ends (``python -m tasks.slurm.job``): importing torch there cost about 5 of the 7.8 CPU seconds each of a
job's three verdicts took (measured on a 2-core machine).
"""

import sys

PREEMPTED_EXIT_CODE = 75
"""Exit code of a preempted run (EX_TEMPFAIL, "try again"): the same command resumes it."""

INTERRUPTED_EXIT_CODE = 130
"""Exit code of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it), after one line saying what
it left."""


def interrupted_while_starting(command: str) -> int:
    """Say that Ctrl-C stopped ``command`` while it imported its modules (torch alone takes seconds), before
    it read its arguments or wrote anything, in one line instead of the import's traceback; returns the exit
    code."""
    print(f"interrupted: {command} stopped while starting, nothing was written", file=sys.stderr)
    return INTERRUPTED_EXIT_CODE
