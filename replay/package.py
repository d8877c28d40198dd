"""Read a `pyflyte package` archive: task, workflow and launch-plan protobufs and the fast-registration code.

File names end in ``_1.pb`` (admin TaskSpec), ``_2.pb`` (admin WorkflowSpec) or ``_3.pb`` (admin LaunchPlan);
with ``--copy all`` (fast registration) the archive also holds the code tarball ``fast<digest>.tar.gz``.
"""

from __future__ import annotations

import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flyteidl.core import tasks_pb2
from flyteidl.core import workflow_pb2 as core_workflow_pb2

# flytectl's placeholder for the uploaded code tarball; `flytectl register files --archive` substitutes it.
REMOTE_PACKAGE_PATH = "{{ .remote_package_path }}"


class PackageError(ValueError):
    """The archive is not a usable `pyflyte package` output."""


@dataclass
class Package:
    """Every entity of one archive, by name."""

    tasks: dict[str, tasks_pb2.TaskTemplate] = field(default_factory=dict)
    workflows: dict[str, core_workflow_pb2.WorkflowTemplate] = field(default_factory=dict)
    launch_plans: dict[str, launch_plan_pb2.LaunchPlan] = field(default_factory=dict)
    code_tarball: Path | None = None  # fast registration only

    @property
    def fast(self) -> bool:
        """True when the tasks fetch their code at start-up (pyflyte-fast-execute)."""
        return any(REMOTE_PACKAGE_PATH in t.container.args for t in self.tasks.values())

    def launch_plan(self, name: str | None) -> launch_plan_pb2.LaunchPlan:
        """The named launch plan, or the only default launch plan of a workflow when ``name`` is None."""
        if name:
            if name not in self.launch_plans:
                raise PackageError(f"no launch plan {name!r}; the package has {sorted(self.launch_plans)}")
            return self.launch_plans[name]
        defaults = [lp for n, lp in self.launch_plans.items() if n in self.workflows]
        if len(defaults) != 1:
            raise PackageError(f"name a launch plan with --launch-plan: {sorted(self.launch_plans)}")
        return defaults[0]


def read_package(archive: Path, extract_to: Path) -> Package:
    """Parse every entity of ``archive``; the code tarball, if any, is extracted to ``extract_to``."""
    package = Package()
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    _add_member(package, member.name, tar.extractfile(member).read(), extract_to)
    except (tarfile.TarError, EOFError, zlib.error) as exc:  # a truncated or corrupt archive
        raise PackageError(f"{archive} is not a readable tar archive ({exc}): make it again with "
                           "`pyflyte package`") from exc
    if not package.tasks:
        raise PackageError(f"{archive} holds no task specs: is it a `pyflyte package` output?")
    if package.fast and package.code_tarball is None:
        raise PackageError(f"{archive}: the tasks are fast-registered but the archive has no code tarball")
    return package


def _add_member(package: Package, name: str, data: bytes, extract_to: Path) -> None:
    """Parse one archive member into ``package`` by its name's ending (see the module's docstring)."""
    if name.endswith(".tar.gz"):
        extract_to.mkdir(parents=True, exist_ok=True)
        package.code_tarball = extract_to / Path(name).name
        package.code_tarball.write_bytes(data)
    elif name.endswith("_1.pb"):
        template = task_pb2.TaskSpec.FromString(data).template
        package.tasks[template.id.name] = template
    elif name.endswith("_2.pb"):
        spec = workflow_pb2.WorkflowSpec.FromString(data)
        for wf in (spec.template, *spec.sub_workflows):
            package.workflows[wf.id.name] = wf
    elif name.endswith("_3.pb"):
        plan = launch_plan_pb2.LaunchPlan.FromString(data)
        package.launch_plans[plan.id.name] = plan
