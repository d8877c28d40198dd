"""The registered workflow, replayed node by node the way a Flyte cluster runs it: the verdicts on a
launch that cannot run.

The whole-workflow replays are in the modules that need one for their own runs: the non-fast registration
with a two-pod elastic PyTorchJob of one process each that shards the model across the pods (FSDP) and
reaches the digits preset's accuracy in test_pod_restarts.py (its reference run), and the fast
registration with two pods on an S3 store and with one pod of two processes on a local store in
test_s3_replay.py.
"""

from __future__ import annotations

from replay_helpers import run_replay  # noqa: I001  (a module beside this file)


def test_a_failing_node_fails_the_replay(non_fast_package, tmp_path):
    code, output, summary = run_replay(non_fast_package, tmp_path / "run", "preset=no-such-preset")
    assert code == 1 and not summary
    assert "node n0" in output and "no-such-preset" in output


def test_unknown_input_is_a_usage_error(non_fast_package, tmp_path):
    code, output, _ = run_replay(non_fast_package, tmp_path / "run", "no_such_input=1")
    assert code == 2 and "unknown input(s) ['no_such_input']" in output
