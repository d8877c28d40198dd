"""scripts/ensure-image-tools, which `make image-check` runs first: on a machine without podman, buildah or
debootstrap it installs Debian's packages with apt-get (as root), otherwise it names the command to run.

Every case runs with PATH set to one directory holding only bash, dirname, a fake ``id`` (so the root and
non-root cases do not depend on who runs the tests) and, where the case has one, a fake ``apt-get`` that
logs its arguments. The real tools, installed or not on this machine, are never on that PATH.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENSURE = REPO / "scripts" / "ensure-image-tools"
IMAGE_CHECK = REPO / "scripts" / "image-check"
PACKAGES = "podman buildah debootstrap"
EXPECTED_APT_CALLS = [
    "DEBIAN_FRONTEND=noninteractive -q -o DPkg::Lock::Timeout=600 update",
    f"DEBIAN_FRONTEND=noninteractive -q -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "
    f"{PACKAGES}",
]


def executable(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}")
    path.chmod(0o755)


class Machine:
    """A PATH directory standing in for a machine: which tools it has, who runs, what apt-get does."""

    def __init__(self, root: Path, uid: int = 0, apt_installs: bool = True, has_apt: bool = True):
        self.bin = root / "bin"
        self.bin.mkdir()
        self.apt_log = root / "apt-get.log"
        for tool in ("bash", "dirname"):
            (self.bin / tool).symlink_to(shutil.which(tool))
        executable(self.bin / "id", f'[ "$1" = -u ] && echo {uid}\n')
        if has_apt:
            # Logs DEBIAN_FRONTEND and its arguments; 'install' puts stubs of the tools on PATH, as the real
            # packages would (apt_installs=False: a package that does not provide the command).
            install = (f'for t in {PACKAGES}; do echo "#!/bin/sh" > "{self.bin}/$t"; '
                       f'{shutil.which("chmod")} 755 "{self.bin}/$t"; done' if apt_installs else ":")
            executable(self.bin / "apt-get",
                       f'echo "DEBIAN_FRONTEND=$DEBIAN_FRONTEND $*" >> "{self.apt_log}"\n'
                       f'case " $* " in *" install "*) {install} ;; esac\n')

    def add_stub(self, tool: str) -> None:
        executable(self.bin / tool, "")

    def run(self, script: Path, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(script)], capture_output=True, text=True, timeout=60, cwd=REPO,
                              env={"PATH": str(self.bin), "HOME": str(self.bin.parent), **env})

    def apt_calls(self) -> list[str]:
        return self.apt_log.read_text().splitlines() if self.apt_log.exists() else []


@pytest.mark.parametrize("present", [(), ("podman", "debootstrap")], ids=["fresh", "only-buildah-missing"])
def test_root_installs_the_packages_once(tmp_path, present):
    machine = Machine(tmp_path)
    for tool in present:
        machine.add_stub(tool)
    done = machine.run(ENSURE)
    assert done.returncode == 0, done.stderr
    assert machine.apt_calls() == EXPECTED_APT_CALLS
    missing = " ".join(tool for tool in PACKAGES.split() if tool not in present)
    assert f"{missing} not installed: installing Debian packages {PACKAGES}" in done.stdout
    assert f"running: apt-get install -y --no-install-recommends {PACKAGES}" in done.stdout

    again = machine.run(ENSURE)  # everything there now: no apt-get, no output
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    assert machine.apt_calls() == EXPECTED_APT_CALLS


def test_non_root_gets_the_command_to_run(tmp_path):
    machine = Machine(tmp_path, uid=1000)
    done = machine.run(ENSURE)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"ensure-image-tools: error: {PACKAGES} not installed and installing needs root: run 'sudo {ENSURE}'"]
    assert machine.apt_calls() == []


def test_without_apt_get_it_names_the_packages(tmp_path):
    machine = Machine(tmp_path, has_apt=False)
    machine.add_stub("podman")
    done = machine.run(ENSURE)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "ensure-image-tools: error: buildah debootstrap not installed and there is no apt-get here: install "
        f"{PACKAGES} with this system's package manager"]


def test_image_check_installs_first_and_stops_when_that_fails(tmp_path):
    """`make image-check` runs scripts/image-check: the install step comes before anything else, and a
    package that does not provide its command stops the check with that one line."""
    machine = Machine(tmp_path, apt_installs=False)
    done = machine.run(IMAGE_CHECK)
    assert done.returncode == 1
    assert machine.apt_calls() == EXPECTED_APT_CALLS
    assert done.stderr.splitlines() == [
        f"ensure-image-tools: error: apt-get installed {PACKAGES} but {PACKAGES} is still not on PATH "
        f"({machine.bin})"]


@pytest.mark.parametrize("env, line", [
    ({"IMAGE_CHECK_VARIANT": "gpu"}, "IMAGE_CHECK_VARIANT=gpu is not a variant: give cpu or cuda"),
    ({"IMAGE_CHECK_STEPS": "ten"}, "IMAGE_CHECK_STEPS=ten is not a positive whole number"),
    ({"IMAGE_CHECK_FAST": "no"}, "IMAGE_CHECK_FAST=no: give 1"),
    ({"IMAGE_CHECK_CA_BUNDLE": "/no/such/ca.pem"}, "IMAGE_CHECK_CA_BUNDLE=/no/such/ca.pem: not a file"),
    ({"IMAGE_CHECK_WHEELS": "/no/such/wheels"}, "IMAGE_CHECK_WHEELS: /no/such/wheels is not a directory"),
])
def test_image_check_refuses_a_bad_setting_before_installing_anything(tmp_path, env, line):
    machine = Machine(tmp_path)
    done = machine.run(IMAGE_CHECK, **env)
    assert done.returncode == 2
    [error] = done.stderr.splitlines()
    assert error.startswith(f"image-check: error: {line}"), error
    assert machine.apt_calls() == []
