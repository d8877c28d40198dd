"""`make image` and `make register` as docs/deploy.md gives them, where they can run here.

No container registry exists here, and a real build takes minutes (`make image-check` builds and runs the
image), so `make image` runs against a stand-in ``podman`` first on PATH that logs its arguments: what is
tested is what our Makefile and scripts/build-image ask of podman (the Dockerfile, the tag, whether to push)
and what they print. `make register`'s package is built and replayed by the replay tests (tests/replay,
``fast_package``); here, its refusals.
"""

from __future__ import annotations

import os
import re
import shlex
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


# --- refusals before anything is built ------------------------------------------------------------------

def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    """The script's ``error:`` lines (make adds a ``make: *** ... Error 2`` line of its own)."""
    return [line for line in run.stderr.splitlines() if "error:" in line and not line.startswith("make: ")]


@pytest.mark.parametrize("image, what, fix", [
    ("ghcr.io/Acme/flyte-torch-pipeline:v1",
     "upper-case letters in the repository path 'Acme/flyte-torch-pipeline'",
     "use lower case: ghcr.io/acme/flyte-torch-pipeline:v1"),
    ("ghcr.io/acme/flyte torch:v1", "white space", "remove it"),
    ("ghcr.io/acme/ftp:", "the tag after the last ':' is empty",
     "add one (ghcr.io/acme/ftp:v1) or drop the ':'"),
    ("ghcr.io/acme/ftp:-v1", "tag '-v1'", "must not start with '.' or '-'"),
    ("ghcr.io/acme/ftp:" + "v" * 129, "has 129 characters", "at most 128"),
    ("ghcr.io/acme//ftp:v1", "has an empty part", "remove the extra '/'"),
    ("ghcr.io/acme/ftp-:v1", "'ftp-' in the repository path starts or ends with a separator", "e.g."),
    ("ghcr.io/acme/ftp+x:v1", "has the character '+'", "lower-case letters, digits"),
    ('ghcr.io/acme/ftp"x:v1', "has the character '\"'", "lower-case letters, digits"),  # make quotes it
    ("ghcr.io:port/acme/ftp:v1", "port 'port' is not a number", "registry.example.com:5000"),
    ("-ghcr.io/acme/ftp:v1", "registry host '-ghcr.io' is not a DNS name", "e.g. ghcr.io"),
    ("ghcr.io/acme/ftp:v1@sha256:abc", "digest 'sha256:abc'", "64 lower-case hex digits"),
    ("ghcr.io/acme/ftp@sha256:" + "a" * 64, "a digest (@...) names an image that exists already",
     "give <registry>/<name>:<tag>, e.g. ghcr.io/acme/ftp:v1"),
])
def test_an_invalid_image_name_is_refused_with_one_line_before_any_build(podman_log, image, what, fix):
    run = make("image", f"IMAGE={image}", podman_log=podman_log)
    assert run.returncode == 2, run.stderr
    [line] = error_lines(run)
    assert line.startswith(f"build-image: error: IMAGE={shlex.quote(image)} is not a valid image name"), line
    assert what in line and fix in line and "; " in line, line
    assert not podman_log.exists()  # podman was never called


@pytest.mark.parametrize("image", [
    "registry.example.com:5000/team/flyte_torch__pipeline:1.0-rc_1", "localhost/ftp", "[::1]:5000/ftp:v1",
    "acme/a.b-c---d:latest", "ftp", "ghcr.io/acme/ftp:" + "v" * 128,
])
def test_names_the_grammar_accepts_are_built(podman_log, image):
    _, _, build = make_image(podman_log, f"IMAGE={image}")
    assert f" -t {image} " in build


@pytest.mark.parametrize("args, line", [
    (["VARIANT=gpu"], "build-image: error: VARIANT=gpu is not a variant: give cpu or cuda"),
    (["EXTRAS=connector,gui"], "pyproject.toml has no optional dependency group 'gui'; give one or more of: "
                               "connector dev"),
    (["EXTRAS=connector, dev"], "build-image: error: EXTRAS='connector, dev' has white space"),
    (["BUILD_OPTS=--wheels /no/such/wheelhouse"], "--wheels /no/such/wheelhouse: not a directory"),
    (["BUILD_OPTS=--ca-bundle /no/such/ca.pem"], "--ca-bundle /no/such/ca.pem: not a readable file"),
    (["BUILD_OPTS=--torch-index download.pytorch.org"], "--torch-index download.pytorch.org is not a URL"),
    (["BUILD_OPTS=--base Python:3.11"], "--base Python:3.11 is not a valid image name: upper-case"),
    (["BUILD_OPTS=--local-base --base python:3.11"], "--base and --local-base exclude each other"),
    (["BUILD_OPTS=--bogus"], "unknown option --bogus (scripts/build-image --help lists the options)"),
])
def test_other_bad_settings_are_refused_with_one_line_before_any_build(podman_log, args, line):
    run = make("image", "IMAGE=ghcr.io/acme/ftp:v1", *args, podman_log=podman_log)
    assert run.returncode == 2, run.stderr
    [error] = error_lines(run)
    assert line in error, error
    assert not podman_log.exists()


def test_relative_paths_are_the_callers(podman_log, tmp_path):
    """--wheels and --ca-bundle are relative to where build-image is run, not to the repository root."""
    cwd = tmp_path.resolve()
    (cwd / "wh").mkdir()
    (cwd / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    env = {k: v for k, v in os.environ.items() if k != "PWD"}
    env["PATH"] = f"{podman_log.parent / 'bin'}{os.pathsep}{env['PATH']}"
    script = [str(REPO / "scripts" / "build-image"), "--tag", "ghcr.io/acme/ftp:v1"]
    run = subprocess.run([*script, "--wheels", "wh", "--ca-bundle", "ca.pem"], cwd=cwd, capture_output=True,
                         text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr
    [build] = [call for call in podman_log.read_text().splitlines() if call.startswith("build ")]
    assert f"--volume {cwd}/wh:/tmp/wheels/0:ro" in build
    assert f"--volume {cwd}/ca.pem:/tmp/ca-bundle.pem:ro" in build
    # A path that is not there is named as given.
    for option, path, words in (("--wheels", "no-wh", "not a directory"), ("--ca-bundle", "no.pem",
                                                                             "not a readable file")):
        run = subprocess.run([*script, option, path], cwd=cwd, capture_output=True, text=True, timeout=60,
                             env=env)
        assert run.returncode == 2
        assert run.stderr.startswith(f"build-image: error: {option} {path}: {words}; "), run.stderr


def test_make_image_takes_relative_paths_from_the_repository_root(podman_log):
    _, _, build = make_image(podman_log, "IMAGE=ghcr.io/acme/ftp:v1", "BUILD_OPTS=--wheels dockerfiles")
    assert f"--volume {REPO}/dockerfiles:/tmp/wheels/0:ro" in build


def test_the_printed_register_command_can_be_pasted(podman_log):
    run, _, _ = make_image(podman_log, "IMAGE=registry.example.com:5000/team/ftp:v1")
    [line] = [line for line in run.stderr.splitlines() if "register with it: " in line]
    command = line.split("register with it: ", 1)[1]
    assert shlex.split(command) == ["make", "register", "IMAGE=registry.example.com:5000/team/ftp:v1"]


# --- one rule for "names a registry", shared by build-image and register --------------------------------

LIB = REPO / "scripts" / "lib.sh"


@pytest.mark.parametrize("image, registry", [
    ("ghcr.io/acme/ftp:v1", "ghcr.io"), ("registry.example.com:5000/ftp", "registry.example.com:5000"),
    ("localhost/ftp:dev", "localhost"), ("acme/ftp:v1", None), ("ftp:dev", None), ("localhost:5000", None),
])
def test_build_image_pushes_exactly_the_names_register_does_not_warn_about(podman_log, tmp_path, image,
                                                                          registry):
    for script in ("build-image", "register"):  # both source the rule; neither spells it out again
        source = (REPO / "scripts" / script).read_text()
        assert "source scripts/lib.sh" in source and not re.search(r"==\s*localhost", source), script
    rule = subprocess.run(["bash", "-c", 'source "$0" && image_registry "$1"', str(LIB), image],
                          capture_output=True, text=True)
    assert (rule.returncode, rule.stdout.strip() or None) == ((0, registry) if registry else (1, None))

    run = make("image", f"IMAGE={image}", podman_log=podman_log)
    assert run.returncode == 0, run.stderr
    pushed = any(call.startswith("push ") for call in podman_log.read_text().splitlines())
    pyflyte = tmp_path / "pyflyte"
    pyflyte.write_text("#!/bin/sh\n")
    pyflyte.chmod(0o755)
    register = subprocess.run([str(REPO / "scripts" / "register"), "--image", image, "--package",
                               str(tmp_path / "pkg.tgz")], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYFLYTE": str(pyflyte)})
    assert register.returncode == 0, register.stderr
    assert pushed == (registry is not None) == ("names no registry" not in register.stderr)
