"""One container of a Flyte task as a local process: rendered args, a pod's environment, its own directory.

A pod here is a fresh process group with its own HOME, TMPDIR and working directory (outside the source
tree) under ``<workdir>/pods/<pod>/``, started from the container args as serialised, after the
substitutions propeller makes (flyteplugins go/tasks/pluginmachinery/core/template/template.go: input,
outputPrefix, rawOutputDataPrefix, checkpointOutputPrefix, prevCheckpointPrefix, the last rendered as
``""`` on a first attempt) and the one flytectl makes at registration (``{{ .remote_package_path }}``).
The pods of one job each run on their own share of this machine's cores (:func:`cpu_shares`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from flyteidl.core import tasks_pb2

from replay.package import REMOTE_PACKAGE_PATH
from replay.store import Execution, NodePaths

# Case-insensitive and tolerant of spaces and of "$" for ".", as propeller's regexes are.
_TEMPLATES = {"input": "inputs", "outputprefix": "output_prefix", "rawoutputdataprefix": "raw_output_prefix",
              "checkpointoutputprefix": "checkpoint_prefix", "prevcheckpointprefix": "prev_checkpoint_prefix"}
_TEMPLATE_RE = re.compile(r"{{\s*[.$](" + "|".join(_TEMPLATES) + r")\s*}}", re.IGNORECASE)
# Credentials and endpoint of the object store: on a cluster the platform injects them into every pod.
_PLATFORM_ENV_PREFIXES = ("FLYTE_AWS_", "AWS_", "FLYTE_GCP_", "FLYTE_AZURE_")


@dataclass
class PodSpec:
    """What a pod is started from: its name, its container's args and its container's env."""

    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class PodResult:
    name: str
    returncode: int
    wall_s: float
    log: Path
    timed_out: bool = False

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def render_args(args, paths: NodePaths, code_location: str | None) -> list[str]:
    """Container args with propeller's templates filled in (and flytectl's code tarball location)."""
    def fill(match: re.Match) -> str:
        value = getattr(paths, _TEMPLATES[match.group(1).lower()])
        return value if value or match.group(1).lower() != "prevcheckpointprefix" else '""'

    rendered = [_TEMPLATE_RE.sub(fill, arg) for arg in args]
    if any(REMOTE_PACKAGE_PATH in arg for arg in rendered):
        if code_location is None:
            raise ValueError("the task is fast-registered, but no code tarball was uploaded")
        rendered = [arg.replace(REMOTE_PACKAGE_PATH, code_location) for arg in rendered]
    return rendered


def flyte_env(template: tasks_pb2.TaskTemplate, execution: Execution, attempt: int) -> dict[str, str]:
    """The container's own env from the template plus the execution env Flyte's k8s plugins add
    (flyteplugins go/tasks/pluginmachinery/flytek8s/k8s_resource_adds.go, GetExecutionEnvVars)."""
    env = {kv.key: kv.value for kv in template.container.env}
    task = template.id
    env.update({
        "FLYTE_INTERNAL_EXECUTION_WORKFLOW": execution.workflow,
        "FLYTE_INTERNAL_EXECUTION_ID": execution.name,
        "FLYTE_INTERNAL_EXECUTION_PROJECT": execution.project,
        "FLYTE_INTERNAL_EXECUTION_DOMAIN": execution.domain,
        "FLYTE_ATTEMPT_NUMBER": str(attempt),
        "FLYTE_INTERNAL_TASK_PROJECT": task.project, "FLYTE_INTERNAL_TASK_DOMAIN": task.domain,
        "FLYTE_INTERNAL_TASK_NAME": task.name, "FLYTE_INTERNAL_TASK_VERSION": task.version,
        # The historic names, still set by the plugin for older SDKs.
        "FLYTE_INTERNAL_PROJECT": task.project, "FLYTE_INTERNAL_DOMAIN": task.domain,
        "FLYTE_INTERNAL_NAME": task.name, "FLYTE_INTERNAL_VERSION": task.version,
    })
    return env


def platform_env() -> dict[str, str]:
    """The object-store settings and credentials a platform gives every pod, from this environment."""
    return {k: v for k, v in os.environ.items() if k.startswith(_PLATFORM_ENV_PREFIXES)}


class RunningPod:
    """A started pod: wait for it, or stop its whole process group."""

    def __init__(self, spec: PodSpec, workdir: Path, python_bin: Path, echo: bool,
                 cpus: set[int] | None = None):
        self.spec, self.dir = spec, workdir / "pods" / spec.name
        for sub in ("home", "tmp", "work", "code"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        args = self._localize(spec.args)
        env = self._process_env(spec.env, python_bin)
        # Enough to rerun the pod by hand, but no credential: the platform's settings are named, and read
        # again from the environment of whoever starts the pod (as a platform injects them at run time).
        platform = sorted(set(platform_env()) - set(spec.env))
        started = {"args": args, "env": {k: v for k, v in env.items() if k not in platform},
                   "platform_env": platform, "cwd": str(self.dir / "work"),
                   "cpus": sorted(cpus) if cpus else None}
        (self.dir / "pod.json").write_text(json.dumps(started, indent=1))
        self.log = self.dir / "log.txt"
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, cwd=self.dir / "work", env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=pinned_to(cpus))
        self._tee = threading.Thread(target=self._copy_output, args=(echo,), daemon=True)
        self._tee.start()

    def _localize(self, args: list[str]) -> list[str]:
        """The code tarball's --dest-dir is a path in the image (/root): here, the pod's own directory."""
        args = list(args)
        for i, arg in enumerate(args[:-1]):
            if arg == "--dest-dir":
                args[i + 1] = str(self.dir / "code")
        return args

    def _process_env(self, container_env: dict[str, str], python_bin: Path) -> dict[str, str]:
        """Only what a pod would have: the image's PATH, the container env, the platform's store config."""
        env = platform_env()
        env.update({"PATH": f"{python_bin}{os.pathsep}/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}/bin",
                    "HOME": str(self.dir / "home"), "TMPDIR": str(self.dir / "tmp"), "LANG": "C.UTF-8"})
        env.update(container_env)
        return env

    def _copy_output(self, echo: bool) -> None:
        with open(self.log, "wb") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if echo:
                    sys.stdout.write(f"[{self.spec.name}] {line.decode(errors='replace')}")
                    sys.stdout.flush()

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """Kill the pod's process group (the agent and its workers), as deleting the pod would."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def result(self, timed_out: bool = False) -> PodResult:
        self._tee.join(timeout=10)
        return PodResult(self.spec.name, self.proc.returncode, time.monotonic() - self.started, self.log,
                         timed_out and self.proc.returncode < 0)


def _wait_serving(endpoint: str, pod: RunningPod, deadline: float) -> None:
    """Until something listens at ``endpoint`` (``host:port``), ``pod`` ends, or the deadline passes."""
    host, port = endpoint.rsplit(":", 1)
    while pod.poll() is None and time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.2)


def cpu_shares(pods: int) -> list[set[int] | None]:
    """The cores of each of ``pods`` pods started together (a job's workers): a share of this machine's,
    as each pod of the job on a cluster has its own node's (or, under the kubelet's static CPU policy,
    its own cpuset). None, every core, for a pod alone.

    Without it every pod of a job sees all of this machine's cores, and torch sizes each worker's
    intra-op pool (OpenMP, which reads the process's affinity) to all of them: two 1-process pods on 2
    cores ran 4 spinning threads. Measured on the replayed 2-pod S3 workflow (2 cores): the two workers
    took 17.2 and 15.9 CPU s unpinned, 12.6 and 11.5 pinned. With more pods than cores, pods share."""
    if pods < 2:
        return [None] * pods
    cores = sorted(os.sched_getaffinity(0))
    return [set(cores[i::pods]) or {cores[i % len(cores)]} for i in range(pods)]


def pinned_to(cpus: set[int] | list[int] | None):
    """For Popen's ``preexec_fn``: the started process runs on ``cpus`` (None: on every core)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def run_pods(specs: list[PodSpec], workdir: Path, python_bin: Path, timeout_s: float,
             echo: bool = False, recreate_after_s: float | None = None,
             first_serves: str | None = None) -> list[PodResult]:
    """Start every pod, wait for all; the first failure (or the timeout) stops the rest, as a job would.

    ``first_serves`` (``host:port``, a job's rendezvous endpoint): the other pods start once the first pod
    listens there. On a cluster only worker-0 can host the store, the endpoint being its Service's name;
    on loopback every pod's address matches, and the first agent to bind would host it.

    ``recreate_after_s`` (a job whose workers restart on failure): a pod killed by SIGKILL, as a lost node
    kills it, is made again that many seconds later (the operator's new pod, waiting to be scheduled), under
    the same name and on the same cores; the killed one's log is kept as ``log-lost-<n>.txt``."""
    shares = cpu_shares(len(specs))
    deadline, timed_out = time.monotonic() + timeout_s, False
    pods = [RunningPod(specs[0], workdir, python_bin, echo, shares[0])]
    if first_serves:
        _wait_serving(first_serves, pods[0], deadline)
    pods += [RunningPod(spec, workdir, python_bin, echo, cpus)
             for spec, cpus in zip(specs[1:], shares[1:], strict=True)]
    due: dict[int, float] = {}  # pod index -> when its new pod starts
    try:
        while any(p.poll() is None for p in pods) or due:
            timed_out = time.monotonic() > deadline
            for index, pod in enumerate(pods):
                if recreate_after_s is not None and pod.poll() == -signal.SIGKILL and index not in due:
                    due[index] = time.monotonic() + recreate_after_s
            for index, at in list(due.items()):
                if time.monotonic() >= at:
                    pods[index].result()  # its log is complete
                    lost = sorted(pods[index].dir.glob("log-lost-*.txt"))
                    pods[index].log.rename(pods[index].dir / f"log-lost-{len(lost)}.txt")
                    pods[index] = RunningPod(specs[index], workdir, python_bin, echo, shares[index])
                    del due[index]
            failed = [i for i, p in enumerate(pods) if p.poll() not in (None, 0) and i not in due]
            if failed or timed_out:
                break
            time.sleep(0.2)
    finally:
        for pod in pods:
            pod.stop()
    return [p.result(timed_out) for p in pods]
