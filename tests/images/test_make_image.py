"""`make image` and `make register` as docs/deploy.md gives them, where they can run here.

No container registry exists here, and a real build takes minutes (`make image-check` builds and runs the
image), so `make image` runs against a stand-in ``podman`` first on PATH that logs its arguments: what is
tested is what our Makefile and scripts/build-image ask of podman (the Dockerfile, the tag, whether to push)
and what they print. `make register`'s package is built and replayed by the replay tests (tests/replay,
``fast_package``); here, its refusals.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def podman_log(tmp_path: Path) -> Path:
    """A ``podman`` that logs each call and reports an image size; first on PATH."""
    bin_dir, log = tmp_path / "bin", tmp_path / "podman.log"
    bin_dir.mkdir()
    fake = bin_dir / "podman"
    fake.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n'
                    'case "$1 $2" in "image inspect") echo 123000000 ;; esac\n')
    fake.chmod(0o755)
    return log


def make(*args: str, podman_log: Path | None = None) -> subprocess.CompletedProcess:
    path = os.environ["PATH"]
    if podman_log is not None:
        path = f"{podman_log.parent / 'bin'}{os.pathsep}{path}"
    return subprocess.run(["make", "--no-print-directory", *args, f"BIN={Path(sys.executable).parent}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": path})


def make_image(podman_log: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str], str]:
    """`make image ARGS`: the run, podman's calls and its one build call."""
    run = make("image", *args, podman_log=podman_log)
    assert run.returncode == 0, run.stderr
    calls = podman_log.read_text().splitlines()
    [build] = [call for call in calls if call.startswith("build ")]
    return run, calls, build


def test_an_image_named_with_a_registry_is_built_from_its_variant_and_pushed(podman_log):
    run, calls, build = make_image(podman_log, "IMAGE=ghcr.io/acme/flyte-torch-pipeline:v1", "VARIANT=cuda")
    assert "-f dockerfiles/cuda.Dockerfile -t ghcr.io/acme/flyte-torch-pipeline:v1" in build
    assert "--build-arg FLYTE_INTERNAL_IMAGE=ghcr.io/acme/flyte-torch-pipeline:v1" in build
    assert "EXTRAS" not in build
    assert calls[-1] == "push ghcr.io/acme/flyte-torch-pipeline:v1"
    assert "pushed ghcr.io/acme/flyte-torch-pipeline:v1: register with it: make register IMAGE=" in run.stderr
    assert run.stdout.splitlines()[-1] == "ghcr.io/acme/flyte-torch-pipeline:v1"


def test_a_name_without_a_registry_stays_a_local_image(podman_log):
    run, calls, build = make_image(podman_log, "IMAGE=flyte-torch-pipeline:dev", "EXTRAS=connector")
    assert "-f dockerfiles/cpu.Dockerfile -t flyte-torch-pipeline:dev" in build
    assert "--build-arg EXTRAS=connector" in build  # the connector's image
    assert not any(call.startswith("push") for call in calls)
    assert "not pushed: flyte-torch-pipeline:dev names no registry" in run.stderr


def test_a_failed_push_names_the_login_to_do(podman_log):
    fake = podman_log.parent / "bin" / "podman"
    fake.write_text(fake.read_text() + 'case "$1" in push) exit 125 ;; esac\n')
    run = make("image", "IMAGE=registry.example.com:5000/team/ftp:1", podman_log=podman_log)
    assert run.returncode != 0
    assert "podman push registry.example.com:5000/team/ftp:1 failed: log in first (podman login " \
           "registry.example.com:5000)" in run.stderr


@pytest.mark.parametrize("target", ["image", "register"])
def test_without_an_image_both_say_what_to_pass(target, podman_log):
    run = make(target, podman_log=podman_log)
    assert run.returncode != 0 and "IMAGE=<registry>/<name>:<tag>" in run.stderr, run.stderr
    assert not podman_log.exists()  # nothing was built


def test_register_needs_a_config_that_exists():
    run = make("register", "IMAGE=ghcr.io/acme/ftp:v1", "CONFIG=no-such.config")
    assert run.returncode != 0
    assert "config no-such.config not found: pass CONFIG=<your pyflyte config>" in run.stderr
