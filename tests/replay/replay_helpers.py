"""Helpers of the replay tests: the repository root, package builds, a replay runner and its recovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `replay` is importable from the checkout even under a bare `pytest`
    sys.path.insert(0, str(ROOT))

IMAGE = "ghcr.io/example/flyte-torch-pipeline:replay-test"


def build_package(out: Path, fast: bool) -> Path:
    """The registration as a platform team makes it: fast, ``make register IMAGE=... PACKAGE=...`` (the
    package `make register` would register, with the same image and copy mode); not fast,
    ``pyflyte --pkgs workflows package`` (code baked into the image)."""
    if fast:
        command = ["make", "--no-print-directory", "register", f"IMAGE={IMAGE}", f"PACKAGE={out}",
                   f"BIN={Path(sys.executable).parent}"]
    else:
        command = [str(Path(sys.executable).parent / "pyflyte"), "--pkgs", "workflows", "package",
                   "--image", IMAGE, "--output", str(out), "--force"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    if fast:
        assert f"wrote {out}: the workflows, their launch plans and the code, for image {IMAGE}" in run.stderr
        register = f"flytectl register files --project flytesnacks --domain development --archive {out}"
        assert register in run.stderr
    return out


def run_replay(package: Path, workdir: Path, *inputs: str, timeout: float = 600, options: tuple = (),
               module: str = "replay", env: dict | None = None) -> tuple[int, str, dict]:
    """``python -m replay`` (or another ``module`` of the harness) as a user runs it, from outside the source
    tree, with extra ``options`` and ``env``: (exit code, output, summary)."""
    summary = workdir / "summary.json"
    command = [sys.executable, "-m", module, str(package), "--workdir", str(workdir),
               "--summary-json", str(summary), "--node-timeout", "300", *options]
    for item in inputs:
        command += ["--input", item]
    # The harness comes from this checkout; its pods do not.
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, cwd=workdir.parent, capture_output=True, text=True, timeout=timeout,
                          env=env)
    data = json.loads(summary.read_text()) if summary.is_file() else {}
    return proc.returncode, proc.stdout + proc.stderr, data



def run_recovery(package: Path, workdir: Path, execution: str, store: str | Path, *options: str,
                 env: dict | None = None) -> tuple[int, str, dict]:
    """``python -m replay --recover EXECUTION`` (Flyte's recover) of an execution of ``store``: a new
    execution on that one's inputs and launch plan, reusing the nodes it ran to success; (exit code, output,
    summary)."""
    return run_replay(package, workdir, options=("--recover", execution, "--store", str(store), *options),
                      env=env)


def recovered_nodes(summary: dict) -> list[str]:
    """The nodes an execution recovered instead of running (no pod), in order."""
    return [node["node_id"] for node in summary["nodes"] if node["recovered_from"]]
